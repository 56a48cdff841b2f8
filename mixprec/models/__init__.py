"""mixprec.models (being built)."""
