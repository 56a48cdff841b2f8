"""mixprec.train (being built)."""
