"""mixprec.monitor (being built)."""
