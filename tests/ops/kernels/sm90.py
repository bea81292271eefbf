"""Compile the Triton kernels that Inductor launches for a compiled layer for an H100/H200 (sm_90) on a machine
with no GPU.

The Triton interpreter, which runs the kernels in CI, accepts code that the compiler refuses (a global
read from a kernel that is not a ``tl.constexpr`` object, say) and shows nothing of what the compiler
makes of the arithmetic (which multiplies it contracts into FMAs).  Triton compiles for an explicit
target without a driver (its wheel carries ``ptxas``), so here each kernel is compiled for
``GPUTarget("cuda", 90, 32)`` with the arguments of a launch, tensors as ``MockTensor`` s, as its
launcher would specialise them.  The binder and ``_pack_args`` are Triton's own (private API, 3.7): what
``JITFunction.run`` does before it compiles, minus the driver's device and stream.

Run as a script (the interpreter must be off: under ``TRITON_INTERPRET=1`` a ``@triton.jit`` function is an
interpreted one, which does not compile); ``tests/ops/kernels/test_sm90.py`` runs it in a subprocess and reads
its JSON: per case the PTX instruction counts with ``enable_fp_fusion`` on (Inductor's default for a wrapped
kernel) and off (our launches), as Inductor compiles it (fusion on, float arguments float64), whether the first
two are the same instructions, and the float64 immediates of our launch's PTX; with the argument ``accesses``,
what Inductor's analysis of the tail finds it reads and writes (:func:`tail_accesses`).
"""

from __future__ import annotations

import json
import re
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler import compile as triton_compile
from triton.runtime.jit import MockTensor, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
COUNTED = ("fma.rn.f32", "fma.rn.f64", "mul.rn.f32", "mul.f32", "mul.rn.f64", "mul.f64", "sub.f32", "add.f32")


def ptx_of(kernel, *args, float_args: str = "fp32", **kwargs) -> str:
    """The PTX of ``kernel`` compiled for :data:`TARGET` as a launch with ``args``/``kwargs`` would compile it
    (torch dtypes stand for tensors of that dtype, 16-byte aligned).  ``float_args``: the type of the scalar float
    arguments, ``"fp32"`` as Triton's launcher types a Python float, or ``"fp64"`` as Inductor types a wrapped
    kernel's (``torch/_inductor/codegen/triton_utils.py``, ``_use_fp64_for_unbacked_floats``)."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*[MockTensor.wrap_dtype(a) for a in args], **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    if float_args != "fp32":
        signature = {k: float_args if v == "fp32" else v for k, v in signature.items()}
    return triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                          options=options.__dict__).asm["ptx"]


def counts(ptx: str) -> dict:
    """Instruction counts of the PTX (comments dropped; ``mul.f32`` counts bare multiplies only)."""
    body = "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))
    found = {k: len(re.findall(re.escape(k) + r"\s", body)) for k in COUNTED}
    found["mma"] = len(re.findall(r"\bw?gmma\.|\bmma\.", body))  # tensor-core instructions
    return found


def instructions(ptx: str) -> str:
    """The PTX without comments, ``add.rn``/``sub.rn`` written ``add``/``sub`` (fp32, fp64 and the packed 16-bit
    adds LLVM makes of a 16-bit sum formed in fp32 and rounded once): the rounding modifier that LLVM writes only
    where contraction is off.  An add is round-to-nearest either way, and ``ptxas`` contracts an add
    only with a multiply that has no rounding modifier (``mul.f32``), so two kernels whose texts are equal after
    this run the same arithmetic."""
    body = "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))
    return re.sub(r"\b(add|sub)\.rn\.(f32|f64|bf16x2|bf16|f16x2|f16)\b", r"\1.\2", body)


def f64_immediates(ptx: str) -> list[str]:
    """The 64-bit immediates of the PTX as ``0d`` hex: those written as float64 (``0d...``) and the bit patterns a
    ``mov.b64`` loads into a register (how a constant reaches an inline-asm ``mul.rn.f64``)."""
    hexes = set(re.findall(r"0d[0-9A-F]{16}", ptx))
    hexes |= {"0d%016X" % (int(v) & (2**64 - 1)) for v in re.findall(r"mov\.b64\s+%\w+,\s*(-?\d+);", ptx)}
    return sorted(hexes)


def tail_args(t, *, d_out=4096, d_in=4096, r=64, b_dtype=torch.float32) -> list:
    """The tail's positional arguments as the layer's launch passes them (``norm_tail``: guard, recompute, running
    flag; ``inv`` and unused pointers at U), each tensor made by ``t(shape, dtype)``; then the scalars and the
    guard's 40 constants."""
    f32 = torch.float32
    U = t((d_out, r), f32)
    return [U, t((d_out, r), b_dtype), t((r, r), f32), t((d_out,), f32), t((d_out,), f32), t((d_out,), f32),
            t((d_out,), f32), t((2,), torch.int32), t((3, d_out), f32), t((d_out,), torch.bool), t((3,), torch.int64),
            U, t((d_out, d_in), torch.bfloat16), t((r, d_in), torch.bfloat16), d_in, 1, d_in, 1, d_out, d_in, r,
            2.0, 1.0, 1.0, 1e-6, 2.0 ** -6] + [0.5] * 40


def tail_case(*, tc_bg: bool, b_dtype=torch.float32, guard=True, split=True, inv=False, fusion=False,
              float_args="fp32"):
    from dora_num.ops.kernels.norm_tail import _norm_tail_kernel

    return ptx_of(_norm_tail_kernel, *tail_args(lambda shape, dtype: dtype, b_dtype=b_dtype), HAS_M=True,
                  GUARD=guard, HAS_Z=guard, SPLIT=split, HAS_INV=inv, RECOMPUTE=guard, HAS_ACC=True, BLOCK_M=32,
                  BLOCK_R=64, BLOCK_K=16, BLOCK_D=64, TC_BG=tc_bg, B_PIECES=3, BF16_DOT=True, RN=True, num_warps=4,
                  enable_fp_fusion=fusion, float_args=float_args)


def compose_fwd_case(*, add_base: bool, fusion=False, float_args="fp32"):
    from dora_num.ops.kernels.compose import _compose_fwd_kernel

    b16, f32 = torch.bfloat16, torch.float32
    return ptx_of(_compose_fwd_kernel, b16, b16, f32, b16, b16, b16, 4096, 4096, 2.0, BLOCK_M=64, BLOCK_N=64,
                  WRITE_INNER=False, ADD_BASE=add_base, G_FLAG=False, RN=True, num_warps=4, enable_fp_fusion=fusion,
                  float_args=float_args)


def compose_bwd_case(*, final_in_kernel: bool, fusion=False, float_args="fp32"):
    from dora_num.ops.kernels.compose import _compose_bwd_kernel

    b16, f32 = torch.bfloat16, torch.float32
    return ptx_of(_compose_bwd_kernel, b16, b16, b16, b16, f32, b16, b16, f32, torch.int32, f32, 4096, 4096, 2.0,
                  BLOCK_M=64, BLOCK_N=64, WRITE_DLORA=True, WRITE_DBASE=True, NEED_DG=True, RECOMPUTE_INNER=True,
                  FINAL_IN_KERNEL=final_in_kernel, CHUNK=8, ADD_GRAD=True, RN=True, num_warps=4,
                  enable_fp_fusion=fusion, float_args=float_args)


def split_case(*, scale: bool, fusion=False, float_args="fp32"):
    from dora_num.ops.kernels.products import _split_kernel

    f32 = torch.float32
    return ptx_of(_split_kernel, f32, f32, torch.float16 if scale else torch.bfloat16, 4096, PIECES=3,
                  HAS_SCALE=scale, RN=True, BLOCK=1024, num_warps=4, enable_fp_fusion=fusion, float_args=float_args)


def block_sum_case(*, fusion=False, float_args="fp32"):
    from dora_num.ops.kernels.products import _block_sum_kernel

    return ptx_of(_block_sum_kernel, torch.float32, torch.float32, 4096, 64, 192, PA=1, PB=3, BLOCK=1024,
                  num_warps=4, enable_fp_fusion=fusion, float_args=float_args)


def div_case(*, fusion=False, float_args="fp32"):
    from dora_num.ops.kernels.divide import _div_rn_kernel

    return ptx_of(_div_rn_kernel, torch.float32, torch.float32, torch.float32, 4096, BLOCK=1024, num_warps=4,
                  enable_fp_fusion=fusion, float_args=float_args)


# every kernel Inductor launches in a compiled layer (OpConfig.traced_ops, traced_tail), in the variants the
# launchers use: (builder, its arguments)
CASES = {
    "tail": (tail_case, dict(tc_bg=False)),
    "tail_no_guard": (tail_case, dict(tc_bg=False, guard=False)),
    "tail_fp16_split": (tail_case, dict(tc_bg=False, inv=True)),
    "tail_tc_fp32_B": (tail_case, dict(tc_bg=True)),
    "tail_tc_bf16_B": (tail_case, dict(tc_bg=True, b_dtype=torch.bfloat16)),
    "compose_fwd": (compose_fwd_case, dict(add_base=False)),
    "compose_fwd_add_base": (compose_fwd_case, dict(add_base=True)),
    "compose_bwd": (compose_bwd_case, dict(final_in_kernel=True)),
    "compose_bwd_two_launch": (compose_bwd_case, dict(final_in_kernel=False)),
    "split_bf16": (split_case, dict(scale=False)),
    "split_fp16_scaled": (split_case, dict(scale=True)),
    "block_sum": (block_sum_case, {}),
    "div_rn": (div_case, {}),
}


def tail_accesses() -> dict:
    """Which arguments of the tail, launched as the compiled layer launches it (guard, recompute, running flag),
    Inductor's analysis of a wrapped kernel (``identify_accessed_tensors``: the kernel's TTIR, scalars as
    constants) finds read and written: where it fails, Inductor takes every argument as written and copies each.
    The analysis asks Triton's driver for the target only; a stand-in gives it sm_90."""
    from triton.runtime import driver

    class _Sm90:
        def get_current_target(self):
            return TARGET

        def is_active(self):
            return True

    driver.set_active(_Sm90())
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    from dora_num.ops.kernels.norm_tail import _norm_tail_kernel

    args = tail_args(lambda shape, dtype: torch.zeros(shape, dtype=dtype), d_out=64, d_in=32, r=16)
    kwargs = dict(zip((p.name for p in _norm_tail_kernel.params), args))
    kwargs.update(HAS_M=True, GUARD=True, HAS_Z=True, SPLIT=True, HAS_INV=False, RECOMPUTE=True, HAS_ACC=True,
                  BLOCK_M=32, BLOCK_R=16, BLOCK_K=16, BLOCK_D=64, TC_BG=False, B_PIECES=3, BF16_DOT=True, RN=True)
    found = identify_accessed_tensors(_norm_tail_kernel, kwargs, {}).read_writes
    return {"writes": sorted(d.name for d in found.writes), "reads": sorted(d.name for d in found.reads)}


def main(names) -> dict:
    """Per case: the instruction counts with fusion on, with fusion off and as Inductor compiles it (fusion on,
    float arguments float64), whether the first two are the same instructions (:func:`instructions`), and the
    float64 immediates with fusion off (:func:`f64_immediates`)."""
    out = {}
    for name in names:
        build, kw = CASES[name]
        ptx = {f: build(**kw, fusion=f) for f in (True, False)}
        inductor = build(**kw, fusion=True, float_args="fp64")  # as Inductor compiles it: its float arguments too
        out[name] = {"fusion_on": counts(ptx[True]), "fusion_off": counts(ptx[False]), "inductor": counts(inductor),
                     "same_instructions": instructions(ptx[True]) == instructions(ptx[False]),
                     "f64_immediates": f64_immediates(ptx[False])}
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["accesses"]:
        print(json.dumps(tail_accesses()))
    else:
        print(json.dumps(main(sys.argv[1:] or list(CASES))))
