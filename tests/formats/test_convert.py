"""convert_to_fp8: what is swapped, what is kept in high precision, and the report."""
import pytest
import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.formats import Fp8Config, Fp8Linear
from mixprec.precision import convert_to_fp8, prepare_fp8
from mixprec.precision import get_policy


class Router(nn.Module):
    keep_in_fp32 = True

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 16)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(128, 64)
        self.fc = nn.Linear(64, 128)
        self.proj = nn.Linear(128, 64)
        self.norm = nn.LayerNorm(64)
        self.small = nn.Linear(64, 24)          # 24 is not a multiple of 16
        self.moe = nn.ModuleDict({"gate": nn.Linear(64, 16), "router": Router()})
        self.tied = nn.Linear(64, 128, bias=False)
        self.tied.weight = self.tok.weight      # output projection tied to the embedding
        self.lm_head = nn.Linear(64, 128)


def test_default_rules_convert_only_eligible_linears_and_report_why():
    model = Toy()
    report = convert_to_fp8(model, config=Fp8Config.from_recipe("blockwise"))
    assert report.converted == ["fc", "proj"]
    reasons = dict(report.skipped)
    assert "embedding" in reasons["tok"]
    assert "normalization" in reasons["norm"]
    assert "multiples of 16" in reasons["small"]
    assert "gate" in reasons["moe.gate"]
    assert "keep_in_fp32" in reasons["moe.router.proj"]
    assert "tied to an embedding" in reasons["tied"]
    assert "output head" in reasons["lm_head"]
    assert isinstance(model.fc, Fp8Linear) and type(model.lm_head) is nn.Linear
    assert report.expected_path == "emulated"
    text = str(report)
    assert "2 Linear layers converted" in text and "skip  small" in text


def test_the_headline_says_what_the_kept_modules_are_by_kind():
    """Not "N modules kept in high precision" next to a Linear count it does not match (a new-user
    trial read "8 converted, 8 kept" beside "8 fp8, 1 bf16" as a contradiction)."""
    report = convert_to_fp8(Toy(), config=Fp8Config.from_recipe("blockwise"),
                            policy=get_policy("fp8-blockwise"))
    head = str(report).splitlines()[0]
    assert ("2 Linear layers converted; kept in high precision (bf16 compute): 5 Linears (small, "
            "moe.gate, moe.router.proj, ...), 1 embedding, 1 norm; path: emulated") in head
    assert "modules kept" not in head


def test_parameters_are_reused_so_optimizers_stay_valid():
    model = Toy()
    params_before = [id(p) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_fp8(model, config=Fp8Config.from_recipe("tensorwise"))
    assert [id(p) for p in model.parameters()] == params_before
    x = torch.randn(4, 64)
    model.proj(model.fc(x)).sum().backward()
    opt.step()
    assert model.fc.weight.grad is not None


def test_module_filter_fn_and_policy_exemptions():
    model = Toy()
    report = convert_to_fp8(model, config=Fp8Config.from_recipe("rowwise"),
                            module_filter_fn=lambda mod, name: name != "proj")
    assert report.converted == ["fc"]
    assert dict(report.skipped)["proj"] == "excluded by module_filter_fn"
    model = Toy()
    policy = get_policy("fp8-rowwise").replace(keep_fp32_names=("fc",))
    report = convert_to_fp8(model, config=Fp8Config.from_recipe("rowwise"), policy=policy)
    assert report.converted == ["proj"] and "policy" in dict(report.skipped)["fc"]


def test_converting_twice_is_a_no_op():
    model = Toy()
    convert_to_fp8(model, config=Fp8Config.from_recipe("blockwise"))
    again = convert_to_fp8(model, config=Fp8Config.from_recipe("blockwise"))
    assert again.converted == []


def test_bare_linear_and_wrong_config_are_rejected_with_the_fix():
    with pytest.raises(ConfigError, match="Fp8Linear.from_linear"):
        convert_to_fp8(nn.Linear(64, 64), config=Fp8Config.from_recipe("blockwise"))
    with pytest.raises(ConfigError, match="Fp8Config.from_recipe"):
        convert_to_fp8(Toy(), config="blockwise")  # type: ignore[arg-type]


def test_prepare_fp8_follows_the_policy():
    assert prepare_fp8(Toy(), get_policy("bf16-mixed")) is None
    report = prepare_fp8(Toy(), get_policy("fp8-blockwise"))
    assert report is not None and report.config.recipe == "blockwise" and report.converted


def test_transformer_keeps_head_embeddings_norms_and_gates():
    models = pytest.importorskip("mixprec.models")
    model = models.Transformer(num_layers=1, d_model=64, num_heads=4, vocab_size=256, max_seq_len=32)
    report = convert_to_fp8(model, config=Fp8Config.from_recipe("blockwise"))
    skipped = dict(report.skipped)
    assert "head" in skipped and "wte" in skipped and "ln_f" in skipped
    assert report.converted and all(n.startswith("blocks.") for n in report.converted)
    idx = torch.randint(0, 256, (2, 16))
    logits, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss) and all(isinstance(model.get_submodule(n), Fp8Linear)
                                        for n in report.converted)


def test_start_line_says_path_decided_at_conversion_with_counts_where_layers_differ():
    # It said "expected path: emulated" for a path each layer decided at conversion.
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 64))
    base = Fp8Config.from_recipe("tensorwise")
    same = convert_to_fp8(model, config=base)
    head = str(same).splitlines()[0]
    assert head.endswith("; path: emulated") and "expected" not in head
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 64))
    real = base.replace(backend="scaled-mm")                 # this CPU's torch._scaled_mm, one layer
    try:
        mixed = convert_to_fp8(model, config=base, config_fn=lambda m, name: real if name == "0" else base)
    except ConfigError as e:                                 # a torch without a CPU _scaled_mm
        pytest.skip(str(e))
    assert str(mixed).splitlines()[0].endswith("; path: cpu-scaled-mm (1 layer), emulated (2 layers)")
