"""Accuracy of the magnitude gradient ``dg = sum over rows of (s*lora + base) * D``.

``dg`` is DoRA's small-signal gradient: a reduction over the ``T`` tokens of a
step of products whose signs vary, so ``|dg|`` is far smaller than
``sum |inner * D|`` (condition number ``kappa``, about ``sqrt(T)`` for random
signs).  This module measures, for each reduction the package runs, the error
of ``dg`` against the exact value and holds it to the a-priori bound
:func:`dora_num.numerics.bounds.dg_bound`:

The method in full: docs/methods.md, studies/gradient/dg_accuracy.py.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import torch

from ...adapters.corpus import load_corpus
from ...adapters.model import embed, tokenize
from ...adapters.train import TrainConfig, batch_order, build_model, contrastive_loss
from ...numerics import fixed_order, formulas as F
from ...numerics.arithmetic import TorchFP32
from ...numerics.bounds import dg_bound
from ...numerics.formats import get_format, to_float64, two_prod, ulp
from ...ops.config import get_config
from ...ops.reference import compose_backward_ref, compose_inner_ref
from ...oracles import dg_ref64
from ...repro.provenance import read_provenance
from .. import inputs
from .datasets import DG_MINILM

REDUCTIONS = ("eager", "fused", "fp64")
DTYPES = inputs.DG_DTYPES


def _kernel_blocks() -> tuple[int, int]:
    """The fused kernel's own block sizes (``OpConfig.compose_tiles``): the reduction tree
    this module models."""
    tiles = get_config().compose_tiles
    return tiles.bwd_block_m, tiles.fin_chunk


# --------------------------------------------------------------------------
# Exact reference
# --------------------------------------------------------------------------

def dg_exact(s: float, lora, base, grad) -> np.ndarray:
    """Exact ``sum_k (s L_k + b_k) D_k`` per column, correctly rounded to float64.

    Inputs ``[T, N]`` (torch or numpy, any float format).  Raises if a TwoProduct
    could be inexact (a low part in float64's subnormal range).
    """
    s = F.scale_constants(s)[0]
    L, b, D = (to_float64(x) for x in (lora, base, grad))
    sL = s * L
    hi, lo = two_prod(sL, D)
    bD = b * D
    tiny = (hi != 0) & (np.abs(hi) < 2.0**-960)
    if tiny.any() or not np.isfinite(hi).all():
        raise ValueError("dg_exact: a product is outside the range where TwoProduct is exact")
    pieces = np.concatenate([hi, lo, bD], axis=0)
    return np.array([math.fsum(pieces[:, j]) for j in range(pieces.shape[1])], dtype=np.float64)


# --------------------------------------------------------------------------
# The reductions
# --------------------------------------------------------------------------

def _seq_sum(x: np.ndarray) -> np.ndarray:
    """Row-by-row float32 sum over axis 0 (numpy's order for an axis-0 reduction)."""
    acc = np.zeros(x.shape[1:], dtype=np.float32)
    for row in x:
        acc = acc + row
    return acc


def _tree_sum(x: np.ndarray) -> np.ndarray:
    """Pairwise float32 tree over axis 0 (halves folded: a shuffle-like order)."""
    n = x.shape[0]
    while n > 1:
        h = n // 2
        top = x[:h] + x[h:2 * h]
        x = np.concatenate([top, x[2 * h:]], axis=0) if n % 2 else top
        n = x.shape[0]
    return x[0]


def fused_dg_emulated(terms, *, block_m: int | None = None, chunk: int | None = None,
                      order: str = "sequential") -> np.ndarray:
    """The fused kernel's two-stage ``dg`` on fp32 products ``terms [T, N]``, in numpy float32.

    Stage 1: per block of ``block_m`` rows (zero-padded, as the kernel's masked
    loads), ``tl.sum`` over the rows; stage 2: the partials in chunks of ``chunk``
    (zero-padded), each chunk reduced, chunk sums accumulated in sequence from 0.
    ``order`` is the in-block order: ``"sequential"`` (the interpreter's) or
    ``"tree"`` (a pairwise tree, closer to a GPU's shuffles).
    """
    if block_m is None or chunk is None:
        bm, ch = _kernel_blocks()
        block_m = block_m or bm
        chunk = chunk or ch
    red = {"sequential": _seq_sum, "tree": _tree_sum}.get(order)
    if red is None:
        raise ValueError(f"order must be 'sequential' or 'tree', got {order!r}")
    p = np.asarray(_np32(terms), dtype=np.float32)
    T, N = p.shape
    nb = -(-T // block_m)
    pad = np.zeros((nb * block_m, N), dtype=np.float32)
    pad[:T] = p
    blocks = pad.reshape(nb, block_m, N).transpose(1, 0, 2)  # [block_m, nb, N]
    parts = red(blocks)  # [nb, N]
    nc = -(-nb // chunk)
    padp = np.zeros((nc * chunk, N), dtype=np.float32)
    padp[:nb] = parts
    chunks = red(padp.reshape(nc, chunk, N).transpose(1, 0, 2))  # [nc, N]
    return _seq_sum(chunks)


def _np32(x):
    return x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else x


def computed_dg(s: float, lora: torch.Tensor, base: torch.Tensor, grad: torch.Tensor,
                reductions=REDUCTIONS + ("lowp",), fused_order: str = "sequential") -> dict[str, np.ndarray]:
    """``{reduction: dg as float64 [N]}`` from stored ``lora, base, grad [T, N]`` (one dtype)."""
    s = F.scale_constants(s)[0]
    out = {}
    inner = compose_inner_ref(base, lora, s)
    D = grad.float()
    g = torch.ones(grad.shape[-1], dtype=torch.float32)
    for r in reductions:
        if r == "eager":
            out[r] = compose_backward_ref(grad, inner, g, s)[2].double().numpy()
        elif r == "fused":
            terms = F.compose_grad_g_terms(TorchFP32, inner, D)
            out[r] = fused_dg_emulated(terms, order=fused_order).astype(np.float64)
        elif r == "fp64":
            out[r] = dg_ref64(inner, D).numpy()
        elif r == "lowp":
            out[r] = (grad * (base + lora * s)).sum(0).double().numpy()
        else:
            raise ValueError(f"unknown reduction {r!r}")
    return out


# --------------------------------------------------------------------------
# Statistics and one AdamW step
# --------------------------------------------------------------------------

def absorption_fraction(s: float, lora, base, fmt) -> float:
    """Fraction of elements with ``|s*lora| < ulp(base)/2`` in ``fmt`` (the lora term
    would vanish if ``s*lora + base`` were rounded to ``fmt``); ``s*lora == 0`` excluded."""
    s = F.scale_constants(s)[0]
    L, b = to_float64(lora), to_float64(base)
    sL = np.abs(s * L)
    nz = sL > 0
    if not nz.any():
        return float("nan")
    return float(np.mean(sL[nz] < ulp(b[nz], get_format(fmt)) / 2))


def condition_number(s: float, lora, base, grad) -> np.ndarray:
    """``kappa = sum |(sL + b) D| / |sum (sL + b) D|`` per column (float64)."""
    s = F.scale_constants(s)[0]
    L, b, D = (to_float64(x) for x in (lora, base, grad))
    num = np.abs((s * L + b) * D).sum(0)
    ex = np.abs(dg_exact(s, L, b, D))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ex > 0, num / ex, np.inf)


def adamw_first_step(m0: np.ndarray, grad: np.ndarray, *, lr: float = 1e-3, eps: float = 1e-8,
                     weight_decay: float = 0.0) -> np.ndarray:
    """Magnitude after one ``torch.optim.AdamW`` step (fp32 parameter, fp32 gradient).

    First step: ``m_hat = dg``, ``v_hat = dg^2`` so the update is
    ``-lr dg / (|dg| + eps)``: ``-lr sign(dg)`` wherever ``|dg| >> eps``.  An error in
    ``dg`` moves the magnitude only through a sign flip or where ``|dg| ~ eps``.
    """
    p = torch.nn.Parameter(torch.tensor(np.asarray(m0), dtype=torch.float32))
    opt = torch.optim.AdamW([p], lr=lr, eps=eps, weight_decay=weight_decay)
    p.grad = torch.tensor(np.asarray(grad), dtype=torch.float32)
    opt.step()
    return p.detach().double().numpy()


def dg_metrics(s: float, lora, base, grad, fmt: str, *, m0: np.ndarray | None = None, lr: float = 1e-3,
               fused_order: str = "sequential") -> list[dict]:
    """One row per reduction: errors against :func:`dg_exact`, bound ratios, cosine,
    sign flips and the AdamW first-step effect.  ``lora, base, grad`` torch ``[T, N]``."""
    ex = dg_exact(s, lora, base, grad)
    comp = computed_dg(s, lora, base, grad, fused_order=fused_order)
    T, N = grad.shape
    bm, ch = _kernel_blocks()
    kappa = condition_number(s, lora, base, grad)
    absorb = absorption_fraction(s, lora, base, fmt)
    m0 = np.ones(N) if m0 is None else np.asarray(m0, dtype=np.float64)
    m_ref = adamw_first_step(m0, ex, lr=lr)  # the step with the exact dg (rounded to fp32)
    rows = []
    nz = ex != 0
    for r, v in comp.items():
        err = np.abs(v - ex)
        bounded = r in REDUCTIONS
        bnd = dg_bound(s, to_float64(lora), to_float64(base), to_float64(grad), r, block_m=bm, chunk=ch) if bounded \
            else np.full(N, np.inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(nz, err / np.abs(ex), np.nan)
            rel_b = np.where(nz, bnd / np.abs(ex), np.nan)
        m_new = adamw_first_step(m0, v, lr=lr)
        dstep = np.abs(m_new - m_ref)
        # fixed-order float64 (fsum), not BLAS: the same bits on every CPU
        fo = fixed_order
        cos = fo.dot(v, ex) / (fo.norm(v) * fo.norm(ex)) if np.any(ex) else float("nan")
        rows.append({
            "reduction": r, "dtype": fmt, "T": int(T), "N": int(N),
            "rel_err_norm": fo.norm(v - ex) / fo.norm(ex) if np.any(ex) else float("nan"),
            "rel_err_median": float(np.nanmedian(rel)), "rel_err_max": float(np.nanmax(rel)),
            "rel_bound_median": float(np.nanmedian(rel_b)) if bounded else float("nan"),
            "bound_ratio_max": float(np.max(err / bnd)) if bounded else float("nan"),
            "bound_ok": bool(np.all(err <= bnd)) if bounded else None,
            "flip_possible": int(np.sum(bnd >= np.abs(ex))) if bounded else -1,
            "cosine": cos, "kappa_median": float(np.median(kappa[np.isfinite(kappa)])) if np.isfinite(kappa).any()
            else float("inf"),
            "absorption": absorb,
            "sign_flips": int(np.sum(np.sign(v) != np.sign(ex))),
            "adamw_m_ulp_err_max": float(np.max(dstep / ulp(m_ref, "fp32"))),
            "adamw_m_changed": int(np.sum(dstep > 0)),
        })
    return rows


# --------------------------------------------------------------------------
# Synthetic sweep
# --------------------------------------------------------------------------

def synthetic_sweep(Ts=(256, 1024, 4096, 16384, 65536), dtypes=("bf16", "fp16", "fp32"), *, N: int = 32,
                    base_scales=(1.0, 128.0), s: float = 0.5, seed: int = 0, lr: float = 1e-3):
    """Tidy DataFrame: one row per T x dtype x base scale x reduction (:func:`dg_metrics`)."""
    rows = []
    for bs in base_scales:
        for dt in dtypes:
            for i, T in enumerate(Ts):
                lora, base, grad = inputs.dg_operands(T, N, dt, seed=seed + 1000 * i, base_scale=bs, s=s)
                for row in dg_metrics(s, lora, base, grad, dt, lr=lr):
                    rows.append({"source": "synthetic", "base_scale": bs, **row})
    return pd.DataFrame(rows)


def growth_exponents(df, metric: str = "rel_err_norm", by=("dtype", "reduction", "base_scale")):
    """Least-squares slope of ``log(metric)`` against ``log(T)`` per group (the growth exponent)."""
    out = []
    for key, grp in df.groupby(list(by)):
        g = grp[(grp[metric] > 0) & np.isfinite(grp[metric])]
        if g["T"].nunique() < 2:
            continue
        # A log-log fit over only the T where the error happens to be nonzero is
        # biased (fp64 errors are exactly 0 at most T): report no exponent then.
        complete = g["T"].nunique() == grp["T"].nunique() and g["T"].nunique() >= 3
        slope = fixed_order.slope(np.log(g["T"]), np.log(g[metric])) if complete else float("nan")
        out.append({**dict(zip(by, key if isinstance(key, tuple) else (key,))), "metric": metric,
                    "exponent": slope, "n_points": int(len(g)), "n_T": int(grp["T"].nunique())})
    return pd.DataFrame(out)


# --------------------------------------------------------------------------
# Real activations and gradients: the MiniLM training harness
# --------------------------------------------------------------------------

def capture_minilm(*, steps_before: int = 3, batch_size: int = 16, max_len: int = 64, rank: int = 16,
                   lr: float = 1e-3, seed: int = 0, modules: int | None = None, base_path=None) -> dict:
    """Train MiniLM with DoRA (the harness's model, corpus, loss, AdamW) for ``steps_before``
    steps on CPU, then capture, on the next step, every DoRA module's ``(base, lora, D)``
    (float64 ``[T, d_out]``, ``T = batch x tokens x 2`` towers) and ``(s, m)``.

    ``base = x W^T`` and ``lora = (x A^T) B^T`` are recomputed from the captured input ``x`` and
    the module's state at that step; ``D`` is the gradient of the loss with respect to the module
    output (= with respect to ``delta``).  The run is float64 throughout, on the harness's PEFT backend
    (PEFT's DoRA layer evaluates its norm in the weights' dtype; this package's layer keeps g in fp32 by
    its contract): an fp32 rounding inside the loop lets the last bits of the CPU's kernels steer the
    trajectory (fp32 runs on an Intel Xeon and an AMD EPYC under the same pinned kernels differed in
    every row of the table), while a float64 run's captures differ by ~1e-16 relative, which the one
    rounding to each studied dtype (:func:`minilm_table`) hides except for a value that close to a
    rounding boundary.  Such values exist: an Intel Xeon (AVX-512) against the AMD EPYC record moved 25
    values in 20 of the table's 144 rows (counts by one, ``rel_err_norm`` by at most 4.4e-7 of itself), so
    notebook 06 reads the table from its record (:data:`DG_MINILM`) unless asked to recompute it.
    """
    from ...adapters.train import adapter_tensors, peft_dora_modules

    cfg = TrainConfig(rank=rank, lr=lr, steps=steps_before + 1, batch_size=batch_size, max_len=max_len, seed=seed,
                      progress=False, backend="peft")
    model, tok, names = build_model(cfg, base_path)
    model.double()
    names = names[:modules] if modules else names
    layers = peft_dora_modules(model)
    torch.manual_seed(seed)  # dropout masks: the harness's training seeds the same stream
    pairs = [p for p in load_corpus() if p["split"] == "train"]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    caps: dict[str, dict] = {}
    hooks = []

    def fwd_hook(name):
        def h(mod, inp, out):
            caps.setdefault(name, {"x": [], "D": []})["x"].append(inp[0].detach().clone())
        return h

    def bwd_hook(name):
        def h(mod, gin, gout):
            caps[name]["D"].append(gout[0].detach().clone())
        return h

    model.train()
    for step, idx in enumerate(batch_order(len(pairs), batch_size, steps_before + 1, seed), start=1):
        if step == steps_before + 1:
            for n in names:
                mod = layers[n]
                hooks += [mod.register_forward_hook(fwd_hook(n)), mod.register_full_backward_hook(bwd_hook(n))]
        qb = tokenize(tok, [pairs[i]["summary"] for i in idx], max_len)
        db = tokenize(tok, [pairs[i]["signature"] for i in idx], max_len)
        loss = contrastive_loss(embed(model, qb), embed(model, db))
        opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # the hooks read grad_output only; torch warns that grad_input is None for the
            # first layer (its input needs no gradient), which is expected here
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss.backward()
        if step <= steps_before:
            opt.step()
    for h in hooks:
        h.remove()
    out = {}
    state = adapter_tensors(model, cfg.backend, names)
    with torch.no_grad():
        for n in names:
            W, A, B, m, scale = state[n]
            xs = [x.reshape(-1, x.shape[-1]).double() for x in caps[n]["x"]]
            Ds = list(reversed([d.reshape(-1, d.shape[-1]).double() for d in caps[n]["D"]]))  # backward order
            x, D = torch.cat(xs), torch.cat(Ds)
            out[n] = {"base": x @ W.double().T, "lora": (x @ A.double().T) @ B.double().T, "D": D, "s": float(scale),
                      "m": m.detach().double().numpy()}
    return out


def recorded_minilm_table(**settings) -> pd.DataFrame:
    """:func:`minilm_table` as notebook 06 recorded it (:data:`DG_MINILM`, with ``RECOMPUTE_MINILM = True``);
    ``settings``: the notebook's parameters of the capture (``MINILM_STEPS=3, LR=1e-3, ...``), each of which
    must be what the record was made with (its provenance), else a clear error, not another run's table."""
    (path,) = DG_MINILM.require()
    made = read_provenance(path).get("parameters", {})
    differ = {k: (made.get(k), v) for k, v in settings.items() if made.get(k) != v}
    if differ:
        said = ", ".join(f"{k}={a!r} (asked {b!r})" for k, (a, b) in differ.items())
        raise ValueError(f"{path} was recorded with {said}; {DG_MINILM.how_to_record}")
    return pd.read_csv(path)


def minilm_table(captured: dict, dtypes=("bf16", "fp16", "fp32"), *, lr: float = 1e-3):
    """:func:`dg_metrics` per captured module and dtype (activations rounded once to the dtype;
    ``D`` first multiplied by the power of two that puts ``max |D|`` in ``[2^-10, 2^-9)``:
    an exact loss scale, as fp16 training applies, the same for every dtype)."""
    rows = []
    for name, c in captured.items():
        D = c["D"].double()
        amax = float(D.abs().max())
        k = 0 if amax == 0 else -10 - math.floor(math.log2(amax))
        D = D * 2.0**k
        for dt in dtypes:
            t = DTYPES[dt]
            for row in dg_metrics(c["s"], c["lora"].to(t), c["base"].to(t), D.to(t), dt, m0=c["m"], lr=lr):
                rows.append({"source": "minilm", "module": name, "loss_scale_log2": k, **row})
    return pd.DataFrame(rows)
