"""Argument checks shared by every public operator.

Each check raises with the argument's name and the problem, so a user reading
the traceback knows which tensor to look at.  Finiteness checks on large tensors
cost a pass over memory; they are done where the docstring of the public
function says so (references always; fast paths only on the small ``[d_out]``
vectors, with non-finite activations propagating as in any torch layer).
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FORMAT_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}  # the numerics' format names


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of: {allowed}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on one device: {listing}")
    return first


def check_finite(name: str, t: torch.Tensor) -> None:
    if t.numel() and not bool(torch.isfinite(t).all()):
        n_nan = int(torch.isnan(t).sum())
        n_inf = int(torch.isinf(t).sum())
        raise ValueError(f"{name} contains non-finite values ({n_nan} NaN, {n_inf} Inf)")


def check_scale(scale) -> float:
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a scalar, got a tensor of shape {tuple(scale.shape)}")
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_lora_factors(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> tuple[int, int, int]:
    """Shapes ``W [d_out, d_in]``, ``A [r, d_in]``, ``B [d_out, r]``; returns (d_out, d_in, r)."""
    check_tensor("W", W, ndim=2)
    check_tensor("A", A, ndim=2)
    check_tensor("B", B, ndim=2)
    check_same_device(W=W, A=A, B=B)
    d_out, d_in = W.shape
    r = A.shape[0]
    if A.shape[1] != d_in:
        raise ValueError(f"A has shape {tuple(A.shape)}; expected [r, d_in] with d_in = {d_in} (from W)")
    if B.shape != (d_out, r):
        raise ValueError(f"B has shape {tuple(B.shape)}; expected [d_out, r] = [{d_out}, {r}] (from W and A)")
    if r == 0:
        raise ValueError("rank r = 0: A and B are empty; a DoRA adapter needs r >= 1")
    if d_in == 0:
        raise ValueError(f"W has shape {tuple(W.shape)}: d_in = 0 input features; a row norm needs d_in >= 1")
    return d_out, d_in, r


def check_compose_args(base, lora, g) -> int:
    """``base``, ``lora`` ``[..., d_out]`` of one float dtype; ``g`` fp32 ``[d_out]``."""
    check_tensor("base", base, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor("lora", lora, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor("g", g, ndim=1, dtypes=None)
    if g.dtype != torch.float32:
        raise TypeError(
            f"g has dtype {g.dtype}; the numerical contract keeps g in float32 on every path "
            "(rounding g to bf16/fp16 is an error as large as g-1 itself)"
        )
    check_same_device(base=base, lora=lora, g=g)
    if base.shape != lora.shape:
        raise ValueError(f"base and lora must have one shape, got {tuple(base.shape)} and {tuple(lora.shape)}")
    if base.dtype != lora.dtype:
        raise TypeError(f"base and lora must have one dtype, got {base.dtype} and {lora.dtype}")
    if base.dim() == 0:
        raise ValueError("base must have at least one dimension [..., d_out]")
    d_out = base.shape[-1]
    if g.shape[0] != d_out:
        raise ValueError(f"g has {g.shape[0]} entries; expected d_out = {d_out} (last dim of base)")
    return d_out
