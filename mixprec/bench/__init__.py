"""Measurements (things that are run and timed): matmul throughput per dtype, and training steps
per precision mode beside peer libraries. Estimators that only compute live in :mod:`mixprec.estimate`."""
