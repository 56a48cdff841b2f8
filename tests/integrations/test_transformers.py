"""mixprec inside a real ``transformers.Trainer`` (tiny BERT built from a config, CPU, no download).

Parity: with a sequential sampler, a constant learning rate and the same AdamW groups, the
Trainer's step under ``MixprecTrainer`` is the hand loop's (forward and loss under
``Precision.autocast``, backward, ``Precision.step`` with clipping), so weights match bit for bit.
"""
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mixprec as mp  # noqa: E402
from mixprec.errors import ConfigError  # noqa: E402
from mixprec.integrations.transformers import MixprecCallback, MixprecTrainer  # noqa: E402
from mixprec.runs.metrics import read_events, read_metrics, read_numerics  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 128, 16, 4, 4


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def bert(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=SEQ, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def examples(n: int = STEPS * BATCH, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
             "labels": labels[i]} for i in range(n)]


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=BATCH,
                learning_rate=1e-3, weight_decay=0.0, lr_scheduler_type="constant",
                max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True, seed=0)
    return transformers.TrainingArguments(**{**base, **kw})


def hand_loop(mode, model, data, **options):
    precision = mp.Precision(mode, **options)
    groups = [{"params": [p for n, p in model.named_parameters() if ok(n)], "weight_decay": 0.0}
              for ok in (lambda n: _decays(model, n), lambda n: not _decays(model, n))]
    model, opt = precision.setup(model, torch.optim.AdamW(groups, lr=1e-3, fused=True))  # the Trainer default
    for i in range(0, len(data), BATCH):
        batch = transformers.default_data_collator(data[i:i + BATCH])
        with precision.autocast():
            loss = model(**batch).loss
        precision.backward(loss)
        precision.step(opt, clip_grad_norm=1.0)
        opt.zero_grad()
    return model, precision


def _decays(model, name):
    names = transformers.Trainer.get_decay_parameter_names(None, model)
    return name in names


MODES = [("bf16-true", {}), ("16-mixed", {"init_scale": 2.0 ** 8}),
         ("fp8-tensorwise", {"overrides": {"*attention*": "bf16"}})]     # FP8 and per-layer formats


@pytest.mark.parametrize("mode,options", MODES, ids=[m for m, _ in MODES])
def test_hf_trainer_gives_the_hand_loops_weights(mode, options, tmp_path):
    data = examples()
    ref, ref_precision = hand_loop(mode, bert(), data, **options)
    callback = MixprecCallback(mode, run_dir=tmp_path / "run", **options)
    model = bert()
    MixprecTrainer(model=model, args=args(tmp_path), train_dataset=data,
                   callbacks=[callback]).train()
    for (name, want), got in zip(ref.state_dict().items(), model.state_dict().values()):
        assert got.dtype == want.dtype, name
        assert torch.equal(got, want), name
    assert callback.mixprec.scaler.get_scale() == ref_precision.scaler.get_scale()
    assert list(callback.mixprec.layers.formats.values()) == list(ref_precision.layers.formats.values())
    if "overrides" in options:
        assert {"fp8-tensorwise", "bf16"} <= set(callback.mixprec.layers.formats.values())


def test_bf16_true_keeps_norms_fp32_with_fp32_masters_and_writes_a_run_folder_with_numerics(tmp_path, capsys,
                                                                                           monkeypatch):
    # The audit's findings depend on the machine (a CPU without AVX512-BF16 warns 'bf16-emulated';
    # one with it, or a GPU, has nothing to say and prints nothing), so the audit is watched, not
    # its output guessed: it runs once at start, and whatever it finds is printed.
    from mixprec.integrations import common
    real_audit, audits = common.audit, []

    def watched(*a, **kw):
        audits.append(real_audit(*a, **kw))
        return audits[-1]
    monkeypatch.setattr(common, "audit", watched)
    callback = MixprecCallback("bf16-true", run_dir=tmp_path / "run", monitor_every=2)
    model = bert()
    trainer = MixprecTrainer(model=model, args=args(tmp_path), train_dataset=examples(),
                             callbacks=[callback])
    trainer.train()
    assert model.bert.encoder.layer[0].attention.self.query.weight.dtype == torch.bfloat16
    assert model.bert.embeddings.LayerNorm.weight.dtype == torch.float32
    inner = trainer.optimizer.optimizer.inner
    assert isinstance(inner, mp.optim.MasterWeights)
    assert all(m.dtype == torch.float32 for m in inner.masters)
    err = capsys.readouterr().err
    assert "[mixprec] precision: bf16-true" in err
    assert len(audits) == 1                                                # the audit ran at start
    for finding in audits[0]:          # (the layer-formats finding repeats the start lines' table)
        assert finding.code == "layer-formats" or f"[{finding.code}]" in err    # ... and said so
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 for r in rows)
    numerics = read_numerics(tmp_path / "run")
    assert {r["step"] for r in numerics} == {2, 4}
    # config.toml records the run's recipe, the one the callback's Precision holds
    recorded = mp.precision.Recipe.from_toml((tmp_path / "run" / "config.toml").read_text())
    assert recorded == callback.mixprec.recipe and recorded.name == "bf16-true"
    assert {r["kind"] for r in numerics} == {"act", "grad", "update"}
    from mixprec.report import write_report
    assert write_report(tmp_path / "run").is_file()


def poison(model, layer: torch.nn.Module, bad_ids: torch.Tensor) -> None:
    """Write inf into ``layer``'s output whenever the batch is ``bad_ids`` (the replay too)."""
    seen = {"bad": False}

    def watch(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen["bad"] = ids is not None and ids.shape == bad_ids.shape and torch.equal(ids, bad_ids)

    def inject(module, args, out):
        if seen["bad"]:
            out = out.clone()
            out[0, 0, 0] = float("inf")
            return out

    model.register_forward_pre_hook(watch, with_kwargs=True)
    layer.register_forward_hook(inject)


@pytest.mark.parametrize("mode", ["bf16-true", "fp8-rowwise"])
def test_a_skipped_step_is_traced_to_its_layer_in_the_log(mode, tmp_path, capsys):
    data = examples()
    model = bert()
    bad = torch.stack([d["input_ids"] for d in data[BATCH:2 * BATCH]])         # step 2's batch
    poison(model, model.bert.encoder.layer[1].intermediate.dense, bad)
    callback = MixprecCallback(mode, run_dir=tmp_path / "run")
    trainer = MixprecTrainer(model=model, args=args(tmp_path, lr_scheduler_type="linear"),
                             train_dataset=data, callbacks=[callback])
    trainer.train()
    layer = "bert.encoder.layer.1.intermediate.dense"
    (event,) = callback.nonfinite
    assert event.module == layer and event.kind == "inf" and event.step == 2
    assert f"step 2 skipped: inf first at {layer}" in capsys.readouterr().err
    assert any(e["kind"] == "skip" and e.get("module") == layer for e in read_events(tmp_path / "run"))
    assert callback.mixprec.scaler.num_skipped_steps == 1
    assert trainer.lr_scheduler.last_epoch == STEPS - 1          # no schedule step for the skip
    if mode.startswith("fp8"):
        assert any(f.startswith("fp8-") for f in callback.mixprec.layers.formats.values())


def test_an_optimizer_and_scheduler_passed_in_get_masters_and_keep_their_schedule(tmp_path):
    model = bert()
    callback = MixprecCallback("bf16-true", run_dir=tmp_path / "run", audit=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)         # built on the FP32 model
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    trainer = MixprecTrainer(model=model, args=args(tmp_path, max_steps=2), train_dataset=examples(),
                             callbacks=[callback], optimizers=(opt, sched))
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer.inner, mp.optim.MasterWeights)
    assert sched.optimizer is trainer.optimizer.optimizer          # the schedule sets the masters' lr
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 3)


def test_plain_trainer_with_a_loss_scaling_mode_is_refused_in_one_line_and_leaves_the_model_untouched(tmp_path):
    model = bert()
    before = {n: (p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    trainer = transformers.Trainer(model=model, args=args(tmp_path), train_dataset=examples(),
                                   callbacks=[MixprecCallback("16-mixed")])
    with pytest.raises(ConfigError, match="scales the loss.*MixprecTrainer"):
        trainer.train()
    for n, p in model.named_parameters():                  # no cast, no swap, no step
        assert p.dtype == before[n][0] and torch.equal(p.detach(), before[n][1]), n


@pytest.mark.parametrize("mode", ["bf16-true", "fp8-tensorwise"])
def test_a_plain_trainer_with_the_callback_trains_as_mixprec_trainer_does(mode, tmp_path):
    # No loss scaling: the callback alone sets the model up, autocasts its forward and steps FP32
    # masters; without clipping (the plain Trainer clips the model's gradients itself) the weights
    # are MixprecTrainer's bit for bit.
    import warnings
    data = examples()
    ref = bert()
    MixprecTrainer(model=ref, args=args(tmp_path / "a", max_grad_norm=0.0), train_dataset=data,
                   callbacks=[MixprecCallback(mode, audit=False)]).train()
    model = bert()
    callback = MixprecCallback(mode, audit=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = transformers.Trainer(model=model, args=args(tmp_path / "b", max_grad_norm=0.0),
                                       train_dataset=data, callbacks=[callback])
        trainer.train()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]
    assert model.bert.embeddings.LayerNorm.weight.dtype == torch.float32
    assert isinstance(callback._stepped, mp.optim.MasterWeights) == callback.mixprec.recipe.keeps_masters \
        == (mode == "bf16-true")
    for (name, want), got in zip(ref.state_dict().items(), model.state_dict().values()):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "out" / "mixprec")] == [1, 2, 3, 4]


def test_bf16_training_arguments_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="bf16=True"):
        MixprecTrainer(model=bert(), args=args(tmp_path, bf16=True), train_dataset=examples(),
                       callbacks=[MixprecCallback("bf16-true")])


def test_resume_from_a_trainer_checkpoint_continues_exactly(tmp_path):
    # 16-mixed with a growing scale: 2 steps, a Trainer checkpoint, 2 more == the 4-step hand loop
    # (which the parity test above shows equal to 4 Trainer steps).
    data = examples()
    kw = dict(init_scale=2.0 ** 8, growth_interval=1)
    ref, ref_precision = hand_loop("16-mixed", bert(), data, **kw)
    first = MixprecCallback("16-mixed", run_dir=tmp_path / "b", **kw)
    MixprecTrainer(model=bert(), args=args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
                   train_dataset=data, callbacks=[first]).train()
    again = MixprecCallback("16-mixed", run_dir=tmp_path / "c", **kw)
    model = bert(seed=3)                                  # other weights: all come from the checkpoint
    ckpt = tmp_path / "out" / "checkpoint-2"
    MixprecTrainer(model=model, args=args(tmp_path), train_dataset=data,
                   callbacks=[again]).train(resume_from_checkpoint=str(ckpt))
    assert again.mixprec.scaler.get_scale() == ref_precision.scaler.get_scale() == 2.0 ** 12
    for (name, want), got in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name


def test_a_second_run_into_the_same_output_dir_keeps_the_first_and_says_where_it_writes(tmp_path, capsys):
    for _ in range(2):                      # the docs' example, run twice: routine with HF Trainer
        MixprecTrainer(model=bert(), args=args(tmp_path, max_steps=2), train_dataset=examples(),
                       callbacks=[MixprecCallback("bf16-true", audit=False)]).train()
    first, second = tmp_path / "out" / "mixprec", tmp_path / "out" / "mixprec-2"
    assert [r["step"] for r in read_metrics(first)] == [1, 2] == [r["step"] for r in read_metrics(second)]
    lines = [l for l in capsys.readouterr().err.splitlines() if "earlier run" in l]
    assert len(lines) == 1 and str(second) in lines[0] and "MixprecCallback(overwrite=True)" in lines[0]


def test_a_named_run_dir_holding_a_run_is_still_refused_and_overwrite_writes_over_it(tmp_path):
    def train(**kw):
        MixprecTrainer(model=bert(), args=args(tmp_path, max_steps=2), train_dataset=examples(),
                       callbacks=[MixprecCallback("bf16-true", run_dir=tmp_path / "run", audit=False, **kw)]).train()
    train()
    with pytest.raises(ConfigError, match=r"already holds a run.*MixprecCallback\(overwrite=True\)"):
        train()
    train(overwrite=True)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    assert not (tmp_path / "run-2").exists()


def test_a_schedule_passed_in_and_moved_onto_the_masters_raises_no_torch_scheduler_warning(tmp_path):
    import warnings
    model = bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MixprecTrainer(model=model, args=args(tmp_path, max_steps=2), train_dataset=examples(),
                       callbacks=[MixprecCallback("bf16-true", audit=False)], optimizers=(opt, sched)).train()
    assert not [w for w in caught if "optimizer.step()" in str(w.message)], [str(w.message) for w in caught]


def test_a_plain_trainer_resuming_a_master_mode_checkpoint_is_refused_in_one_line(tmp_path):
    def trainer(**kw):
        return transformers.Trainer(model=bert(), args=args(tmp_path, **kw), train_dataset=examples(),
                                    callbacks=[MixprecCallback("bf16-true", audit=False)])
    trainer(max_steps=2, save_strategy="steps", save_steps=2).train()
    with pytest.raises(ConfigError, match="cannot resume.*MixprecTrainer"):
        trainer().train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))


def test_a_plain_trainer_skips_a_bad_step_and_holds_its_schedule(tmp_path, capsys):
    data = examples()
    model = bert()
    bad = torch.stack([d["input_ids"] for d in data[BATCH:2 * BATCH]])         # step 2's batch
    poison(model, model.bert.encoder.layer[1].intermediate.dense, bad)
    callback = MixprecCallback("bf16-true", audit=False)
    trainer = transformers.Trainer(model=model, args=args(tmp_path, lr_scheduler_type="linear", max_grad_norm=0.0),
                                   train_dataset=data, callbacks=[callback])
    trainer.train()
    assert callback.mixprec.scaler.num_skipped_steps == 1
    assert trainer.lr_scheduler.last_epoch == STEPS - 1          # no schedule step for the skip
    assert "step 2 skipped" in capsys.readouterr().err
    assert all(torch.isfinite(p).all() for p in model.parameters())
