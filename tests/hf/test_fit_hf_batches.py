"""Real Hugging Face models through fit() on the batches their users already have: BERT (masked LM
and sequence classification) and T5 (seq2seq) on padded dict batches, a ResNet on a plain
DataLoader of (images, labels). torchvision cannot be installed beside this torch build, so the
ResNet-family model is transformers' ResNetForImageClassification (tiny config, no download)."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import mixprec as mp
from mixprec.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

VOCAB, T = 64, 16


def bert(head: str, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cls = transformers.BertForMaskedLM if head == "mlm" else transformers.BertForSequenceClassification
    return cls(config)


def t5(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


class PaddedText(Dataset):
    """Map-style dataset of Hugging Face-style dicts, padded to T (pad id 0) like a collator."""

    def __init__(self, task: str, n: int = 24, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(6, T + 1, (), generator=g))
            ids = torch.zeros(T, dtype=torch.long)
            ids[:length] = torch.randint(2, VOCAB, (length,), generator=g)
            mask = (torch.arange(T) < length).long()
            item = {"input_ids": ids, "attention_mask": mask}
            if task == "mlm":                         # mask 1 in 4 real tokens (id 1 = [MASK])
                chosen = (torch.rand(T, generator=g) < 0.25) & mask.bool()
                chosen[0] = True
                item["labels"] = torch.where(chosen, ids, -100)
                item["input_ids"] = torch.where(chosen, 1, ids)
            elif task == "cls":
                item["labels"] = torch.randint(0, 3, (), generator=g)
            else:                                     # seq2seq: reverse the real tokens
                labels = torch.full((T,), -100)
                labels[:length] = ids[:length].flip(0)
                item["labels"] = labels
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _trainer(model, tmp_path, **kw):
    kw = {"mixed_precision": "32-true", "progress": False, "audit": False, "warmup_steps": 0,
          "ckpt_interval": 0, "run_dir": str(tmp_path / "run"), "clip_grad_norm": None, **kw}
    return Trainer(model, **kw)


def _beside(trainer, reference, batch):
    """The reference model and the batch on the device the trainer trains on (CUDA when there is
    one), so the step's loss is compared with the same computation on the same device."""
    return reference.to(trainer.device), trainer.strategy.to_device(batch)


@pytest.mark.parametrize("task, build", [("mlm", lambda: bert("mlm")), ("cls", lambda: bert("cls")),
                                         ("seq2seq", t5)])
def test_the_step_loss_is_the_models_own_loss_on_a_dict_batch_and_tokens_skip_padding(task, build, tmp_path):
    model = build()
    reference = copy.deepcopy(model)
    batch = next(iter(DataLoader(PaddedText(task), batch_size=4)))
    trainer = _trainer(model, tmp_path)
    trainer.prepare(1)
    out = trainer.train_step([batch])
    reference, batch = _beside(trainer, reference, batch)
    with torch.no_grad():
        expected = reference(**batch).loss
    assert trainer.objective.describe == "model(**batch).loss"
    torch.testing.assert_close(out.loss, expected.float(), rtol=1e-6, atol=0)
    assert int(out.tokens) == int(batch["attention_mask"].sum()) < batch["input_ids"].numel()


@pytest.mark.parametrize("task, build", [("mlm", lambda: bert("mlm")), ("cls", lambda: bert("cls")),
                                         ("seq2seq", t5)])
def test_bert_and_t5_train_through_fit_on_a_shuffled_dataloader_with_no_glue(task, build, tmp_path):
    loader = DataLoader(PaddedText(task, n=32), batch_size=8, shuffle=True)
    result = mp.fit(build(), loader, mixed_precision="32-true", epochs=2, lr=3e-3, warmup_steps=0,
                    progress=False, audit=False, log_interval=1, run_dir=str(tmp_path / "run"))
    from mixprec.runs.metrics import read_metrics
    losses = [float(r["loss"]) for r in read_metrics(tmp_path / "run")]
    assert result.steps == 8 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) < sum(losses[:2])          # it learns
    assert (tmp_path / "run" / "hf" / "config.json").is_file()   # save_pretrained folder out


def test_inputs_dict_and_labels_pairs_with_a_loss_fn_for_a_classifier(tmp_path):
    model = bert("cls")
    reference = copy.deepcopy(model)
    data = [({k: v for k, v in b.items() if k != "labels"}, b["labels"])
            for b in DataLoader(PaddedText("cls"), batch_size=4)]
    smooth = lambda out, y: F.cross_entropy(out.logits.float(), y, label_smoothing=0.1)  # noqa: E731
    trainer = _trainer(model, tmp_path, loss_fn=smooth)
    trainer.prepare(1)
    out = trainer.train_step([data[0]])
    reference, (inputs, labels) = _beside(trainer, reference, data[0])
    with torch.no_grad():
        expected = smooth(reference(**inputs), labels)
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)


def test_token_ids_and_class_labels_pairs_train_a_classifier_with_its_own_loss(tmp_path):
    model = bert("cls")
    reference = copy.deepcopy(model)
    batch = next(iter(DataLoader(PaddedText("cls"), batch_size=4)))
    pair = (batch["input_ids"], batch["labels"])          # (B, T) ids, (B,) classes
    trainer = _trainer(model, tmp_path)
    trainer.prepare(1)
    out = trainer.train_step([pair])
    reference, pair = _beside(trainer, reference, pair)
    with torch.no_grad():
        expected = reference(pair[0], labels=pair[1]).loss
    assert trainer.objective.describe == "model(inputs, labels=targets).loss"
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)


def test_a_dict_batch_without_labels_for_a_hf_model_is_one_line_naming_labels(tmp_path):
    data = [{k: v for k, v in b.items() if k != "labels"} for b in DataLoader(PaddedText("cls"), batch_size=4)]
    with pytest.raises(mp.errors.ConfigError) as e:
        mp.fit(bert("cls"), data, mixed_precision="32-true", max_steps=1, progress=False,
               audit=False, run_dir=str(tmp_path / "run"))
    msg = str(e.value)
    assert "\n" not in msg and "no 'labels'" in msg and "attention_mask" in msg


def resnet(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4,
        layer_type="basic"))


def images(n: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 3, 16, 16, generator=g) + y[:, None, None, None].float()  # learnable
    return TensorDataset(x, y)


def test_a_resnet_trains_on_a_plain_dataloader_of_images_and_labels_with_no_glue(tmp_path):
    loader = DataLoader(images(), batch_size=8, shuffle=True)
    result = mp.fit(resnet(), loader, mixed_precision="32-true", epochs=2, lr=1e-2, warmup_steps=0,
                    progress=False, audit=False, log_interval=1, run_dir=str(tmp_path / "run"))
    from mixprec.runs.metrics import read_metrics
    rows = read_metrics(tmp_path / "run")
    assert result.steps == 8 and all(math.isfinite(float(r["loss"])) for r in rows)
    assert rows[0]["tokens_per_s"] in ("", None) and rows[0]["mfu"] in ("", None)  # images: no tokens


def test_a_resnet_step_loss_is_its_own_loss_or_the_given_loss_fn(tmp_path):
    x, y = next(iter(DataLoader(images(), batch_size=8)))
    for loss_fn in (None, lambda out, t: F.cross_entropy(out.logits, t)):
        trainer = _trainer(resnet(), tmp_path, loss_fn=loss_fn, overwrite=True)
        trainer.prepare(1)
        out = trainer.train_step([(x, y)])
        reference, (rx, ry) = _beside(trainer, resnet(), (x, y))
        with torch.no_grad():
            expected = reference(rx, labels=ry).loss
        torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)
        assert out.tokens is None


def test_the_planner_measures_a_bert_classifier_on_dict_batches_with_fits_loss():
    *batches, heldout = list(DataLoader(PaddedText("cls"), batch_size=4))[:3]
    plan = mp.plan.plan_precision(bert("cls"), batches, heldout=[heldout], candidates=("fp32", "bf16"),
                                  layers=["bert.encoder.layer.0.output.dense", "classifier"],
                                  target="H100")
    assert set(plan.formats) == {"bert.encoder.layer.0.output.dense", "classifier"}
    with torch.no_grad():
        expected = sum(float(bert("cls")(**b).loss) for b in batches) / 2
    assert plan.loss == pytest.approx(expected, rel=1e-6)


def test_a_skipped_step_on_dict_batches_is_traced_to_the_layer(tmp_path):
    model = bert("cls")

    def poison(module, args, output):               # NaN wherever token 63 appears
        return torch.where((args[0] == 63)[..., None], torch.full_like(output, math.nan), output)
    model.bert.embeddings.word_embeddings.register_forward_hook(poison)
    data = list(DataLoader(PaddedText("cls"), batch_size=4))[:3]
    for b in data:
        b["input_ids"] = b["input_ids"].clamp(max=62)
    data[1]["input_ids"][0, 0] = 63
    result = mp.fit(model, data, mixed_precision="32-true", epochs=1, progress=False, audit=False,
                    ckpt_interval=0, clip_grad_norm=None, run_dir=str(tmp_path / "run"))
    from mixprec.runs.metrics import read_events
    (skip,) = [e for e in read_events(tmp_path / "run") if e["kind"] == "skip"]
    assert result.skipped_steps == 1
    assert (skip["module"], skip["direction"]) == ("bert.embeddings.word_embeddings", "forward")
