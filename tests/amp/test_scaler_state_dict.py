"""GradScaler checkpoints: round trip in process, through torch.save, and into a fresh process."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from mixprec.amp import GradScaler
from mixprec.errors import CheckpointError

SETTINGS = dict(init_scale=2.0 ** 12, growth_factor=2.0, backoff_factor=0.25, growth_interval=3,
                hysteresis=2, min_scale=2.0 ** -4, max_scale=2.0 ** 20)
SEQ = [False, True, False, False, False, True, True, False, True, False, False]


def _run(scaler: GradScaler, seq: list[bool]) -> list[float]:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    out = []
    for overflow in seq:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if overflow:
            p.grad[0] = math.nan
        scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
    return out


def test_round_trip_restores_scale_counters_and_future_trajectory():
    a = GradScaler(**SETTINGS)
    _run(a, SEQ)
    b = GradScaler()                                   # defaults: settings come from the state
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert (b.num_overflows, b.num_skipped_steps) == (a.num_overflows, a.num_skipped_steps) == (4, 4)
    assert _run(b, SEQ) == _run(a, SEQ)


def test_state_dict_loads_with_weights_only_in_a_fresh_process(tmp_path):
    a = GradScaler(**SETTINGS)
    _run(a, SEQ)
    path = tmp_path / "scaler.pt"
    torch.save(a.state_dict(), path)
    code = textwrap.dedent(f"""
        import json, math, torch
        from mixprec.amp import GradScaler
        s = GradScaler()
        s.load_state_dict(torch.load({str(path)!r}, weights_only=True))
        p = torch.nn.Parameter(torch.ones(3)); opt = torch.optim.SGD([p], lr=0.1)
        scales = []
        for overflow in {SEQ!r}:
            opt.zero_grad(); s.scale(p.sum()).backward()
            if overflow: p.grad[0] = math.nan
            s.step(opt); s.update(); scales.append(s.get_scale())
        print(json.dumps({{"state": s.state_dict(), "scales": scales}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["scales"] == _run(a, SEQ)
    assert result["state"] == a.state_dict()


def test_loading_a_disabled_state_into_an_enabled_scaler_is_a_clear_error():
    off = GradScaler(enabled=False)
    on = GradScaler()
    with pytest.raises(CheckpointError, match="saved with scaling disabled"):
        on.load_state_dict(off.state_dict())


def test_loading_invalid_settings_is_a_checkpoint_error():
    state = GradScaler().state_dict() | {"growth_factor": 0.5}
    with pytest.raises(CheckpointError, match="invalid settings"):
        GradScaler().load_state_dict(state)
