"""How fit() turns a Hugging Face causal LM's output into a loss: FP32 next-token cross-entropy of
``out.logits`` against mixprec's already-shifted targets, with no labels, mask or positions."""
import pytest
import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec.errors import ConfigError
from mixprec.models.objective import make_objective

transformers = pytest.importorskip("transformers")

ARCHS = ["gpt2", "llama"]


@pytest.mark.parametrize("arch", ARCHS)
def test_loss_is_the_fp32_next_token_cross_entropy_of_the_logits(arch, hf_model, batches):
    model = hf_model(arch).eval()
    (x, y), = batches(1)
    objective = make_objective(model, mp.Precision("32-true"))
    with torch.no_grad():
        loss = objective(model, x, y)
        logits = model(input_ids=x).logits                       # (B, T, V)
        by_hand = -torch.log_softmax(logits.double(), -1).gather(-1, y.unsqueeze(-1)).mean()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), by_hand, rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_loss_from_bf16_logits_is_computed_in_fp32(arch, hf_model, batches):
    model = hf_model(arch).eval()
    (x, y), = batches(1)
    precision = mp.Precision("bf16-mixed")
    precision.setup(model)
    objective = make_objective(model, precision)
    with torch.no_grad(), precision.autocast():
        logits = model(input_ids=x).logits
        loss = objective(model, x, y)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    # the same bf16 logits, upcast before the softmax (not a bf16 log-softmax)
    expected = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    assert torch.equal(loss, expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_loss_equals_hf_labels_loss_when_labels_are_the_unshifted_inputs(arch, hf_model, batches):
    """HF shifts ``labels`` itself; mixprec's targets are already shifted (so it never passes
    them as labels). With the last target ignored, both are the same mean."""
    model = hf_model(arch).eval()
    (x, _), = batches(1)
    targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
    objective = make_objective(model, mp.Precision("32-true"))
    with torch.no_grad():
        ours = objective(model, x, targets)
        theirs = model(input_ids=x, labels=x).loss
        shifted_twice = model(input_ids=x, labels=targets).loss   # what passing labels= would do
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert abs(shifted_twice.item() - ours.item()) > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_all_ones_mask_and_arange_positions_change_nothing_for_packed_windows(arch, hf_model, batches):
    model = hf_model(arch).eval()
    (x, _), = batches(1)
    B, T = x.shape
    with torch.no_grad():
        default = model(input_ids=x, use_cache=False).logits
        explicit = model(input_ids=x, use_cache=False, attention_mask=torch.ones(B, T, dtype=torch.long),
                         position_ids=torch.arange(T).expand(B, T)).logits
    torch.testing.assert_close(explicit, default, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name, build", [
    ("BertForMaskedLM", lambda t: t.BertForMaskedLM(t.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64))),
    ("T5ForConditionalGeneration", lambda t: t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2))),
])
def test_encoder_and_seq2seq_models_get_a_one_line_error_naming_loss_fn(name, build, batches, tmp_path):
    model = build(transformers)
    with pytest.raises(ConfigError) as e:
        mp.fit(model, batches(1), mixed_precision="32-true", max_steps=1, progress=False,
               audit=False, run_dir=str(tmp_path))
    message = str(e.value)
    assert "\n" not in message and name in message and "loss_fn=" in message
