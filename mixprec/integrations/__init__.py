"""Integrations with other training loops (Lightning, the Hugging Face Trainer). Each uses the
same :class:`mixprec.Precision` object as ``fit()`` and a user's own loop, so none can drift."""
