"""mixprec.nn (being built)."""
