"""The guard is one of the step hooks (train/hooks.py): last in ``Trainer.hooks``, fed by the
same ``after_step`` call as the others, with the step's traced event and a replay of its forward."""
from __future__ import annotations

import torch
from torch import nn

import mixprec as mp
from mixprec.train.hooks import GuardHook, StepHook
from mixprec.train.outcome import watch


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 16)
        self.fc = nn.Linear(16, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, idx, targets):
        return nn.functional.cross_entropy(self.head(self.fc(self.emb(idx))).flatten(0, 1), targets.flatten())


def _loader():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(4)]
    return [(x, (3 * x + 1) % 64) for x in xs]


def test_the_guard_is_the_last_step_hook_and_sees_each_step(tmp_path, monkeypatch):
    seen = []

    class Spy(StepHook):
        def after_step(self, trainer, step, out, origin):
            seen.append((step, len(trainer.step_batches), trainer.step_event))

    trainer = mp.Trainer(_Net(), mixed_precision="fp8-tensorwise", max_steps=2, run_dir=str(tmp_path / "r"),
                         progress=False, audit=False, guard=True, ckpt_interval=0, log_interval=1)
    trainer.prepare(2)
    assert isinstance(trainer.hooks[-1], GuardHook) and trainer.hooks[-1].guard is trainer.guard
    assert not hasattr(trainer, "_run_guard")
    calls = []
    real = trainer.guard.after_step
    monkeypatch.setattr(trainer.guard, "after_step",
                        lambda outcome, probe=None: (calls.append(outcome.step), real(outcome, probe))[1])
    trainer.hooks.insert(0, Spy())
    for step, batch in enumerate(_loader()[:2], 1):
        trainer.step = step - 1
        out = trainer.train_step([batch])
        trainer.step = step
        watch(trainer, [batch], out, None)
    assert calls == [1, 2]
    assert seen == [(1, 1, None), (2, 1, None)]


def test_a_loss_scale_warm_up_in_16_mixed_promotes_no_layer(tmp_path, capsys):
    """The new-user trial: ``16-mixed guard=true init_scale=1e6`` moved ``blocks.1.mlp.proj`` to
    FP32 at step 2 and another layer at step 4 while the scale halved to its level. The hook hands
    the guard the origin's direction and the step's scale, so it tells that search from a layer's
    fault (TrainingGuard.scaler_searching)."""
    import json

    from mixprec.cli.main import main
    run = tmp_path / "r"
    rc = main(["train", "model=tiny", "seq_len=32", "batch_size=4", "progress=false", "audit=false",
               "--precision", "16-mixed", "guard=true", "init_scale=1e6", "max_steps=8",
               f"run_dir={run}"])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    assert [e["step"] for e in events if e["kind"] == "skip"][:2] == [1, 2]     # the search happened
    assert [e for e in events if e["kind"] == "format"] == [] and "-> fp32" not in err
