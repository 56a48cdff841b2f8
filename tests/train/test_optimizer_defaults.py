"""fit()'s AdamW uses language-model defaults (beta2 0.95, weight decay 0.1), not torch's (0.999,
0.01), and says so where a user looks; config.toml records the betas that trained, whoever built
the optimizer."""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import torch

from mixprec.cli.main import main
from mixprec.train.trainer import Trainer, fit

sys.path.insert(0, str(Path(__file__).parent))
from test_resume_lifecycle import QUIET, Regressor, batches  # noqa: E402


def test_fit_builds_adamw_with_beta2_095_and_records_what_it_trained_with(tmp_path):
    trainer = Trainer(Regressor(), max_steps=1, run_dir=str(tmp_path / "run"), **QUIET)
    trainer.fit(batches(2))
    group = trainer.optimizer.param_groups[0]
    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert group["betas"] == (0.9, 0.95) and (saved["beta1"], saved["beta2"]) == group["betas"]
    assert saved["weight_decay"] == 0.1 == max(g["weight_decay"] for g in trainer.optimizer.param_groups)


def test_an_optimizer_you_pass_keeps_torchs_beta2_and_config_toml_records_it(tmp_path):
    model = Regressor()
    fit(model, batches(2), optimizer=torch.optim.AdamW(model.parameters()), max_steps=1,
        run_dir=str(tmp_path / "run"), **QUIET)
    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert (saved["beta1"], saved["beta2"]) == (0.9, 0.999)


def test_the_difference_from_torch_is_said_in_train_list_and_fits_docstring(capsys):
    assert main(["train", "--list"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.split()[:1] == ["beta2"])
    assert "0.95" in line and "0.999" in line
    assert "betas=(0.9, 0.95)" in fit.__doc__ and "0.999" in fit.__doc__


def test_a_schedule_moved_onto_the_masters_raises_no_torch_scheduler_warning(tmp_path):
    import warnings
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, batches(3), optimizer=opt, lr_scheduler=sched, max_steps=3, run_dir=str(tmp_path / "run"),
            **{**QUIET, "mixed_precision": "bf16-true"})
    assert sched.optimizer is not opt                      # moved onto the FP32 masters
    assert not [w for w in caught if "optimizer.step()" in str(w.message)], [str(w.message) for w in caught]
    assert sched.last_epoch == 3
