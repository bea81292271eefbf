"""What the factored norm's products and guard do on the GPU (one H200 call per part).

``dora-num record products --out DIR [--smoke] [--only PART ...]`` writes, with provenance
sidecars (``--only``: tf32, bf16_base, fire_rate, accumulation, to split the run over device calls):

- ``tf32.csv``: fp32 W, A, B at 1024 x 4096, r = 64 (the LoRA term as large as W, and W = 0), the
  factored and the dense norm's largest relative error and err/bound with TF32 off, with
  ``allow_tf32`` and with ``set_float32_matmul_precision("high")``, the product model named;
- ``bf16_base.csv``: a bf16 base with fp32 adapters (the split route) and with bf16 adapters, the same
  columns (the factored norm's error there against the dense fp32 norm's, and how tight its bound is);
- ``accumulation_findings.json``: the accumulation probe of ``dora_num.studies.bounds.accumulation`` at
  the GEMM shapes the operator calls (U: d_out x 3r and d_out x r, G: r x r and 3r x 3r, inner
  dimensions up to one ``TC_BLOCK_K`` block) and a probe of subnormal 16-bit inputs, each with the
  analysis and what it implies for the charge (``bound_factor``); the raw probe in
  ``accumulation_probe_CARD.json.xz`` (each card its own record);
- ``guard_fire_rate.csv``: at the 8B and 70B projection shapes (bf16 W; fp32 and bf16 adapters; ranks
  16, 64, 256; ``||sBA|| = rho ||W||``, rho 0.05, 0.1, 0.2) the rows the guard flags (the tail kernel's
  count) and the norm's median time with the guard and without (``triton.testing.do_bench``).

Nothing here is imported by the operator; the tests of ``tests/ops/test_products_gpu.py`` check the
same statements as assertions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

PROJECTIONS = {  # (d_out, d_in) of the linear layers of Llama-3-8B and -70B
    "8B q/o": (4096, 4096), "8B k/v": (1024, 4096), "8B gate/up": (14336, 4096), "8B down": (4096, 14336),
    "70B q/o": (8192, 8192), "70B k/v": (1024, 8192), "70B gate/up": (28672, 8192), "70B down": (8192, 28672),
}


def _adapter(d_out, d_in, r, rho, *, w_dtype, a_dtype, seed=0, device="cuda"):
    """``(W, A, B, s)`` on ``device``: W ~ N(0, 1/d_in), A PEFT's kaiming_uniform, B Gaussian scaled so that
    ``||s B A||_F = rho ||W||_F`` (as ``dora_num.oracles.perturbed_adapter``, formed on the device: the 70B
    shapes are too large for the host's float64 reference)."""
    gen = torch.Generator().manual_seed(seed + d_in + r)
    W = (torch.randn(d_out, d_in, generator=gen) / math.sqrt(d_in)).to(device)
    A = ((torch.rand(r, d_in, generator=gen) * 2 - 1) / math.sqrt(d_in)).to(device)
    B = torch.randn(d_out, r, generator=gen).to(device)
    s = 2.0
    upd = torch.linalg.matrix_norm(s * (B.double() @ A.double()))
    B = B * float(rho * torch.linalg.matrix_norm(W.double()) / upd)
    return W.to(w_dtype), A.to(a_dtype), B.to(a_dtype), s


def _norm_errors(W, A, B, s) -> dict:
    """Largest relative errors of the factored (bare) and dense norms against the float64 norm, and their
    largest err/bound under the models the operator reports."""
    import dora_num as dn

    from ...numerics.norm_bounds import dense_norm_bound, factored_norm_bound
    from ...ops.products import fp32_matmul_precision, product_model

    ref = torch.linalg.vector_norm(W.double() + float(np.float32(s)) * (B.double() @ A.double()), dim=1)
    fac = dn.factored_row_norm(W, A, B, s, on_cancellation="off").double()
    den = dn.dense_row_norm(W, A, B, s).double()
    model = product_model(W, A)
    W64, A64, B64 = (t.double().cpu().numpy() for t in (W, A, B))
    fmt = "fp16" if W.dtype == torch.float16 else "bf16"
    bf = factored_norm_bound(W64, A64, B64, s, products=model.u, split_pieces=model.pieces, split_format=fmt)
    bd = dense_norm_bound(W64, A64, B64, s, matmul=fp32_matmul_precision("cuda"))
    refc = ref.cpu().numpy()
    ef, ed = np.abs(fac.cpu().numpy() - refc), np.abs(den.cpu().numpy() - refc)
    nz = refc > 0
    return {"model": model.label, "fp32_gemm": fp32_matmul_precision("cuda"),
            "rel_err_factored_max": float((ef[nz] / refc[nz]).max()), "rel_err_dense_max": float((ed[nz] / refc[nz]).max()),
            "err_over_bound_factored_max": float((ef / bf).max()), "err_over_bound_dense_max": float((ed / bd).max())}


def record_tf32(smoke: bool) -> list[dict]:
    rows = []
    d_out, d_in, r = (256, 1024, 16) if smoke else (1024, 4096, 64)
    for case in ("lora as large as W", "W = 0"):
        W, A, B, s = _adapter(d_out, d_in, r, 1.0, w_dtype=torch.float32, a_dtype=torch.float32)
        if case == "W = 0":
            W = torch.zeros_like(W)
        for setting in ("off", "allow_tf32", 'set_float32_matmul_precision("high")'):
            saved = torch.backends.cuda.matmul.allow_tf32
            try:
                if setting == "allow_tf32":
                    torch.backends.cuda.matmul.allow_tf32 = True
                elif setting != "off":
                    torch.set_float32_matmul_precision("high")
                rows.append({"case": case, "tf32": setting, "d_out": d_out, "d_in": d_in, "r": r,
                             **_norm_errors(W, A, B, s)})
            finally:
                torch.set_float32_matmul_precision("highest")
                torch.backends.cuda.matmul.allow_tf32 = saved
    return rows


def record_bf16_base(smoke: bool) -> list[dict]:
    rows = []
    d_out, d_in, r = (256, 1024, 16) if smoke else (1024, 4096, 64)
    for a_dtype in (torch.float32, torch.bfloat16):
        for rho in (0.05, 1.0):
            W, A, B, s = _adapter(d_out, d_in, r, rho, w_dtype=torch.bfloat16, a_dtype=a_dtype)
            rows.append({"adapters": str(a_dtype).removeprefix("torch."), "rho": rho, "d_out": d_out, "d_in": d_in,
                         "r": r, **_norm_errors(W, A, B, s)})
    return rows


def record_accumulation(smoke: bool, keep_records: bool = False):
    """The probe's findings per (format, product, shape, K) and the subnormal-input probe; with
    ``keep_records`` also the raw probe records (for :func:`~.accumulation.pack_probe`)."""
    from ...numerics.standard_model import TC_BLOCK_K
    from ...ops.products import tensor_core_mm as mm
    from .accumulation import analyze, bound_factor, run_probes, subnormal_input_probe

    ks = (384,) if smoke else (64, 384, 4096, TC_BLOCK_K)
    shapes = [("U", 4096, 3 * 16)] if smoke else [
        (p, m, n) for r in (8, 16, 64, 256, 384) for p, m, n in
        (("U split", 8192, 3 * r), ("U", 8192, r), ("G split", 3 * r, 3 * r), ("G", r, r))]
    out, raw = [], []
    for fmt in ("bf16", "fp16"):
        for shape in shapes:
            for K in ks:
                rec = run_probes(mm, fmt, K, shape=shape, device="cuda", positions=(0, K - 1) if smoke else None)
                f = analyze(rec)
                out.append({"format": fmt, "product": shape[0], "M": shape[1], "N": shape[2], "K": K, **f,
                            "bound": bound_factor(f)})
                raw.append(rec)
        out.append({"format": fmt, "probe": "subnormal inputs", **subnormal_input_probe(mm, fmt, device="cuda")})
    return (out, raw) if keep_records else out


def record_fire_rate(smoke: bool, shapes: dict | None = None) -> list[dict]:
    import triton

    import dora_num as dn

    from ...numerics.formulas import scale_constants
    from ...ops.config import get_config
    from ...ops.guard import decode
    from ...ops.norm import _factored_core, chunk_columns

    rows = []
    shapes = shapes or ({"8B q/o": (512, 4096)} if smoke else PROJECTIONS)
    for name, (d_out, d_in) in shapes.items():
        for a_dtype in (torch.float32, torch.bfloat16):
            for r in ((16,) if smoke else (16, 64, 256)):
                for rho in ((0.1,) if smoke else (0.05, 0.1, 0.2)):
                    W, A, B, s = _adapter(d_out, d_in, r, rho, w_dtype=torch.bfloat16, a_dtype=a_dtype)
                    core = _factored_core(W, A, B, scale_constants(s), chunk_columns(d_out, d_in, None), None, None,
                                          get_config())
                    _, flagged = decode(core.flag)
                    t_on = triton.testing.do_bench(lambda: dn.factored_row_norm(W, A, B, s), quantiles=[0.5, 0.2, 0.8])
                    t_off = triton.testing.do_bench(lambda: dn.factored_row_norm(W, A, B, s, on_cancellation="off"),
                                                    quantiles=[0.5, 0.2, 0.8])
                    rel = core.aux[1].float()
                    rows.append({"shape": name, "d_out": d_out, "d_in": d_in, "adapters": str(a_dtype)[6:], "r": r,
                                 "rho": rho, "flagged": flagged, "rel_max": float(rel.max()),
                                 "ms_guarded": t_on[0], "ms_guarded_p20": t_on[1], "ms_guarded_p80": t_on[2],
                                 "ms_bare": t_off[0], "ms_bare_p20": t_off[1], "ms_bare_p80": t_off[2]})
                    del W, A, B, core
                    torch.cuda.empty_cache()
    return rows


PARTS = ("tf32", "bf16_base", "fire_rate", "accumulation")


def build_parser(prog: str = "dora-num record products", name: str = "products"):
    from ...repro.recording import parser

    p = parser(prog, __doc__.split("\n\n")[0], smoke="one small case of each (minutes less)")
    p.add_argument("--only", nargs="+", choices=PARTS, help="record only these parts (default: all)")
    return p


def ingest_args(args) -> list[Path]:
    """Record the parts found in the output folder ``args.ingest`` (one device call may hold some of
    them) into ``data/gpu/products/``: the machine from each file's own sidecar, the commit from
    ``--git-sha`` or the run's parameters (refused when neither names one). Every file is checked
    before any is written."""
    from ...repro.provenance import read_provenance
    from ...repro.recording import ingest, machine_from_sidecar
    from .datasets import PRODUCTS, operator_accumulation

    src = Path(args.ingest)
    names = [p.name for p in PRODUCTS.paths(args.ingest)]
    any_card = operator_accumulation("*")  # each card's own record of the probe at the operator's shapes
    names += sorted(p.name for role in any_card.roles for p in src.glob(any_card.filename(role)))
    found = [n for n in names if (src / n).is_file()]
    if not found:
        raise SystemExit(f"dora-num record products: {src} holds none of {', '.join(names)}")
    plan = []
    for name in found:
        side = read_provenance(src / name)
        params = side.get("parameters") or {}
        if params.get("smoke"):
            raise SystemExit(f"dora-num record products: {src / name} is a --smoke run; nothing was recorded")
        sha = args.git_sha or params.get("git_sha")  # --git-sha: the commit that ran, where the run's is wrong
        if not sha:
            raise SystemExit(f"dora-num record products: {src / name} names no commit; give --git-sha")
        extra = {"device_git": side.get("git"), "device_argv": side.get("argv")}
        if sha != params.get("git_sha"):
            extra["git_sha_given_on_device"] = params.get("git_sha")
        plan.append((name, sha, dict(params, git_sha=sha), extra))
    written = []
    for name, sha, params, extra in plan:
        written += ingest({name: src / name}, args.out or PRODUCTS.dest(), machine=machine_from_sidecar(src / name),
                          producer=PRODUCTS.producer, git_sha=sha, params=params, extra=extra, sources=[src])
    return written


def record(args) -> int:
    import pandas as pd

    from ...repro.provenance import save_dataframe, write_artifact
    from ...repro.recording import require_cuda
    from .datasets import ACCUMULATION, PRODUCTS, operator_accumulation

    require_cuda("products", torch.cuda.is_available(), "it measures the GPU's own GEMMs and accumulators")
    only = set(args.only or PARTS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = dict(params={"smoke": args.smoke, "git_sha": args.git_sha}, producer="dora-num record products")
    for part, fn in (("tf32", record_tf32), ("bf16_base", record_bf16_base), ("fire_rate", record_fire_rate)):
        if part not in only:
            continue
        name = PRODUCTS.filename(part)
        df = pd.DataFrame(fn(args.smoke))
        save_dataframe(df, out / name, **prov)
        print(f"[record products] {name}\n{df.to_string(index=False)}", flush=True)
    if "accumulation" not in only:
        return 0
    acc, raw = record_accumulation(args.smoke, keep_records=True)
    write_artifact(out / ACCUMULATION.filename("findings"), (json.dumps(acc, indent=1, default=str) + "\n").encode(), **prov)
    from .accumulation import card_name, pack_probe

    name = torch.cuda.get_device_name()
    card = operator_accumulation(card_name(name))
    write_artifact(out / card.filename("probe"), pack_probe(raw, {"name": name, "torch": torch.__version__,
                                                                   "cuda": torch.version.cuda}), **prov)
    bad = [f for f in acc if "bound" in f and not (f["bound"].get("valid") and f["bound"]["factor"] <= 1)]
    print(f"[record products] accumulation: {len(acc)} records, {len(bad)} where the order-free 2u charge is not "
          "confirmed by the blocked model", flush=True)
    return 0
