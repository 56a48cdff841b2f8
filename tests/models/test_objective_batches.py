"""Every common batch shape through the one objective: (inputs, targets) with tensor or dict
inputs, dict batches, objects with .to(); the path decided once; one line for what is refused."""
import csv
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.errors import ConfigError
from mixprec.models.objective import make_objective
from mixprec.strategies import get_strategy


def _fit(model, data, tmp_path, **kw):
    kw = {"mixed_precision": "32-true", "progress": False, "audit": False, "warmup_steps": 0,
          "run_dir": str(tmp_path / "run"), "max_steps": 2, **kw}
    return mp.fit(model, data, **kw)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 3)

    def forward(self, x):
        return self.net(x)


class KwargsModel(nn.Module):
    """forward(features=..., mask=..., labels=None) like a Hugging Face model, own loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 3)
        self.seen: list[set] = []

    def forward(self, features, labels=None):
        self.seen.append({"labels"} if labels is not None else set())
        logits = self.net(features)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels) if labels is not None else None}


def test_a_classifier_without_loss_fn_gets_a_classification_hint_in_one_line(tmp_path):
    data = [(torch.randn(4, 8), torch.randint(0, 3, (4,)))]
    with pytest.raises(ConfigError) as e:
        _fit(Classifier(), data, tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "float32 tensor of shape (4, 8)" in msg and "int64 tensor of shape (4,)" in msg
    assert "loss_fn=lambda out, targets: F.cross_entropy(out.float(), targets)" in msg
    assert "flatten" not in msg                       # not the language-model hint


def test_a_classifier_with_loss_fn_trains_on_a_plain_dataloader(tmp_path):
    ds = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,)))
    result = _fit(Classifier(), torch.utils.data.DataLoader(ds, batch_size=4), tmp_path,
                  loss_fn=F.cross_entropy, log_interval=1)
    assert result.steps == 2 and result.final_loss > 0
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    # float inputs are no tokens: tokens/s and MFU are not measured (empty), not made up
    assert rows[0]["tokens_per_s"] == "" and rows[0]["mfu"] == ""


def test_dict_batch_with_labels_uses_the_models_own_loss():
    model = KwargsModel()
    batch = {"features": torch.randn(4, 8), "labels": torch.randint(0, 3, (4,))}
    objective = make_objective(model, mp.Precision("32-true"))
    loss = objective(model, batch)
    assert torch.equal(loss, F.cross_entropy(model.net(batch["features"]), batch["labels"]))
    assert objective.describe == "model(**batch).loss"


def test_dict_batch_with_loss_fn_keeps_labels_out_of_the_model():
    model = KwargsModel()
    batch = {"features": torch.randn(4, 8), "labels": torch.randint(0, 3, (4,))}
    objective = make_objective(model, mp.Precision("32-true"),
                               lambda out, y: F.cross_entropy(out["logits"], y, label_smoothing=0.1))
    loss = objective(model, batch)
    assert model.seen == [set()]                      # the model did not compute its own loss
    expected = F.cross_entropy(model.net(batch["features"]), batch["labels"], label_smoothing=0.1)
    assert torch.equal(loss, expected)


def test_dict_inputs_go_to_the_model_as_keyword_arguments():
    model = KwargsModel()
    x, y = {"features": torch.randn(4, 8)}, torch.randint(0, 3, (4,))
    with_fn = make_objective(model, mp.Precision("32-true"), lambda out, t: F.cross_entropy(out["logits"], t))
    own = make_objective(model, mp.Precision("32-true"))
    assert torch.equal(with_fn(model, (x, y)), own(model, (x, y)))
    assert own.describe == "model(**inputs, labels=targets).loss"


@dataclass
class GraphBatch:
    """A user's own batch type with .to() (like torch_geometric's Data)."""
    x: torch.Tensor
    y: torch.Tensor
    moved_to: str = ""

    def to(self, device):
        return GraphBatch(self.x.to(device), self.y.to(device), str(device))


def test_an_object_with_to_is_moved_by_its_own_to_and_passed_whole(tmp_path):
    batch = GraphBatch(torch.randn(4, 8), torch.randint(0, 3, (4,)))
    strategy = get_strategy("single")                 # CUDA when there is one, else the CPU
    moved = strategy.to_device(batch)
    assert moved.moved_to == str(strategy.device)
    model = Classifier()
    objective = make_objective(model, mp.Precision("32-true"), lambda out, b: F.cross_entropy(out, b.y))

    class Wrapper(nn.Module):                         # forward(batch) -> logits
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, b):
            return self.inner(b.x)
    wrapped = Wrapper().to(strategy.device)
    assert torch.equal(objective(wrapped, moved), F.cross_entropy(model(moved.x), moved.y))
    result = _fit(wrapped, [batch, batch], tmp_path, loss_fn=lambda out, b: F.cross_entropy(out, b.y))
    assert result.steps == 2


@pytest.mark.parametrize("batch, said", [
    (torch.randint(0, 9, (4, 16)), "an int64 tensor of shape (4, 16)"),
    ((torch.zeros(4, 8), torch.zeros(4), torch.zeros(4)), "a tuple of 3"),
    ([{"x": torch.zeros(8)}] * 4, "a list of 4 (dict with keys ['x']"),
    ("text", "a str"),
])
def test_an_unsupported_batch_says_what_came_and_what_to_pass_in_one_line(batch, said):
    model = Classifier()
    objective = make_objective(model, mp.Precision("32-true"), F.cross_entropy)
    with pytest.raises(ConfigError) as e:
        objective(model, batch)
    msg = str(e.value)
    assert "\n" not in msg and said in msg and "(inputs, targets)" in msg and "'labels'" in msg


def test_a_batch_of_another_shape_than_the_first_is_refused():
    model = KwargsModel()
    objective = make_objective(model, mp.Precision("32-true"))
    objective(model, {"features": torch.randn(4, 8), "labels": torch.randint(0, 3, (4,))})
    with pytest.raises(ConfigError, match="first was a dict with keys \\['features', 'labels'\\]"):
        objective(model, {"features": torch.randn(4, 8)})


def test_tokens_are_the_attention_masks_ones_and_cost_no_host_sync():
    model = KwargsModel()
    objective = make_objective(model, mp.Precision("32-true"))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    tokens = objective.tokens({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": mask})
    assert isinstance(tokens, torch.Tensor) and int(tokens) == 5      # a device tensor, not an int
    assert objective.tokens({"input_ids": torch.ones(2, 4, dtype=torch.long)}) == 8
    assert objective.tokens((torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))) == 8
    assert objective.tokens((torch.randn(2, 4), torch.zeros(2))) is None


def test_tokens_per_second_counts_only_non_padding_tokens(tmp_path, monkeypatch):
    """Two runs whose batches differ only in padding: half the tokens, half the logged count."""
    import mixprec.train.meter as meter

    counted = []
    original = meter.IntervalMeter.log

    def spy(self, out, **kw):
        counted.append(int(self.tokens))
        return original(self, out, **kw)
    monkeypatch.setattr(meter.IntervalMeter, "log", spy)

    class TokenModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)

        def forward(self, input_ids, attention_mask, labels):
            return F.mse_loss((self.emb(input_ids) * attention_mask[..., None]).sum(-1), labels)

    ids = torch.randint(0, 16, (4, 8))
    half = torch.cat([torch.ones(4, 4), torch.zeros(4, 4)], 1).long()
    data = [{"input_ids": ids, "attention_mask": half, "labels": torch.randn(4, 8)}] * 2
    _fit(TokenModel(), data, tmp_path, log_interval=2)
    assert counted == [2 * 16]                        # 2 steps x 16 real tokens, not 2 x 32
