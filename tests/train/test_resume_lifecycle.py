"""A resumed run trains at what it prints and records (lr, schedule, max_steps), says which
checkpoint it uses and why, starts over a folder with no checkpoint, and tells a Python user the
Python way out; the position of the data follows a batch_size/seq_len change honestly."""
import csv
import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.errors import ConfigError
from mixprec.optim.schedule import WarmupCosine
from mixprec.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_run_safety import InfAfter, _regressor_batches  # noqa: E402


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.lin(x).squeeze(-1), y)


def batches(n=32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, generator=g)) for _ in range(n)]


QUIET = dict(mixed_precision="32-true", progress=False, audit=False, log_interval=1, eval_interval=0)


def metrics_lr(run: Path) -> dict[int, float]:
    with open(run / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def test_resume_with_a_new_lr_schedule_and_max_steps_trains_at_the_new_schedule(tmp_path):
    run = tmp_path / "run"
    mp.fit(Regressor(), batches(), max_steps=6, lr=1e-3, warmup_steps=2, ckpt_interval=3,
           run_dir=str(run), **QUIET)
    # Extend the finished run with new settings: the cosine is re-stretched to step 20.
    trainer = Trainer(Regressor(), max_steps=20, lr=0.01, warmup_steps=5, run_dir=str(run), **QUIET)
    trainer.fit(batches(), resume=True)
    curve = WarmupCosine(5, 20, 0.1)
    # metrics.csv's lr at step s is the LR step s ran at: lr * curve(s - 1) (no step was skipped).
    logged = metrics_lr(run)
    assert all(logged[s] == pytest.approx(0.01 * curve(s - 1), rel=1e-12) for s in range(7, 21))
    assert logged[7] > 5 * 0.01 * 0.1          # not the floor: the longer run's LR at step 7
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * curve(20), rel=1e-12)
    assert all(g["initial_lr"] == 0.01 for g in trainer.optimizer.param_groups)
    saved = tomllib.loads((run / "config.toml").read_text())
    assert (saved["lr"], saved["warmup_steps"], saved["max_steps"]) == (0.01, 5, 20)
    said = [e["message"] for e in events(run) if e["kind"] == "schedule"]
    assert said == [f"resumed schedule: lr {1e-3 * WarmupCosine(2, 6, 0.1)(6):.4g} -> "
                    f"{0.01 * curve(6):.4g} at step 6 (lr=0.01, warmup_steps=5, min_lr_ratio=0.1, "
                    "cosine to step 20)"]


def test_resume_with_unchanged_settings_keeps_the_lr_bit_for_bit(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    mp.fit(Regressor(), batches(), max_steps=8, lr=1e-3, warmup_steps=2, run_dir=str(straight), **QUIET)
    mp.fit(Regressor(), batches(), max_steps=8, lr=1e-3, warmup_steps=2, run_dir=str(split),
           ckpt_interval=3, **QUIET)
    # Step 3's checkpoint, resumed with the same settings: the same LRs, exactly.
    mp.fit(Regressor(), batches(), max_steps=8, lr=1e-3, warmup_steps=2, run_dir=str(split),
           **QUIET, resume=str(split / "checkpoints" / "step-00000003"))
    assert metrics_lr(split) == metrics_lr(straight)
    assert not [e for e in events(split) if e["kind"] == "schedule"]
    # Resuming from an earlier checkpoint says the newer ones (steps 6, 8) will be replaced.
    said = [e["message"] for e in events(split) if e["kind"] == "checkpoint"]
    assert said == ["resuming from step-00000003; the newer checkpoints step-00000006, step-00000008 are from the "
                    "run's earlier course: each is replaced when this run saves its step"]


def test_max_steps_below_the_checkpoint_is_refused_in_one_line(tmp_path):
    run = tmp_path / "run"
    mp.fit(Regressor(), batches(), max_steps=4, run_dir=str(run), **QUIET)
    with pytest.raises(ConfigError, match="checkpoint is at step 4, past max_steps=2; resume with max_steps=4"):
        mp.fit(Regressor(), batches(), max_steps=2, run_dir=str(run), resume=True, **QUIET)


def test_an_incomplete_newest_checkpoint_is_named_and_kept_not_skipped_silently(tmp_path):
    run = tmp_path / "run"
    mp.fit(Regressor(), batches(), max_steps=4, ckpt_interval=2, run_dir=str(run), **QUIET)
    ckpts = run / "checkpoints"
    (ckpts / "step-00000004" / "meta.json").unlink()       # `latest` names it
    mp.fit(Regressor(), batches(), max_steps=4, run_dir=str(run), resume=True, **QUIET)
    notes = [e for e in events(run) if e["kind"] == "checkpoint"]
    assert len(notes) == 1 and notes[0]["step"] == 2
    assert notes[0]["message"].startswith("resuming from step-00000002, the newest complete checkpoint: "
                                          "step-00000004 has no meta.json")
    # The run saved step 4 again; the incomplete folder is kept under another name.
    assert (ckpts / "incomplete-step-00000004" / "model.safetensors").is_file()
    assert (ckpts / "step-00000004" / "meta.json").is_file()


def _killed_before_its_first_save(run: Path) -> None:
    """What a run killed before its first checkpoint leaves: its config and metrics, no checkpoint."""
    run.mkdir()
    (run / "config.toml").write_text('precision = "32-true"\nmax_steps = 4\n')
    (run / "metrics.csv").write_text("step,loss\n1,0.5\n")


def test_a_folder_without_a_checkpoint_is_refused_with_the_python_way_out(tmp_path):
    run = tmp_path / "run"
    _killed_before_its_first_save(run)
    with pytest.raises(ConfigError) as err:
        mp.fit(Regressor(), batches(), max_steps=4, run_dir=str(run), **QUIET)
    assert f"continue it with `fit(..., run_dir={str(run)!r}, resume=True)`" in str(err.value)
    assert "pass overwrite=True" in str(err.value) and "mixprec train" not in str(err.value)
    assert (run / "metrics.csv").read_text() == "step,loss\n1,0.5\n"          # nothing lost


def test_resuming_a_folder_without_a_checkpoint_starts_it_over_and_says_so(tmp_path):
    run = tmp_path / "run"
    _killed_before_its_first_save(run)
    result = mp.fit(Regressor(), batches(), max_steps=4, run_dir=str(run), resume=True, **QUIET)
    assert result.steps == 4
    restart = [e for e in events(run) if e["kind"] == "restart"]
    assert len(restart) == 1 and "holds no complete checkpoint" in restart[0]["message"]
    assert sorted(metrics_lr(run)) == [1, 2, 3, 4]


def test_fit_records_the_model_and_the_batch_shape_in_config_toml(tmp_path):
    run = tmp_path / "run"
    x, y = torch.randn(32, 4), torch.randn(32)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    mp.fit(Regressor(), loader, max_steps=1, run_dir=str(run), **QUIET)
    saved = tomllib.loads((run / "config.toml").read_text())
    assert saved["model"] == f"fit: {Regressor.__module__}.Regressor"
    assert saved["batch_size"] == 8


# --- the data position after a batch_size or seq_len change -------------------------------------

def _loader(n=40, batch_size=4):
    ds = torch.utils.data.TensorDataset(torch.arange(n), torch.arange(n))
    return mp.data.DistributedDataLoader(ds, batch_size, seed=0, rank=0, world_size=1)


def _first_batch(loader):
    return next(iter(loader))[0].tolist()


def test_a_batch_size_change_continues_the_epoch_exactly_when_it_divides_the_position():
    a = _loader(batch_size=4)
    it = iter(a)
    seen = [next(it)[0].tolist() for _ in range(3)]            # 12 samples consumed
    state = a.state_dict()
    straight = [x for b in seen for x in b] + [x for b in [next(it)[0].tolist() for _ in range(3)] for x in b]
    b = _loader(batch_size=6)
    b.load_state_dict(state)
    assert "batch_size 4 -> 6" in b.resume_note
    assert _first_batch(b) == straight[12:18]                 # the next 6 samples, in order
    c = _loader(batch_size=5)
    with pytest.raises(ConfigError, match="resume with batch_size=4 or one that divides 12"):
        c.load_state_dict(state)


def test_a_changed_sample_count_goes_on_from_the_next_epoch_and_says_so():
    a = _loader(n=40)
    it = iter(a)
    next(it)
    state = a.state_dict()
    b = _loader(n=80)                                          # seq_len halved: twice the samples
    b.load_state_dict(state)
    assert b.epoch == 1 and "from the start of epoch 1" in b.resume_note


def test_the_divergence_message_names_a_resume_with_a_lower_lr_that_takes_effect(tmp_path):
    from mixprec.errors import TrainingDiverged
    run = tmp_path / "r"
    with pytest.raises(TrainingDiverged) as err:
        mp.fit(InfAfter(good=15), _regressor_batches(60), mixed_precision="32-true", max_steps=60,
               warmup_steps=5, lr=1e-3, log_interval=10, run_dir=str(run), progress=False,
               audit=False, trace_nonfinite=False, ckpt_interval=10)
    ckpt = run / "checkpoints" / "step-00000010"
    hint = f"fit(..., run_dir={str(run)!r}, resume={str(ckpt)!r}, lr=0.0005)"
    assert str(err.value).endswith(hint) and "mixprec train" not in str(err.value)
    # Followed as printed, the lower lr is the one the schedule now uses.
    trainer = Trainer(InfAfter(good=10**6), mixed_precision="32-true", max_steps=12, warmup_steps=5,
                      lr=5e-4, log_interval=1, run_dir=str(run), progress=False, audit=False)
    trainer.fit(_regressor_batches(60), resume=str(ckpt))
    assert metrics_lr(run)[11] == pytest.approx(5e-4 * WarmupCosine(5, 12, 0.1)(10), rel=1e-12)  # step 11 ran at curve(10)


def test_a_resume_with_your_own_optimizer_keeps_its_learning_rates(tmp_path):
    run = tmp_path / "run"

    def model_and_adam():
        model = Regressor()
        return model, torch.optim.AdamW([{"params": [model.lin.weight], "lr": 3e-3},
                                         {"params": [model.lin.bias], "lr": 1e-2}])
    model, opt = model_and_adam()
    mp.fit(model, batches(), optimizer=opt, max_steps=4, warmup_steps=0, min_lr_ratio=1.0,
           ckpt_interval=2, run_dir=str(run), **QUIET)
    model, opt = model_and_adam()
    mp.fit(model, batches(), optimizer=opt, max_steps=6, warmup_steps=0, min_lr_ratio=1.0,
           run_dir=str(run), resume=True, **QUIET)
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 1e-2]     # not fit()'s default lr
    assert set(metrics_lr(run).values()) == {3e-3}


def test_fit_after_an_in_process_cli_run_gives_python_hints_again(tmp_path, capsys):
    """The hints module remembered `mixprec train`'s command-line mode for the rest of the
    process, so a fit() after an in-process CLI call (a notebook, the test suite) told a Python
    user to run `mixprec train --resume` (found when files shared a test process)."""
    from mixprec.cli.main import main
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world, some text to train on. " * 400)
    assert main(["train", "model=tiny", f"data={corpus}", "seq_len=16", "batch_size=2", "max_steps=1",
                 "eval_interval=0", "progress=false", "audit=false", f"run_dir={tmp_path / 'cli'}"]) == 0
    run = tmp_path / "run"
    _killed_before_its_first_save(run)
    with pytest.raises(ConfigError) as err:
        mp.fit(Regressor(), batches(), max_steps=4, run_dir=str(run), **QUIET)
    assert f"continue it with `fit(..., run_dir={str(run)!r}, resume=True)`" in str(err.value)


def test_a_run_whose_only_checkpoint_lost_its_meta_is_refused_and_nothing_is_replaced(tmp_path):
    """A finished run whose only checkpoint folder lost meta.json was 'started over from step 0'
    on resume, replacing its metrics and checkpoint (found by a new-user trial)."""
    run = tmp_path / "run"
    mp.fit(Regressor(), batches(), max_steps=4, run_dir=str(run), ckpt_interval=4, **QUIET)
    (run / "checkpoints" / "step-00000004" / "meta.json").unlink()
    metrics = (run / "metrics.csv").read_text()
    from mixprec.errors import CheckpointError
    with pytest.raises(CheckpointError) as err:
        mp.fit(Regressor(), batches(), max_steps=6, run_dir=str(run), resume=True, **QUIET)
    message = str(err.value)
    assert "step-00000004" in message and "nothing was changed" in message and "\n" not in message
    assert "overwrite=True" in message
    assert (run / "metrics.csv").read_text() == metrics
    assert (run / "checkpoints" / "step-00000004" / "model.safetensors").is_file()


def test_a_callers_optimizer_is_recorded_as_it_ran_and_its_schedule_is_said(tmp_path, capsys):
    """fit(optimizer=SGD(lr=0.05)) recorded lr = 0.001 and weight_decay = 0.1 (the unused
    defaults) in config.toml, and wrapped the optimizer in warm-up + cosine without a word (found
    by a new-user trial)."""
    import tomllib
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mp.fit(model, batches(), optimizer=opt, max_steps=4, warmup_steps=2, run_dir=str(tmp_path / "r"),
           **QUIET)
    saved = tomllib.loads((tmp_path / "r" / "config.toml").read_text())
    assert saved["lr"] == 0.05 and saved["weight_decay"] == 0.0
    assert "# optimizer: the caller's SGD" in (tmp_path / "r" / "config.toml").read_text()
    err = capsys.readouterr().err
    assert "optimizer: your SGD, with its own settings" in err
    assert "LR schedule: 2 warm-up steps then cosine" in err and "warm-up (2 steps) is longer" not in err


def test_a_warm_up_longer_than_the_run_is_said_and_one_as_long_is_not(tmp_path, capsys):
    mp.fit(Regressor(), batches(), max_steps=4, warmup_steps=20, run_dir=str(tmp_path / "r"), **QUIET)
    assert "warm-up (20 steps) is longer than the run (4 steps)" in capsys.readouterr().err
    # warmup_steps == max_steps: the last step runs at the peak LR, so there is nothing to say.
    mp.fit(Regressor(), batches(), max_steps=4, warmup_steps=4, run_dir=str(tmp_path / "s"), **QUIET)
    assert "warm-up (" not in capsys.readouterr().err


def test_fit_into_a_checkpoint_folder_with_resume_continues_its_run_from_that_checkpoint(tmp_path):
    """Before: ``fit(run_dir=RUN/checkpoints/step-N, resume=True)`` said "resuming from step-N"
    and wrote a whole new run (config, metrics, checkpoints/) inside the checkpoint folder."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    mp.fit(Regressor(), batches(), max_steps=6, run_dir=str(straight), **QUIET)
    mp.fit(Regressor(), batches(), max_steps=6, ckpt_interval=3, run_dir=str(run), **QUIET)
    step3 = run / "checkpoints" / "step-00000003"
    before = sorted(p.name for p in step3.iterdir())
    result = mp.fit(Regressor(), batches(), max_steps=6, run_dir=str(step3), resume=True, **QUIET)
    assert result.run_dir == run
    assert sorted(p.name for p in step3.iterdir()) == before        # nothing written inside it
    assert metrics_lr(run) == metrics_lr(straight)                  # RUN continued from step 3
    said = [e["message"] for e in events(run) if e["kind"] == "checkpoint"]
    assert said[0].startswith(f"run_dir={step3} is a checkpoint of the run {run}: continuing")


def test_a_checkpoint_of_another_model_is_refused_with_counted_whole_names(tmp_path):
    """Before: torch's list of every missing key, cut to 240 characters ('"blocks.2.attn.proj.bias"
    ...'): no count, and the rest unsaid. Now each kind of misfit is counted, a few whole names shown."""
    from mixprec.errors import CheckpointError
    from mixprec.models import Transformer

    def data():
        g = torch.Generator().manual_seed(0)
        return [(x[:, :-1], x[:, 1:]) for x in (torch.randint(0, 256, (2, 17), generator=g) for _ in range(2))]
    run = tmp_path / "run"
    mp.fit(Transformer(num_layers=1, d_model=32, num_heads=2, vocab_size=256, max_seq_len=16), data(),
           max_steps=1, run_dir=str(run), **QUIET)
    bigger = Transformer(num_layers=2, d_model=32, num_heads=2, vocab_size=256, max_seq_len=16)
    with pytest.raises(CheckpointError) as err:
        mp.fit(bigger, data(), max_steps=2, run_dir=str(run), resume=True, **QUIET)
    message = str(err.value)
    assert "(12 weights missing from the checkpoint (blocks.1.ln1.weight, blocks.1.ln1.bias, " \
           "blocks.1.attn.qkv.weight and 9 more)); resume with the model settings" in message
    wider = Transformer(num_layers=1, d_model=32, num_heads=2, vocab_size=300, max_seq_len=16)
    with pytest.raises(CheckpointError, match=r"of another shape, the checkpoint's -> this model's "
                                              r"\(wte\.weight \[256, 32\] -> \[300, 32\]"):
        mp.fit(wider, data(), max_steps=2, run_dir=str(run), resume=True, **QUIET)


class _OtherModel(Regressor):
    """The same weights under another class name: another model as far as a run folder knows."""


def test_a_resume_into_a_folder_of_another_models_run_names_that_run(tmp_path):
    """Before: "cannot resume the training data mid-epoch: it was saved with num_batches=4 (now
    6)", as if this run's data had changed, when the folder held another model's run."""
    run = tmp_path / "run"
    mp.fit(Regressor(), batches(4), max_steps=2, run_dir=str(run), **QUIET)
    before = (run / "metrics.csv").read_text()
    with pytest.raises(ConfigError) as err:
        mp.fit(_OtherModel(), batches(6), max_steps=3, run_dir=str(run), resume=True, **QUIET)
    message = str(err.value)
    assert message.startswith(f"{run} holds another run: fit() trained ")
    assert ".Regressor there (its config.toml), this fit() trains " in message
    assert message.endswith("._OtherModel; choose another run_dir, or pass overwrite=True without "
                            "resume to delete that run and start over")
    assert (run / "metrics.csv").read_text() == before               # nothing changed


def test_metrics_lr_is_the_lr_each_logged_step_ran_at(tmp_path):
    """Before: the row of step s showed the LR of step s + 1 (read after the scheduler moved on),
    so a 20-step run's last line said lr 0.0014 while its own summary said the LR reached 0.00133."""
    run = tmp_path / "run"
    mp.fit(Regressor(), batches(), max_steps=4, lr=1e-3, warmup_steps=3, run_dir=str(run), **QUIET)
    curve = WarmupCosine(3, 4, 0.1)
    assert metrics_lr(run) == pytest.approx({s: 1e-3 * curve(s - 1) for s in range(1, 5)}, rel=1e-12)
