"""The shims that make Triton's interpreter (``TRITON_INTERPRET=1``, triton 3.5) run a kernel as
the GPU would, for the subprocess scripts of tests/formats/test_fp8_triton.py and
tests/optim/test_adamw_triton.py (prepended to each script: the variable must be set before
Triton is imported, so they run in a fresh process):

* scalar arguments are 1-element arrays that numpy >= 2.3 refuses to ``int()`` (a ``for`` loop
  over a runtime bound fails);
* FP32 -> BF16 truncates where the GPU rounds to nearest even.
"""

INTERPRETER_SHIMS = r'''
import ast
import sys
import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as ti

_patch_tensor = ti._patch_lang_tensor
def _patch(tensor):                       # scalars are 1-element arrays; numpy >= 2.3 won't int() them
    _patch_tensor(tensor)
    tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])
ti._patch_lang_tensor = _patch

_trunc = ti.InterpreterBuilder.create_fp_trunc
def _fp_trunc(self, src, dst_type):       # FP32 -> BF16 rounds to nearest even, as on the GPU
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        t = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        return ti.TensorHandle(t.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    return _trunc(self, src, dst_type)
ti.InterpreterBuilder.create_fp_trunc = _fp_trunc
'''
"""Imports (``ast``, ``sys``, ``np``, ``torch``, ``tl``, ``ti``) and the two shims, as script text."""
