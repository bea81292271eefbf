"""The GPU suite's ``fma`` section (notebook 02): norm-assembly variants (contraction
on/off x ``tl.sqrt`` / ``tl.sqrt_rn`` / PTX ``sqrt.rn.f32``) and compose variants
(contraction on/off) on the seeded inputs of :mod:`dora_num.studies.inputs`: bitwise
agreement with the torch reference, ULP histograms, PTX instruction counts, and a
sample (``fma_sqrt_sample.npz``) for the bit-for-bit CPU emulation of
:mod:`dora_num.studies.fma.gpu_vs_emulation`."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from ...numerics.arithmetic import TorchFP32
from ...numerics.formulas import norm_assembly, scale_constants
from ...ops import reference as ref
from ...ops.kernels import compose as kc
from ...ops.kernels.norm_assembly import SQRT_VARIANTS, norm_assembly_triton, ptx_instruction_counts
from .. import inputs
from ..bench import bitwise_agreement, ulp_histogram
from .datasets import FMA


def _diff_record(save: dict, name: str, out, ref_out, sample: int) -> None:
    """Store where ``out`` differs from ``ref_out`` in its first ``sample`` elements:
    flat indices (int32) and the variant's bit patterns (so a CPU emulation can be
    compared bit for bit without storing every output)."""
    bits = {2: np.uint16, 4: np.uint32}[out.element_size()]
    ints = {2: torch.int16, 4: torch.int32}[out.element_size()]
    o = out.reshape(-1)[:sample].contiguous().view(ints).cpu().numpy().view(bits)
    r = ref_out.reshape(-1)[:sample].contiguous().view(ints).cpu().numpy().view(bits)
    idx = np.nonzero(o != r)[0].astype(np.int32)
    save[f"{name}__idx"] = idx
    save[f"{name}__bits"] = o[idx]


def bench_fma(out_dir: Path, n: int = inputs.SUITE_FMA_N, sample: int = 1 << 18) -> list[dict]:
    """Variants vs the torch reference on ``n`` seeded inputs; ``fma_sqrt_sample.npz``
    holds, for the first ``sample`` inputs, where each variant differs (indices +
    bits) and the sha256 of the reference's bytes.  The inputs are regenerated bit
    for bit on any machine by :func:`~dora_num.studies.inputs.suite_assembly` /
    :func:`~dora_num.studies.inputs.suite_compose`; the
    first 2^16 are stored as well, for a self-contained spot check.  ``sample`` is
    2^18: the file is ~2.4 MB (2^20 made 5.4 MB, a third of the repo's data budget);
    the agreement rates in the CSV are over all ``n``."""
    s, two_s, s_sq = scale_constants(inputs.SUITE_FMA_SCALE)
    spot = min(sample, 1 << 16)
    b_np, c_np, a_np = inputs.suite_assembly(n)
    b, c, a = (torch.from_numpy(v).cuda() for v in (b_np, c_np, a_np))
    ref_out = norm_assembly(TorchFP32, b, c, a, two_s, s_sq)  # torch.sqrt on CUDA: correctly rounded
    rows = []
    save = {"meta_norm_seed": np.int64(inputs.SUITE_SEED), "meta_norm_n": np.int64(n), "meta_sample": np.int64(sample),
            "meta_scale": np.float32(s),
            "norm_base_sq": b_np[:spot], "norm_cross": c_np[:spot], "norm_ba": a_np[:spot],
            "norm_ref_spot": ref_out[:spot].cpu().numpy(),
            "norm_ref_sha256": np.bytes_(hashlib.sha256(ref_out[:sample].cpu().numpy().tobytes()).hexdigest())}
    for fusion in (False, True):
        for sq in SQRT_VARIANTS:
            out, kern = norm_assembly_triton(b, c, a, two_s, s_sq, fp_fusion=fusion, sqrt=sq, return_kernel=True)
            name = f"norm_fusion{'On' if fusion else 'Off'}_{sq}"
            rows.append({"op": "norm_assembly", "variant": name, "fp_fusion": fusion, "sqrt": sq, "n": n,
                         "agreement": bitwise_agreement(out, ref_out), "production": (not fusion and sq == "rn"),
                         **{f"ulp_{k}": v for k, v in ulp_histogram(out, ref_out).items()},
                         **{f"ptx_{k}": v for k, v in ptx_instruction_counts(kern).items()}})
            _diff_record(save, name, out, ref_out, sample)
    rows_c, cols_c = inputs.SUITE_FMA_COMPOSE_SHAPE  # 4M elements for the rates
    base_np, lora_np, g_np = inputs.suite_compose(rows_c, cols_c)
    save["meta_compose_seed"] = np.int64(inputs.SUITE_SEED + 3)
    save["meta_compose_shape"] = np.array([rows_c, cols_c], dtype=np.int64)
    save["compose_g"] = g_np
    save["compose_base_spot"] = base_np.reshape(-1)[:spot]
    save["compose_lora_spot"] = lora_np.reshape(-1)[:spot]
    for dtype in (torch.float32, torch.bfloat16):
        base = torch.from_numpy(base_np).cuda().to(dtype)
        lora = torch.from_numpy(lora_np).cuda().to(dtype)
        g = torch.from_numpy(g_np).cuda()
        want = ref.compose_stable_ref(base, lora, g, s)
        dn = str(dtype).removeprefix("torch.")
        want_bits = want.reshape(-1)[:sample].contiguous().view({2: torch.int16, 4: torch.int32}[want.element_size()])
        save[f"compose_ref_{dn}_sha256"] = np.bytes_(hashlib.sha256(want_bits.cpu().numpy().tobytes()).hexdigest())
        for fusion in (False, True):
            out, _, kern = kc.compose_fwd(base, lora, g, s, fp_fusion=fusion, return_kernel=True)
            name = f"compose_{dn}_fusion{'On' if fusion else 'Off'}"
            rows.append({"op": "compose", "variant": name, "fp_fusion": fusion, "sqrt": "", "n": out.numel(),
                         "dtype": dn, "agreement": bitwise_agreement(out, want), "production": not fusion,
                         **{f"ulp_{k}": v for k, v in ulp_histogram(out, want).items()},
                         **{f"ptx_{k}": v for k, v in ptx_instruction_counts(kern).items()}})
            _diff_record(save, name, out, want, sample)
    np.savez_compressed(FMA.path("sample", out_dir), **save)
    return rows
