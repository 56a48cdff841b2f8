"""`mixprec train model=hf:PATH`: a Hugging Face architecture from a local config.json, exact resume
(tied weights stay tied), save_pretrained exports that transformers loads, init_from, and
one-line errors."""
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec.errors import ConfigError
from mixprec.cli.train import build_run
from mixprec.train.config import TrainConfig
from mixprec.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from gated import GatedRun  # noqa: E402

SMALL = dict(seq_len=16, batch_size=4, log_interval=1, eval_interval=0, eval_batches=2,
             warmup_steps=2, lr=3e-3, progress=False, audit=False)
ENV = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


def _cfg(tmp_path, corpus, model, **kw) -> TrainConfig:
    return TrainConfig(**{**SMALL, "model": f"hf:{model}", "data": str(corpus),
                          "run_dir": str(tmp_path / "run"), **kw})


def _train(cfg: TrainConfig, resume: bool = False):
    model, train_loader, val_loader, strategy = build_run(cfg)
    trainer = Trainer(model, config=cfg, strategy=strategy)
    result = trainer.fit(train_loader, val_loader, resume=resume)
    return model, result


def _losses(run_dir: Path) -> dict[int, str]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): r["loss"] for r in csv.DictReader(f)}


def test_resume_is_bit_exact_and_tied_weights_stay_tied(tmp_path, corpus_file, config_file):
    gpt2 = config_file("gpt2", dropout=0.1)          # dropout: the RNG stream must resume too
    cfg = _cfg(tmp_path, corpus_file, gpt2, max_steps=6, ckpt_interval=3, keep_last=2)
    straight, _ = _train(cfg)
    run = tmp_path / "run"
    meta = json.loads((run / "checkpoints/step-00000003/meta.json").read_text())
    assert meta["aliases"] == {"lm_head.weight": "transformer.wte.weight"}   # stored once
    # Back to step 3, as if the run had died there; then resume.
    shutil.rmtree(run / "checkpoints/step-00000006")
    shutil.rmtree(run / "hf")
    (run / "checkpoints/latest").write_text("step-00000003\n")
    reference = _losses(run)
    resumed, _ = _train(cfg, resume=True)
    assert resumed.lm_head.weight is resumed.transformer.wte.weight
    a, b = straight.state_dict(), resumed.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _losses(run) == reference


def _resolve_resume(run: Path, *settings: str):
    import argparse
    from mixprec.cli.train import _resolve
    return _resolve(argparse.Namespace(settings=list(settings), config=None, precision=None,
                                       resume=str(run), list=False))


def test_a_resume_builds_the_model_from_the_run_folders_copy_when_its_config_moved(tmp_path, corpus_file,
                                                                                 config_file):
    gpt2 = Path(config_file("gpt2"))
    _train(_cfg(tmp_path, corpus_file, gpt2, max_steps=2, ckpt_interval=2))
    run = tmp_path / "run"
    assert (run / "hf_config.json").read_bytes() == (gpt2 / "config.json" if gpt2.is_dir() else gpt2).read_bytes()
    shutil.move(str(gpt2), str(tmp_path / "moved"))
    cfg, source, resume_from = _resolve_resume(run, "max_steps=3")
    assert cfg.model == f"hf:{run / 'hf_config.json'}"
    assert source["model"].startswith(f"resumed run; {gpt2}") and "is gone" in source["model"]
    _, result = _train(cfg, resume=resume_from)
    assert result.steps == 3


def test_a_resume_whose_config_is_gone_and_not_kept_is_refused_in_one_line(tmp_path, corpus_file,
                                                                         config_file):
    gpt2 = Path(config_file("gpt2"))
    _train(_cfg(tmp_path, corpus_file, gpt2, max_steps=1, ckpt_interval=1))
    run = tmp_path / "run"
    (run / "hf_config.json").unlink()                 # a run from before the copy was kept
    shutil.rmtree(gpt2) if gpt2.is_dir() else gpt2.unlink()
    with pytest.raises(ConfigError, match=r"is gone and the run folder keeps no copy.*pass model=hf:PATH"):
        _resolve_resume(run)


@pytest.mark.slow
def test_sigkill_and_resume_through_the_cli_reproduces_the_losses_bit_for_bit(tmp_path, corpus_file,
                                                                            config_file):
    gpt2 = config_file("gpt2", dropout=0.1)
    common = [f"model=hf:{gpt2}", f"data={corpus_file}", "max_steps=40", "ckpt_interval=4",
              "keep_last=2", *(f"{k}={v}" for k, v in SMALL.items())]
    cmd = [sys.executable, "-m", "mixprec", "train", *common]
    subprocess.run([*cmd, f"run_dir={tmp_path / 'straight'}"], check=True, env=ENV,
                   capture_output=True, timeout=300)
    reference = _losses(tmp_path / "straight")
    assert sorted(reference) == list(range(1, 41))
    killed = tmp_path / "killed"
    run = GatedRun("step:7", *common, f"run_dir={killed}", env=ENV)
    run.wait_for("GATE step:7")     # 6 steps done (a checkpoint at 4), the 7th about to start
    run.signal(signal.SIGKILL)
    run.finish()
    assert max(_losses(killed)) == 6
    subprocess.run([sys.executable, "-m", "mixprec", "train", "--resume", str(killed)], check=True,
                   env=ENV, capture_output=True, timeout=300)
    assert _losses(killed) == reference
    loaded = transformers.AutoModelForCausalLM.from_pretrained(killed / "hf")
    straight = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "hf")
    for k, v in straight.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k


@pytest.mark.parametrize("arch, mode", [("gpt2", "32-true"), ("llama", "bf16-true")])
def test_save_pretrained_exports_load_back_with_auto_model(arch, mode, tmp_path, corpus_file,
                                                           config_file):
    cfg = _cfg(tmp_path, corpus_file, config_file(arch), max_steps=4, ckpt_interval=2,
               export_hf=True, precision=mode)
    model, result = _train(cfg)
    run = Path(result.run_dir)
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*/hf")) == ["hf", "hf"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run / "hf")
    assert type(loaded) is type(model)
    theirs = loaded.state_dict()
    for k, v in model.state_dict().items():      # (model: on the device it trained on)
        assert theirs[k].dtype == torch.float32 and torch.equal(theirs[k], v.float().cpu()), k
    if arch == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
    else:   # bf16-true trains 16-bit weights and FP32 norms; both come back exactly, in FP32
        assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
        assert model.model.norm.weight.dtype == torch.float32
    if mode == "32-true":
        x = torch.randint(0, 256, (2, 8))
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=x).logits, model.cpu().eval()(input_ids=x).logits)
    step2 = transformers.AutoModelForCausalLM.from_pretrained(run / "checkpoints/step-00000002/hf")
    assert not torch.equal(next(step2.parameters()).float(), next(loaded.parameters()).float())


def test_init_from_starts_from_a_save_pretrained_folder(tmp_path, corpus_file, config_file,
                                                        hf_model):
    source = hf_model("llama", seed=7)
    source.save_pretrained(tmp_path / "pretrained")
    cfg = _cfg(tmp_path, corpus_file, str(tmp_path / "pretrained"),
               init_from=str(tmp_path / "pretrained"), max_steps=1)
    model, *_ = build_run(cfg)
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    other = config_file("llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(ConfigError, match="init_from=.*does not"):
        build_run(_cfg(tmp_path, corpus_file, other, init_from=str(tmp_path / "pretrained")))


def test_model_init_and_data_order_follow_the_seed(tmp_path, corpus_file, config_file):
    llama = config_file("llama")
    runs = {name: build_run(_cfg(tmp_path, corpus_file, llama, seed=seed))
            for name, seed in (("a", 0), ("b", 0), ("c", 1))}
    w = "model.layers.0.mlp.up_proj.weight"
    weights = {k: r[0].state_dict()[w] for k, r in runs.items()}
    first = {k: next(iter(r[1]))[0] for k, r in runs.items()}
    assert torch.equal(weights["a"], weights["b"]) and torch.equal(first["a"], first["b"])
    assert not torch.equal(weights["a"], weights["c"]) and not torch.equal(first["a"], first["c"])


def _t5_config(folder: Path) -> str:
    cfg = transformers.T5Config(vocab_size=256, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_diff_dict()))
    return str(folder)


def _bert_config(folder: Path, **kw) -> str:
    cfg = transformers.BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64, **kw)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_diff_dict()))
    return str(folder)


def test_an_encoder_behind_a_causal_lm_head_is_refused_unless_it_is_a_decoder(tmp_path, corpus_file):
    """BERT has a causal-LM class (BertLMHeadModel), but attends both ways unless is_decoder."""
    with pytest.raises(ConfigError, match="not causal"):
        build_run(_cfg(tmp_path, corpus_file, _bert_config(tmp_path / "bert")))
    model, *_ = build_run(_cfg(tmp_path, corpus_file,
                               _bert_config(tmp_path / "decoder", is_decoder=True)))
    assert type(model).__name__ == "BertLMHeadModel"


@pytest.mark.parametrize("case, message", [
    ("small-vocab", "vocab_size=128 but the data's token ids go up to 255"),
    ("long-seq", "handles 64 positions but seq_len=128"),
    ("missing", "no such file or folder"),
    ("no-config", "the folder has no config.json"),
    ("t5", "model_type 't5' has no causal-LM head"),
    ("preset-field", "num_layers= shapes mixprec's own presets"),
    ("init-without-hf", "init_from needs a Hugging Face model"),
    ("not-json", "is not a readable JSON file"),
])
def test_bad_hf_settings_give_one_line_errors(case, message, tmp_path, corpus_file, config_file):
    model, kw = None, {}
    if case == "small-vocab":
        model = config_file("gpt2", vocab_size=128)
    elif case == "long-seq":
        model, kw = config_file("gpt2"), {"seq_len": 128}
    elif case == "missing":
        model = str(tmp_path / "nowhere.json")
    elif case == "no-config":
        (tmp_path / "empty").mkdir()
        model = str(tmp_path / "empty")
    elif case == "t5":
        model = _t5_config(tmp_path / "t5")
    elif case == "preset-field":
        model, kw = config_file("llama"), {"num_layers": 4}
    elif case == "not-json":
        (tmp_path / "bad.json").write_text("{not json")
        model = str(tmp_path / "bad.json")
    with pytest.raises(ConfigError) as e:
        if case == "init-without-hf":
            TrainConfig(model="small", init_from=str(tmp_path)).validate()
        else:
            build_run(_cfg(tmp_path, corpus_file, model, **kw))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_reports_a_bad_hf_config_in_one_line_and_exits_2(tmp_path, corpus_file, config_file):
    proc = subprocess.run([sys.executable, "-m", "mixprec", "train",
                           f"model=hf:{config_file('gpt2', vocab_size=100)}", f"data={corpus_file}",
                           f"run_dir={tmp_path / 'run'}", "progress=false"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("mixprec: error: model=hf:") and "vocab_size=100" in lines[-1]
    assert not (tmp_path / "run").exists()


def test_export_hf_on_a_non_hf_model_is_refused(tmp_path):
    from mixprec.runs.checkpointer import Checkpointer
    from mixprec.strategies import get_strategy
    with pytest.raises(ConfigError, match="export_hf=true .* not a transformers model"):
        Checkpointer(get_strategy("single"), tmp_path, keep_last=1, export_hf=True,
                     model=torch.nn.Linear(2, 2))
