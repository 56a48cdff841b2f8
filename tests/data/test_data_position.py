"""Exact resume with the loaders users already have: a torch DataLoader over a map-style dataset
(shuffled, with a sampler, with workers) or a list continues from the next batch in the same
order, without loading the skipped batches; an iterable whose position cannot be restored is
said so at the start and at resume, and recorded."""
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

import mixprec as mp
from mixprec.data.position import resumable
from mixprec.runs.metrics import read_events, read_metrics


class Counting(Dataset):
    """A map-style dataset that counts the items it loads."""

    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, generator=g)
        self.loaded = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.loaded += 1
        return self.x[i], self.y[i]


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))

    def forward(self, x, y):
        return F.mse_loss(self.net(x).squeeze(-1), y)


LOADERS = {
    "shuffle-workers": lambda ds: DataLoader(ds, batch_size=4, shuffle=True, num_workers=2),
    "sampler": lambda ds: DataLoader(ds, batch_size=4, sampler=RandomSampler(
        ds, generator=torch.Generator().manual_seed(7))),
    "list": lambda ds: list(DataLoader(ds, batch_size=4)),
}


def _fit(loader, run_dir, **kw):
    return mp.fit(Regressor(), loader, mixed_precision="32-true", max_steps=20, ckpt_interval=10,
                  lr=1e-2, warmup_steps=0, progress=False, audit=False, log_interval=1,
                  run_dir=str(run_dir), **kw)


def _weights(run_dir, step):
    from mixprec.runs.checkpoint import load_checkpoint
    state, _, _ = load_checkpoint(run_dir / "checkpoints" / f"step-{step:08d}")
    return state


@pytest.mark.parametrize("kind", LOADERS)
def test_ten_plus_ten_steps_equal_twenty_bit_for_bit(kind, tmp_path):
    """16 batches an epoch: the resumed run continues epoch 0 at batch 11 and crosses into epoch 1."""
    _fit(LOADERS[kind](Counting()), tmp_path / "straight")
    run = tmp_path / "split"
    _fit(LOADERS[kind](Counting()), run)
    # As if the run had died after step 10: back to that checkpoint, then resume in a fresh
    # model, dataset and loader (what a new process builds).
    shutil.rmtree(run / "checkpoints" / "step-00000020")
    (run / "checkpoints" / "latest").write_text("step-00000010\n")
    _fit(LOADERS[kind](Counting()), run, resume=True)
    a, b = _weights(tmp_path / "straight", 20), _weights(run, 20)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = lambda d: [r["loss"] for r in read_metrics(d)]  # noqa: E731
    assert losses(run) == losses(tmp_path / "straight")
    assert not [e for e in read_events(run) if e["kind"] == "data"]    # nothing to warn about


def test_resume_skips_the_consumed_batches_without_loading_them():
    ds = Counting()
    first = resumable(DataLoader(ds, batch_size=4, shuffle=True), seed=3)
    it = iter(first)
    seen = [next(it) for _ in range(6)]
    state = first.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (0, 6)
    expected = next(it)
    ds.loaded = 0
    again = resumable(DataLoader(ds, batch_size=4, shuffle=True), seed=3)
    again.load_state_dict(state)
    got = next(iter(again))
    assert ds.loaded == 4                                  # one batch loaded, not seven
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not any(torch.equal(got[0], s[0]) for s in seen)


def test_shuffling_does_not_draw_from_the_training_rng():
    loader = resumable(DataLoader(Counting(), batch_size=4, shuffle=True), seed=0)
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    for _ in loader:
        pass
    assert torch.equal(torch.rand(3), expected)


def test_a_changed_batch_size_is_refused_mid_epoch_in_one_line():
    first = resumable(DataLoader(Counting(), batch_size=4, shuffle=True))
    it = iter(first)
    next(it)
    state = first.state_dict()
    with pytest.raises(mp.errors.ConfigError, match="batch_size=4 \\(now 8\\)"):
        resumable(DataLoader(Counting(), batch_size=8, shuffle=True)).load_state_dict(state)


class Stream:
    """An iterable with no position of its own (like a generator over a file)."""

    def __init__(self):
        self.data = list(DataLoader(Counting(), batch_size=4))

    def __iter__(self):
        return iter(self.data)


def test_an_iterable_without_position_is_said_at_start_and_at_resume_and_recorded(tmp_path, capsys):
    run = tmp_path / "run"
    _fit(Stream(), run)
    start = [e for e in read_events(run) if e["kind"] == "data"]
    assert len(start) == 1 and start[0]["exact"] is False and start[0]["step"] == 0
    assert "Stream" in start[0]["message"] and "another data order" in start[0]["message"]
    assert start[0]["message"] in capsys.readouterr().err
    from mixprec.runs.checkpoint import load_checkpoint
    _, state, _ = load_checkpoint(run / "checkpoints" / "step-00000010")
    assert state["loader"]["exact"] is False and "Stream" in state["loader"]["why"]
    shutil.rmtree(run / "checkpoints" / "step-00000020")
    (run / "checkpoints" / "latest").write_text("step-00000010\n")
    _fit(Stream(), run, resume=True)
    resumed = [e for e in read_events(run) if e["kind"] == "data" and e["step"] == 10]
    assert len(resumed) == 1 and "resumed at step 10" in resumed[0]["message"]
    assert "data order differs" in resumed[0]["message"]
    assert resumed[0]["message"] in capsys.readouterr().err
