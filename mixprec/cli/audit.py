"""``mixprec audit``: the pre-flight precision audit of a training set-up, without training.

Builds the model, data, optimizer and loss scaler exactly as ``mixprec train`` would for the same
settings, prints the per-layer table of every precision decision (``Precision.describe(model)``),
runs the static checks plus one forward probe, then one real step (without keeping it) to find
parameters that receive no gradient. The probe and the step run exactly as training runs them
(``Trainer.batch_loss``: the mode's autocast, the loss in FP32). ``--resume RUN`` audits that run:
its settings (model, precision, ...) and its newest checkpoint's weights, read only.
Exit status 1 when a finding is an error.
"""
from __future__ import annotations

import argparse

import torch

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    from mixprec.cli import train as command
    command.configure(parser)


def run(args: argparse.Namespace) -> int:
    from mixprec.monitor import audit, audit_after_first_step, format_findings
    from mixprec.cli.train import _resolve, build_run
    from mixprec.train.trainer import Trainer

    if args.list:
        from mixprec.cli import train as command
        return command.run(args)
    cfg, _, resume_from = _resolve(args)
    model, train_loader, _, strategy = build_run(cfg)
    trainer = Trainer(model, config=cfg, strategy=strategy)
    trainer.prepare(total_steps=1)
    if resume_from is not None:   # the run's weights, loss scale and schedule; nothing is written
        from mixprec.runs.checkpointer import Checkpointer
        Checkpointer(strategy, None, keep_last=cfg.keep_last).load(
            resume_from, model=trainer.model, optimizer=trainer.optimizer, precision=trainer.precision,
            scheduler=trainer.scheduler, loader=train_loader)
    batch = next(iter(train_loader))

    def probe() -> torch.Tensor:   # the loss as the objective returns it (audit adds the autocast)
        return trainer.objective(trainer.model, strategy.to_device(batch))

    findings = audit(strategy.unwrap(trainer.model), precision=trainer.precision,
                     optimizer=trainer.optimizer, loss_fn=probe, device=trainer.device)
    # One real forward/backward (no optimizer step) to see which parameters get gradients.
    with torch.random.fork_rng(devices=[]):
        trainer.optimizer.zero_grad(set_to_none=True)
        loss, _ = trainer.batch_loss(trainer.model, batch)   # as the training step computes it
        trainer.precision.backward(loss)
    findings += audit_after_first_step(strategy.unwrap(trainer.model))
    if strategy.is_main:
        if resume_from is not None:
            print(f"run: {resume_from} (model {cfg.model}, its newest checkpoint's weights)")
        print(f"precision: {trainer.precision.describe()}")
        print(trainer.precision.describe(strategy.unwrap(trainer.model)))   # every layer's decisions
        print(format_findings(findings))
    strategy.teardown()
    return 1 if any(f.severity == "error" for f in findings) else 0
