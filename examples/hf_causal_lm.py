"""A Hugging Face Llama-style model trained by mixprec, with no glue: once through ``fit()`` and
once through a hand-written loop on the same ``mixprec.Precision`` object ``fit()`` uses.

    python examples/hf_causal_lm.py

The model comes from a tiny ``LlamaConfig`` (random init, nothing downloaded). mixprec sees that
it is a causal LM, calls ``model(input_ids=x, use_cache=False)`` and computes the next-token loss
in FP32 from its logits against the loader's already-shifted targets (see docs/hf.md). The
``mixprec train`` equivalent is ``mixprec train model=hf:examples/configs/hf-llama-tiny.json``.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mixprec as mp

STEPS = 20


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config)


corpus = mp.data.builtin_corpus()          # Python's own stdlib source, byte-level tokens


def batches():
    dataset = mp.data.TokenDataset(corpus.train_path, max_length=64)
    return mp.data.DistributedDataLoader(dataset, batch_size=8, seed=0)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


# 1. fit(): the model as it comes from transformers (constant LR, to compare with the loop below).
model = tiny_llama()
result = mp.fit(model, batches(), mixed_precision="bf16-mixed", optimizer=adamw(model),
                max_steps=STEPS, warmup_steps=0, min_lr_ratio=1.0, clip_grad_norm=1.0,
                progress=False, audit=False, ckpt_interval=0, run_dir="runs/hf_causal_lm",
                overwrite=True)          # each run of the example starts over in its folder
print(f"fit():     {result.steps} steps under {result.policy}; last loss {result.final_loss:.6f}; "
      f"from_pretrained folder: {result.run_dir}/hf")

# 2. The same training written by hand, on the same kind of Precision object fit() uses, on the
# device fit() picked (a Precision's default: the current CUDA device if there is one, else the CPU).
precision = mp.Precision("bf16-mixed")
model = tiny_llama().to(precision.device)
model, optimizer = precision.setup(model, adamw(model))
for step, (x, y) in zip(range(STEPS), batches()):
    x, y = x.to(precision.device), y.to(precision.device)
    with precision.autocast():                                       # matmuls in BF16
        logits = model(input_ids=x, use_cache=False).logits          # (B, T, V) in BF16
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # FP32
    precision.backward(loss)
    precision.step(optimizer, clip_grad_norm=1.0)                    # unscale, check, clip, step
    optimizer.zero_grad()
print(f"hand loop: {step + 1} steps under {precision.name}; last loss {loss.item():.6f}; "
      f"final norm weights in {model.model.norm.weight.dtype}")
# Exactly equal on a CPU; a GPU's attention backward may sum in another order from run to run.
print("same loss as fit():", loss.item() == result.final_loss)
