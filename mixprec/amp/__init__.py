"""mixprec.amp (being built)."""
