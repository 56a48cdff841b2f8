"""mixprec.strategies (being built)."""
