"""mixprec.optim (being built)."""
