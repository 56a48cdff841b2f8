"""``mixprec audit``: the pre-flight precision audit of a training set-up, without training.

Builds the model, data, optimizer and loss scaler exactly as ``mixprec train`` would for the same
settings, prints the per-layer table of every precision decision (``Precision.describe(model)``),
runs the static checks plus one forward probe, then one real step (without keeping it) to find
parameters that receive no gradient. Exit status 1 when a finding is an error.
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
    cfg, _, _ = _resolve(args)
    model, train_loader, _, strategy = build_run(cfg)
    trainer = Trainer(model, config=cfg, strategy=strategy)
    trainer.prepare(total_steps=1)
    batch = strategy.to_device(next(iter(train_loader)))

    def probe() -> torch.Tensor:   # the loss exactly as fit() computes it
        return trainer.objective(trainer.model, batch)

    findings = audit(strategy.unwrap(trainer.model), precision=trainer.precision,
                     optimizer=trainer.optimizer, loss_fn=probe, device=trainer.device)
    # One real forward/backward (no optimizer step) to see which parameters get gradients.
    with torch.random.fork_rng(devices=[]):
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.precision.backward(probe().float())
    findings += audit_after_first_step(strategy.unwrap(trainer.model))
    if strategy.is_main:
        print(f"precision: {trainer.precision.describe()}")
        print(trainer.precision.describe(strategy.unwrap(trainer.model)))   # every layer's decisions
        print(format_findings(findings))
    strategy.teardown()
    return 1 if any(f.severity == "error" for f in findings) else 0
