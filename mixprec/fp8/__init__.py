"""mixprec.fp8 (being built)."""
