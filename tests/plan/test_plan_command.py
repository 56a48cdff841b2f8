"""``mixprec plan`` writes a plan that ``mixprec train --precision plan:PATH`` trains with."""
import json

from mixprec.cli import main
from mixprec.cli.plan import percent


def test_plan_command_writes_a_plan_that_train_uses(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "model=tiny", "batch_size=2", "seq_len=32", "--batches", "1",
                 "--candidates", "bf16,fp8-tensorwise", "--target", "H100", "-o", str(plan)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "chosen" in out and "plan:" in out
    assert "[mixprec] trade-off: predicted" in captured.err and "faster Linear GEMMs" in captured.err
    data = json.loads(plan.read_text())
    assert data["measured_calibration"] <= data["budget"]        # (1 batch: none held out)
    assert data["measured_heldout"] is None and "measured" in out
    formats = dict(data["overrides"])
    assert set(formats) >= {"blocks.0.attn.qkv", "head"} and data["precision"]
    assert (tmp_path / "plan.png").is_file()
    run = tmp_path / "run"
    assert main(["train", "--precision", f"plan:{plan}", "model=tiny", "batch_size=2", "seq_len=32",
                 "max_steps=2", "eval_interval=0", "eval_batches=1", f"run_dir={run}",
                 "progress=false"]) == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert next(e for e in events if e["kind"] == "formats")["layers"] == formats


def test_a_budget_may_carry_its_percent_sign(capsys):
    """`--budget 5%` printed argparse's whole usage; the value is in percent either way."""
    assert main(["plan", "model=tiny", "--budget", "150%"]) == 2
    assert "got 150" in capsys.readouterr().err and percent("5%") == percent("5") == 5.0


def test_a_budget_outside_percent_range_is_refused_in_one_line_before_the_model_is_built(capsys):
    assert main(["plan", "model=tiny", "--budget", "150"]) == 2
    err = capsys.readouterr().err
    assert "--budget is in percent of the loss, in [0, 100) (e.g. 0.1 for 0.1 %), got 150" in err
    assert "planning" not in err and "Traceback" not in err


def test_from_a_run_reads_the_runs_settings_and_a_mismatch_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "model=tiny", "batch_size=2", "seq_len=32", "max_steps=1", "eval_interval=0",
                 "eval_batches=1", f"run_dir={run}", "progress=false", "audit=false"]) == 0
    capsys.readouterr()
    common = ["--batches", "1", "--candidates", "bf16", "--target", "H100", "-o", str(tmp_path / "p.json")]
    # No settings given: the run's own config.toml (seq_len=32) builds the model its weights fit.
    assert main(["plan", "--from", str(run), *common]) == 0
    err = capsys.readouterr().err
    assert f"settings: {run / 'config.toml'} (the run's own)" in err
    assert "untrained" not in err and "batches of 2x32 tokens" in err
    # Other settings that build another shape (tiny's own 128 positions): one line naming the way
    # out, not a traceback.
    other = tmp_path / "other.toml"
    other.write_text('model = "tiny"\nbatch_size = 2\n')
    assert main(["plan", "--from", str(run), "--config", str(other), *common]) == 2
    err = capsys.readouterr().err
    assert f"the weights in {run} do not fit the model of these settings (model=tiny, seq_len=128)" in err
    assert "--config RUN/config.toml" in err and "Traceback" not in err


def test_a_plan_on_initial_weights_says_they_are_untrained(tmp_path, capsys):
    assert main(["plan", "model=tiny", "batch_size=2", "seq_len=32", "--batches", "1", "--candidates",
                 "bf16", "--target", "H100", "-o", str(tmp_path / "p.json")]) == 0
    assert "initial, untrained weights" in capsys.readouterr().err


def test_fp4_candidates_on_a_gpu_without_fp4_are_refused_in_one_line_that_says_why(capsys):
    """Before: an all-fp32 plan, the reason in a note at the end, and a matplotlib warning."""
    assert main(["plan", "model=tiny", "batch_size=2", "seq_len=32", "--batches", "1",
                 "--candidates", "fp32,nvfp4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("mixprec: error: nothing to plan on H100 but fp32: nvfp4 left out: it gives "
                       "no speed-up on H100 (no FP4 tensor cores); pick --target B200 or GB200 to "
                       "plan for FP4")


def test_an_all_fp32_plan_plots_without_a_warning(tmp_path):
    import warnings

    import torch

    import mixprec as mp
    from guard_nets import Net, loader
    plan = mp.plan.plan_precision(Net(), loader(n=1), candidates=("bf16",), budget=0.0, target="H100",
                             layers=["blocks.0.fc"])
    assert plan.formats == {"blocks.0.fc": "fp32"}
    plan.layers[0].sqnr_out.clear()            # no bar with a label at all (an all-fp32 table)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan.plot(tmp_path / "plan.png").is_file()


def test_given_limits_are_checked_in_one_line_before_the_model_is_built(capsys):
    for command in ("plan", "whatif"):
        assert main([command, "model=tiny", "--max-flush", "150"]) == 2
        err = capsys.readouterr().err
        assert "--max-flush is in percent of a layer's inputs, in [0, 100], got 150" in err
        assert "Traceback" not in err and "measured" not in err


def test_a_plan_run_resumes_with_the_command_it_printed(tmp_path, capsys):
    """Before: config.toml kept no [overrides] table for a ``plan:PATH`` run, so the printed
    ``mixprec train --resume RUN max_steps=N`` ended "trained with per-layer overrides [...], this
    run uses []"."""
    import shlex
    import tomllib
    from mixprec.policy.overrides import write_plan
    plan = write_plan(tmp_path / "plan.json", "32-true",
                      (("blocks.0.*", "fp8-tensorwise"), ("head", "bf16")))
    run = tmp_path / "p"
    tiny = ["model=tiny", "batch_size=2", "seq_len=32", "eval_interval=0", "eval_batches=1",
            "progress=false", "audit=false"]
    assert main(["train", "--precision", f"plan:{plan}", *tiny, "max_steps=2",
                 f"run_dir={run}"]) == 0
    saved = tomllib.loads((run / "config.toml").read_text())
    assert saved["precision"] == "32-true"
    assert saved["overrides"] == {"blocks.0.*": "fp8-tensorwise", "head": "bf16"}
    printed = next(ln for ln in capsys.readouterr().err.splitlines() if "[mixprec] resume:" in ln)
    command = shlex.split(printed.split("resume:", 1)[1].split("  (", 1)[0])
    assert command[:3] == ["mixprec", "train", "--resume"]
    assert main([*command[1:], "progress=false"]) == 0
    assert tomllib.loads((run / "config.toml").read_text())["overrides"] == saved["overrides"]
    # Naming the plan again on the resume is the same plan, not its layers twice.
    assert main(["train", "--resume", str(run), "--precision", f"plan:{plan}", "max_steps=5",
                 "progress=false"]) == 0
    assert tomllib.loads((run / "config.toml").read_text())["overrides"] == saved["overrides"]


def test_a_plan_records_its_model_and_its_hint_repeats_it_and_another_model_is_refused(tmp_path, capsys):
    """The hint `mixprec train --precision plan:plan.json` left out model=tiny: pasted as printed it
    trained the default (small) model with the tiny plan's overrides, without a word."""
    plan = tmp_path / "plan.json"
    assert main(["plan", "model=tiny", "batch_size=2", "seq_len=32", "--batches", "1",
                 "--candidates", "bf16", "--target", "H100", "-o", str(plan)]) == 0
    err = capsys.readouterr().err
    assert f"train with it: mixprec train model=tiny --precision plan:{plan}" in err
    data = json.loads(plan.read_text())
    assert data["made_for"] == "model=tiny" and "blocks.0.attn.qkv" in data["linears"]
    # As pasted without model=tiny: the default model's Linear layers are not the plan's.
    assert main(["train", "--precision", f"plan:{plan}", "batch_size=2", "seq_len=32", "max_steps=1",
                 "eval_interval=0", f"run_dir={tmp_path / 'run'}", "progress=false"]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "was made for another model" in x)
    assert f"plan {plan} was made for another model (made for model=tiny" in line
    assert "make a plan for this model" in line and "Traceback" not in err
