"""mixprec inside the trainers users already have: Lightning and the Hugging Face Trainer.

* :mod:`mixprec.integrations.lightning`: ``MixprecPrecision`` (a Lightning precision plugin for
  ``Trainer(plugins=[...])``), ``MixprecFabricPrecision`` (the same for ``Fabric(plugins=[...])``)
  and ``MixprecCallback`` (the audit at start, non-finite steps traced to their layer).
* :mod:`mixprec.integrations.transformers`: ``MixprecCallback`` for ``transformers.Trainer(...,
  callbacks=[...])`` and ``MixprecTrainer``, the Trainer subclass (or ``MixprecTrainerMixin`` for
  your own subclass) that hands the precision-critical part of the step to mixprec.

Both delegate every precision decision to one :class:`mixprec.Precision` (set-up, autocast,
backward, step, checkpoint state), the object ``fit()`` and a hand-written loop use. Neither
framework is imported by ``import mixprec``: import the submodule you need (docs/integrations.md).
"""

__all__: list[str] = []
