"""mixprec.data (being built)."""
