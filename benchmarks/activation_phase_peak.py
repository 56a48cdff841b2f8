"""Peak live tensor bytes of one forward + backward of a preset Transformer, parameter gradients
excluded, against the estimator's activation phase (issue 27, docs/performance.md, fourth pass):
the running sum of the CPU allocator's events (``torch.profiler``, ``profile_memory=True``) in
time order, each parameter's gradient subtracted when it is accumulated. Usage:
    python benchmarks/activation_phase_peak.py MODE BATCH SEQ FP8_ACTS(0|1) CHECKPOINTING(0|1)
(model gpt-ref; e.g. ``bf16-true 2 128 1 0``)
"""
import sys, torch
from torch.profiler import ProfilerActivity, profile
from mixprec.models import Transformer
from mixprec.models.config import get_model_config
from mixprec.precision import autocast, cast_module, get_policy
from mixprec.nn.fp8_activations import store_activations_in_fp8
from mixprec.estimate.memory import estimate_memory, ModelShape
mode, B, T, fp8, ck = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
torch.manual_seed(0)
model = Transformer.from_preset("gpt-ref", gradient_checkpointing=ck)
cast_module(model, get_policy(mode))
if fp8: store_activations_in_fp8(model)
x, y = torch.randint(0, 8192, (B, T)), torch.randint(0, 8192, (B, T))
def hook(p):
    with torch.profiler.record_function(f"GRAD:{p.grad.untyped_storage().nbytes()}"):
        pass
for p in model.parameters():
    p.register_post_accumulate_grad_hook(hook)
def step():
    with autocast(get_policy(mode), device_type="cpu"):
        loss = model(x, y)[1]
    loss.backward()
    model.zero_grad(set_to_none=True)
step()
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    step()
ev = sorted([(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
            + [(e.start_ns(), -int(e.name()[5:])) for e in prof.profiler.kineto_results.events() if e.name().startswith("GRAD:")])
ops = sorted((e.start_ns(), e.end_ns(), e.name()) for e in prof.profiler.kineto_results.events() if e.name() != "[memory]" and not e.name().startswith("GRAD:"))
live = peak = 0; tpk = 0
for t, n in ev:
    live += n
    if live > peak: peak, tpk = live, t
at = [n for s, e, n in ops if s <= tpk <= e][-4:]
est = estimate_memory(ModelShape.from_config(model.config), mode, batch=B, seq=T, device="cpu", fp8_activations=fp8, checkpointing=ck)
M = 2**20
print(f"{mode} {B}x{T} fp8={fp8} ckpt={ck}: measured live peak {peak/M:.2f} MiB at {at}; est acts {est.activations/M:.2f} + max(loss {est.loss_buffers/M:.2f}, bwd {est.backward_buffers/M:.2f}) = {(est.activations+max(est.loss_buffers,est.backward_buffers))/M:.2f}")
