"""The trainer declares its state: every attribute it ever sets is set in ``__init__``, and the
optional per-step helpers it was given are one list of step hooks (train/hooks.py). It is the loop,
under 250 lines, with its collaborators in train/ used by composition."""
from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import torch
from torch import nn

import mixprec as mp
from mixprec.train.hooks import NumericsHook, ScaleWatchHook, StepHook
from mixprec.train.outcome import Outcomes
from mixprec.train.trainer import Trainer


def _assigned(fn: ast.FunctionDef) -> set[str]:
    """Names ``X`` of every ``self.X = ...`` (plain, annotated, augmented, unpacked) in ``fn``."""
    out = set()
    for node in ast.walk(fn):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def test_every_attribute_the_trainer_sets_is_declared_in_init():
    cls = ast.parse(textwrap.dedent(inspect.getsource(Trainer))).body[0]
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    declared = _assigned(methods.pop("__init__"))
    late = {name: attr for name, f in methods.items() for attr in _assigned(f) - declared}
    assert late == {}


def test_the_trainer_is_the_loop_under_250_lines_and_no_class_of_train_is_longer():
    import mixprec.train
    lines = {}
    for path in sorted(Path(mixprec.train.__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                lines[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert lines["trainer.py:Trainer"] < 250
    assert {name: n for name, n in lines.items() if n >= 250} == {}


def test_the_trainer_composes_its_collaborators_instead_of_inheriting_them():
    assert Trainer.__bases__ == (object,)
    trainer = mp.Trainer(_Net(), mixed_precision="32-true", progress=False)
    assert isinstance(trainer.outcomes, Outcomes)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, idx, targets):
        return nn.functional.cross_entropy(self.head(self.emb(idx)).flatten(0, 1), targets.flatten())


def test_the_helpers_given_are_step_hooks_and_a_fit_adds_no_attribute(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = [(x, (x + 1) % 32) for x in (torch.randint(0, 32, (2, 8), generator=g) for _ in range(2))]
    trainer = mp.Trainer(_Net(), mixed_precision="16-mixed", max_steps=1, run_dir=str(tmp_path / "r"),
                         progress=False, audit=False, monitor_every=1, ckpt_interval=0)
    before = set(vars(trainer))
    trainer.fit(data)
    assert set(vars(trainer)) == before
    assert [type(h) for h in trainer.hooks] == [ScaleWatchHook, NumericsHook]
    assert all(isinstance(h, StepHook) for h in trainer.hooks)
