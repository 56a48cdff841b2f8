"""Peak live bytes of the head + cross-entropy forward and backward, per token and word (issue 27,
docs/performance.md, fourth pass): the running sum of the CPU allocator's events
(``torch.profiler`` with ``profile_memory=True``) in time order. The head weight needs no gradient,
so the figure is the loss phase's own buffers. Usage:
    python benchmarks/loss_phase_peak.py DTYPE [CHUNK]      # DTYPE float32 | bfloat16; CHUNK tokens, 0: off
"""
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

N, d, V = 512, 64, 8192
dt = getattr(torch, sys.argv[1])
chunk = int(sys.argv[2]) if len(sys.argv) > 2 else 0
head = torch.nn.Linear(d, V, bias=False).to(dt)
head.weight.requires_grad_(False)
h = torch.randn(N, d, dtype=dt, requires_grad=True)
y = torch.randint(0, V, (N,))


def loss_sum(hh, yy):
    return F.cross_entropy(head(hh).float(), yy, reduction="sum")     # as Transformer._loss_sum


def run():
    if chunk:
        total = h.new_zeros((), dtype=torch.float32)
        for a in range(0, N, chunk):
            total = total + checkpoint(loss_sum, h[a:a + chunk], y[a:a + chunk], use_reentrant=False)
        loss = total / N
    else:
        logits = head(h).float()                                       # as Transformer.forward
        loss = F.cross_entropy(logits, y)
        del logits                                                     # the trainer drops the logits
    loss.backward()


run()
h.grad = None
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    run()
events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
live = peak = 0
for _, nbytes in events:
    live += nbytes
    peak = max(peak, live)
print(f"{sys.argv[1]} chunk={chunk}: peak {peak / ((chunk or N) * V):.2f} bytes per token and word")
