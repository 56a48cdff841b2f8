"""mixprec.bench (being built)."""
