"""``a / b`` elementwise in fp32, correctly rounded, as a Triton launch that Inductor can schedule.

``g = m / den`` of the layer and its gradient ``grad / den``: torch's CUDA division is IEEE's
(``div.rn.f32``, subnormals kept), and so is ``tl.math.div_rn``; a division that Inductor generates itself
is ``div.full.f32``, not correctly rounded (:mod:`dora_num.ops.magnitude`).  Launched through
``torch.library.wrap_triton`` by the traced op ``dora_num::magnitude_div_traced``; no multiplication,
so nothing to contract.

References: the division's rounding is the last step of lemma 2 (``g``) in docs/bounds.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import fusion_opts, launcher


@triton.jit
def _div_rn_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    tl.store(out_ptr + offs, tl.math.div_rn(a, b), mask=mask)


def div_rn(a: torch.Tensor, b: torch.Tensor, *, traced: bool = False) -> torch.Tensor:
    """fp32 ``a / b`` of two contiguous 1-D tensors of one length on CUDA (``a`` fp32, bf16 or fp16, upcast
    exactly; ``b`` fp32).  ``traced``: launched through ``wrap_triton``."""
    out = torch.empty(b.shape, dtype=torch.float32, device=b.device)
    n = b.numel()
    if n:
        block = 1024
        kernel, opts = launcher(_div_rn_kernel, traced), fusion_opts(False, traced)
        kernel[(triton.cdiv(n, block),)](a, b, out, n, BLOCK=block, num_warps=4, **opts)
    return out
