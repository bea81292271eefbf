r"""The reviewer's kit: measured error against the a-priori bounds, on *your* tensors.

``dn.check_bounds(W, A, B, m, x, scale=s)`` (torch tensors of any float dtype the operators take,
bf16/fp16 included, or numpy arrays) or ``dn.check_bounds(file="layer.safetensors")``, and
from the shell ``dora-num bounds check FILE [--scale S] [--out report.csv]``.

For each formula the measured value comes from the package's public operator, the exact value
from certified ground truth that the operator did not produce, the bound from
:mod:`dora_num.numerics.bounds`:

============================  ===========================================  ==========================================  ====================================
formula                       measured                                     exact (certified)                           bound
============================  ===========================================  ==========================================  ====================================
factored row norm             :func:`dora_num.factored_row_norm`           ``mp_dense_row_norm`` (mpmath, exact sums)  ``factored_norm_bound``
dense row norm                :func:`dora_num.dense_row_norm`              the same                                    ``dense_norm_bound``
magnitude division            :func:`dora_num.magnitude_scale` of the      ``mp_magnitude_scale`` of the same inputs   ``magnitude_scale_bound`` (lemma 6),
                              factored norm                                                                            the norm taken as exact
g end to end                  the same ``g``                               ``m / ||W + sBA||``, exact norm           ``magnitude_scale_bound`` with the
                                                                                                                       factored norm's bound (below)
compose stable / naive        :func:`dora_num.compose_stable` / ``_naive``  ``compose_exact`` (double-double + mpmath)  ``compose_bound(..., "fp32")``
============================  ===========================================  ==========================================  ====================================

The compose runs on ``base = x W^T`` and ``lora = (x A^T) B^T`` formed as
:class:`dora_num.DoRALinear` forms them (``F.linear`` in the activation dtype) and on ``g`` from
the factored norm: the check is of the compose for those inputs (their own rounding is not
the compose's).  Row norms are checked on at most ``max_rows`` rows (all of them when there
are fewer): half with the largest condition number ``kappa`` of the factored assembly, half
drawn at random (seeded); the report says how many.  The compose is checked on every element.

**Division bounds** (:func:`dora_num.numerics.bounds.magnitude_scale_bound`, lemma 6 of
``docs/bounds.md``: ``|g^ - g| <= |g| (u + rel) / (1 - rel) + eta`` for ``g^ = fl32(m / d(w^))``,
``g = m / d(w)``, ``d(w) = w`` for ``w > 0`` and ``eps`` (its fp32 value) for ``w = 0``: eps
guards zero rows only; ``|w^ - w| <= rel w``).  *Magnitude division*: the computed norm fed in,
taken as exact (``rel = 0``).  *End to end*: ``w`` the exact norm and ``w^`` the factored one,
``|w^ - w| <= B`` (``B`` = ``factored_norm_bound``), so ``rel = B / w`` (``inf`` for ``rel >= 1``;
on an exactly zero row 0 where the factored norm is exactly 0 as well, ``w^ = w``).  Rows with
tiny nonzero norms (below ``eps``) are divided by their norm, as DoRA's formula says, and keep
a finite bound wherever the norm's bound is relative.  The float64 references add their own
rounding: ``2^-52 |g|`` for the quotient of the magnitude division, ``4 * 2^-52 |g|`` end to end
(the exact norm and the quotient each rounded to float64 once).

**File format** (safetensors; PEFT-style names accepted where they name one tensor each):
``W`` [d_out, d_in] (or ``weight``, ``base_layer.weight``), ``A`` [r, d_in] (``lora_A...weight``),
``B`` [d_out, r] (``lora_B...weight``), ``m`` [d_out] (``magnitude``, ``lora_magnitude_vector...``),
``x`` [tokens, d_in] activations (``activations``, ``inputs``); the scale as a one-element
tensor ``scale`` or metadata ``{"scale": "..."}``, or ``--scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

MAX_FILE_BYTES = 2 * 2**30
MAX_COMPOSE_ELEMENTS = 1 << 22
# name -> (exact keys, PEFT-style suffixes); a key matches if equal to an exact key or ending in a suffix
KEYS = {
    "W": (("W", "weight"), ("base_layer.weight",)),
    "A": (("A",), ("lora_A.weight", "lora_A.default.weight")),
    "B": (("B",), ("lora_B.weight", "lora_B.default.weight")),
    "m": (("m", "magnitude"), ("lora_magnitude_vector", "lora_magnitude_vector.default.weight",
                               "lora_magnitude_vector.default")),
    "x": (("x", "activations", "inputs"), ()),
}


class BoundsCheckError(ValueError):
    """The inputs of a bounds check are unusable; the message names the problem."""


@dataclass
class BoundsReport:
    """``table``: one row per formula; ``worst``: the worst elements of each (largest err/bound)."""

    table: pd.DataFrame
    worst: pd.DataFrame
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every measured error within its bound."""
        return bool((self.table["violations"] == 0).all())

    def to_string(self) -> str:
        with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.4g}".format):
            parts = [self.table.to_string(index=False), "", "worst elements (largest err/bound):",
                     self.worst.to_string(index=False)]
        return "\n".join(parts + ([""] + self.notes if self.notes else []))

    def __str__(self) -> str:
        return self.to_string()


# --------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------

def _to_torch(name: str, v) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        t = v.detach()
    elif isinstance(v, np.ndarray):
        import ml_dtypes

        if v.dtype == np.dtype(ml_dtypes.bfloat16):
            t = torch.from_numpy(v.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
        elif v.dtype in (np.float16, np.float32, np.float64):
            t = torch.from_numpy(np.ascontiguousarray(v))
        else:
            raise BoundsCheckError(f"{name} has numpy dtype {v.dtype}; expected float16, bfloat16 (ml_dtypes), "
                                   "float32 or float64")
    else:
        raise BoundsCheckError(f"{name} must be a torch tensor or a numpy array, got {type(v).__name__}")
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise BoundsCheckError(f"{name} has dtype {t.dtype}; expected float16, bfloat16, float32 or float64")
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise BoundsCheckError(f"{name} contains {int(torch.isnan(t).sum())} NaN and {int(torch.isinf(t).sum())} "
                               "Inf values; the bounds are stated for finite inputs")
    return t


def _pick(name: str, tensors: dict) -> str:
    exact, suffixes = KEYS[name]
    hits = [k for k in tensors if k in exact] or [k for k in tensors if any(k.endswith(sf) for sf in suffixes)]
    if not hits:
        raise BoundsCheckError(f"no tensor for {name}: expected a key {list(exact)}"
                               + (f" or one ending in {list(suffixes)}" if suffixes else "")
                               + f"; the file holds {sorted(tensors)}")
    if len(hits) > 1:
        raise BoundsCheckError(f"several tensors could be {name}: {sorted(hits)}; keep one layer per file")
    return hits[0]


def load_file(path, *, max_bytes: int = MAX_FILE_BYTES) -> tuple[dict[str, torch.Tensor], float | None]:
    """``({W, A, B, m, x}, scale or None)`` from a safetensors file (see the module docstring)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file as st_load

    path = Path(path)
    if not path.is_file():
        raise BoundsCheckError(f"{path}: no such file")
    size = path.stat().st_size
    if size > max_bytes:
        raise BoundsCheckError(f"{path} is {size / 2**30:.2f} GiB, above the limit of {max_bytes / 2**30:.2f} GiB "
                               "(raise it with max_bytes= / --max-bytes, or save one layer per file)")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = st_load(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise BoundsCheckError(f"{path} is not a readable safetensors file ({e})") from None
    out = {n: tensors[_pick(n, tensors)] for n in KEYS}
    scale = None
    if "scale" in tensors:
        t = tensors["scale"]
        if t.numel() != 1:
            raise BoundsCheckError(f"tensor 'scale' must hold one value, has shape {tuple(t.shape)}")
        scale = float(t.double().item())
    if "scale" in meta:
        try:
            ms = float(meta["scale"])
        except ValueError:
            raise BoundsCheckError(f"metadata scale {meta['scale']!r} is not a number") from None
        if scale is not None and ms != scale:
            raise BoundsCheckError(f"tensor scale {scale} and metadata scale {ms} disagree")
        scale = ms
    return out, scale


# --------------------------------------------------------------------------
# the check
# --------------------------------------------------------------------------

def _rows_to_check(W, A, B, s, max_rows: int, seed: int) -> tuple[np.ndarray, str]:
    from .numerics.bounds import assembly_condition

    d_out = W.shape[0]
    if d_out <= max_rows:
        return np.arange(d_out), f"all {d_out} rows"
    W64, A64, B64 = (t.double().cpu().numpy() for t in (W, A, B))
    kappa = assembly_condition((W64 * W64).sum(1), (B64 * (W64 @ A64.T)).sum(1), ((B64 @ A64) ** 2).sum(1), s)
    top = np.argsort(-kappa, kind="stable")[: max_rows // 2]
    rest = np.setdiff1d(np.arange(d_out), top)
    rnd = np.random.Generator(np.random.PCG64(seed)).choice(rest, max_rows - top.size, replace=False)
    return np.sort(np.concatenate([top, rnd])), (f"{max_rows} of {d_out} rows ({top.size} of largest kappa, "
                                                 f"{max_rows - top.size} random, seed {seed})")


def _row(formula, arith, checked, err, bound, ulp_q, *, where):
    bfin = np.isfinite(bound)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(bfin & (bound > 0), err / bound, np.where(err == 0, 0.0, np.inf))
    i = int(np.argmax(np.where(bfin, ratio, -1.0))) if bfin.any() else 0
    return {"formula": formula, "arithmetic": arith, "checked": checked, "n": int(err.size),
            "max_abs_err": float(err.max()) if err.size else 0.0,
            "max_err_ulps": float((err / ulp_q).max()) if err.size else 0.0,
            "bound_at_worst": float(bound[i]) if err.size else math.nan,
            "tightness": float(ratio[bfin].max()) if bfin.any() else math.nan,
            "violations": int((bfin & (err > bound)).sum()), "no_finite_bound": int((~bfin).sum()),
            "worst_at": where(i) if err.size else ""}, ratio


def _worst(formula, ratio, err, bound, computed, exact, where, top) -> list[dict]:
    order = np.argsort(-np.where(np.isfinite(ratio), ratio, -1.0), kind="stable")[:top]
    return [{"formula": formula, "rank": k + 1, "at": where(i), "computed": float(computed[i]),
             "exact": float(exact[i]), "abs_err": float(err[i]), "bound": float(bound[i]),
             "err_over_bound": float(ratio[i])} for k, i in enumerate(order)]


def check_bounds(W=None, A=None, B=None, m=None, x=None, *, scale: float | None = None, file=None,
                 eps: float | None = None, max_rows: int = 32, top: int = 5, seed: int = 0,
                 max_elements: int = MAX_COMPOSE_ELEMENTS, max_bytes: int = MAX_FILE_BYTES) -> BoundsReport:
    """Measured error vs a-priori bound per formula on the given layer (module docstring).

    Pass the tensors (``x`` may be None: then no compose rows), or ``file=`` a safetensors
    file.  ``scale`` is required unless the file carries it.  Raises :class:`BoundsCheckError`
    (a ``ValueError``) naming the problem for unusable input.
    """
    import dora_num as dn

    from .numerics.bounds import compose_bound, dense_norm_bound, factored_norm_bound, magnitude_scale_bound
    from .numerics.formats import get_format, ulp
    from .numerics.formulas import scale_constants
    from .numerics.ground_truth import compose_exact, mp_dense_row_norm, mp_magnitude_scale
    from .ops.norm import default_eps
    from .ops.validation import check_lora_factors, check_scale

    notes = []
    if file is not None:
        if any(v is not None for v in (W, A, B, m, x)):
            raise BoundsCheckError("pass either file= or the tensors, not both")
        tensors, fscale = load_file(file, max_bytes=max_bytes)
        if scale is not None and fscale is not None and float(scale) != fscale:
            raise BoundsCheckError(f"scale={scale} given but the file says {fscale}")
        scale = fscale if scale is None else scale
        W, A, B, m, x = (tensors[k] for k in "WABmx")
    if scale is None:
        raise BoundsCheckError("scale is required (the LoRA scale s: alpha/r, or alpha/sqrt(r) with rsLoRA)")
    if any(v is None for v in (W, A, B, m)):
        raise BoundsCheckError("W, A, B and m are required")
    W, A, B, m = (_to_torch(n, v) for n, v in (("W", W), ("A", A), ("B", B), ("m", m)))
    try:
        d_out, d_in, r = check_lora_factors(W, A, B)
    except (TypeError, ValueError) as e:
        raise BoundsCheckError(str(e)) from None
    if m.dim() != 1 or m.shape[0] != d_out:
        raise BoundsCheckError(f"m must be [d_out] = [{d_out}], got shape {tuple(m.shape)}")
    try:
        s = scale_constants(check_scale(scale))[0]
    except (TypeError, ValueError) as e:
        raise BoundsCheckError(str(e)) from None
    # ---- row norms (the exact norm is rounded to float64 once: 2^-53 relative, far below every bound)
    wf = dn.factored_row_norm(W, A, B, s)
    wd = dn.dense_row_norm(W, A, B, s)
    rows, how = _rows_to_check(W, A, B, s, max_rows, seed)
    notes.append(f"row norms and g checked on {how}; compose on every element")
    # exact float64 copies (every 16/32-bit value is a float64) for the ground truth and the bounds
    Ws, A64, Bs = W[rows].double().cpu().numpy(), A.double().cpu().numpy(), B[rows].double().cpu().numpy()
    exact_w = mp_dense_row_norm(Ws, A64, Bs, s).value
    tc = W.is_cuda and W.dtype in (torch.bfloat16, torch.float16) and A.dtype == W.dtype
    q32 = ulp(exact_w, "fp32")
    at_row = lambda i: f"row {int(rows[i])}"  # noqa: E731
    table, worst = [], []
    b_fact = factored_norm_bound(Ws, A64, Bs, s, tensor_core_products=tc)
    for name, meas, bound in (("factored row norm", wf, b_fact), ("dense row norm", wd, dense_norm_bound(Ws, A64, Bs, s))):
        c = meas.double().cpu().numpy()[rows]
        err = np.abs(c - exact_w)
        row, ratio = _row(name, "fp32", how, err, bound, q32, where=at_row)
        table.append(row)
        worst += _worst(name, ratio, err, bound, c, exact_w, at_row, top)
    # ---- magnitude division (exact inputs m, wnorm) and g end to end: lemma 6
    eps_v = default_eps(m.dtype) if eps is None else float(eps)
    e32 = float(np.float32(eps_v))  # what the division's clamp uses
    g = dn.magnitude_scale(m, wf, eps=eps_v)
    gc = g.double().cpu().numpy()[rows]
    m_r, wf_r = m.double().cpu().numpy()[rows], wf.double().cpu().numpy()[rows]
    g_div = mp_magnitude_scale(m_r, wf_r, e32).value
    err = np.abs(gc - g_div)
    bound = magnitude_scale_bound(m_r, wf_r, e32, 0.0) + 2.0**-52 * np.abs(g_div)
    row, ratio = _row("magnitude division", "fp32", how, err, bound, ulp(g_div, "fp32"), where=at_row)
    table.append(row)
    worst += _worst("magnitude division", ratio, err, bound, gc, g_div, at_row, top)
    zero = exact_w == 0
    g_true = m_r / np.where(zero, e32, exact_w)  # float64 of the exact quotient (exact_w rounded once too): 4 * 2^-52 |g|
    # rel = B / w for the exact w; on an exactly zero row, 0 where the factored norm is 0 as well (w^ = w)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(zero, np.where(wf_r == 0, 0.0, np.inf), b_fact / np.where(zero, 1.0, exact_w) * (1 + 2.0**-50))
    bound = magnitude_scale_bound(m_r, wf_r, e32, np.where(np.isfinite(rel), rel, 1.0)) + 4 * 2.0**-52 * np.abs(g_true)
    err = np.abs(gc - g_true)
    row, ratio = _row("g end to end", "fp32", how, err, bound, ulp(g_true, "fp32"), where=at_row)
    table.append(row)
    worst += _worst("g end to end", ratio, err, bound, gc, g_true, at_row, top)
    # ---- compose on the activations
    if x is None:
        notes.append("no activations given: compose not checked")
    else:
        x = _to_torch("x", x)
        if x.dim() < 1 or x.shape[-1] != d_in:
            raise BoundsCheckError(f"x must be [..., d_in] = [..., {d_in}], got shape {tuple(x.shape)}")
        if x.dtype == torch.float64:
            raise BoundsCheckError("x is float64; the compose runs in float16, bfloat16 or float32 activations "
                                   "(convert x explicitly)")
        x2 = x.reshape(-1, d_in)
        if x2.shape[0] * d_out > max_elements:
            raise BoundsCheckError(f"compose check of {x2.shape[0]} tokens x {d_out} outputs = "
                                   f"{x2.shape[0] * d_out:,} elements exceeds max_elements={max_elements:,}; "
                                   "pass fewer tokens or raise the limit")
        fmt = get_format(x.dtype)
        with torch.no_grad():
            base = torch.nn.functional.linear(x2, W.to(x.device, x.dtype))
            lora = torch.nn.functional.linear(torch.nn.functional.linear(x2, A.to(x.device, x.dtype)),
                                              B.to(x.device, x.dtype))
        if not (bool(torch.isfinite(base).all()) and bool(torch.isfinite(lora).all())):
            raise BoundsCheckError(f"x W^T or x A^T B^T overflows {x.dtype} for these inputs; no compose to check")
        gg = g.to(x.device)
        b64, l64 = base.double().cpu().numpy(), lora.double().cpu().numpy()
        G = np.broadcast_to(g.double().cpu().numpy(), b64.shape)
        exact = compose_exact(b64, l64, G, s, fmt).value
        q = ulp(exact, fmt)
        at_el = lambda i: f"token {i // d_out}, output {i % d_out}"  # noqa: E731
        for formula, fn in (("compose_stable", dn.compose_stable), ("compose_naive", dn.compose_naive)):
            c = fn(base, lora, gg, s).double().cpu().numpy()
            err = np.abs(c - exact).ravel()
            bound = compose_bound(formula, b64, l64, G, s, fmt, "fp32").ravel()
            row, ratio = _row(formula, f"fp32, {fmt.name} out", f"{x2.shape[0]} tokens x {d_out}", err, bound,
                              q.ravel(), where=at_el)
            table.append(row)
            worst += _worst(formula, ratio, err, bound, c.ravel(), exact.ravel(), at_el, top)
    rep = BoundsReport(pd.DataFrame(table), pd.DataFrame(worst), notes)
    return rep


# --------------------------------------------------------------------------
# CLI: dora-num bounds check FILE
# --------------------------------------------------------------------------

def _cmd_check(args) -> int:
    import sys

    try:
        rep = check_bounds(file=args.file, scale=args.scale, max_rows=args.rows, top=args.top,
                           max_bytes=int(args.max_bytes * 2**30), eps=args.eps)
    except BoundsCheckError as e:
        print(f"dora-num bounds check: {e}", file=sys.stderr)
        return 2
    print(rep.to_string())
    if args.out:
        out = Path(args.out)
        rep.table.to_csv(out, index=False)
        rep.worst.to_csv(out.with_name(out.stem + "_worst" + out.suffix), index=False)
        print(f"\nwrote {out} and {out.with_name(out.stem + '_worst' + out.suffix)}")
    return 0 if rep.ok else 1


def register(sub) -> None:
    """Add ``bounds check FILE`` to the CLI's subparsers."""
    p = sub.add_parser("bounds", help="the reviewer's kit: measured error vs the a-priori bounds")
    bsub = p.add_subparsers(dest="bounds_command", required=True)
    c = bsub.add_parser("check", help="check every bound on the tensors of a .safetensors file "
                                      "(keys W, A, B, m, x; see dora_num.check)")
    c.add_argument("file", help=".safetensors file with W, A, B, m and activations x")
    c.add_argument("--scale", type=float, help="the LoRA scale s (if the file does not carry it)")
    c.add_argument("--out", help="write the table to FILE.csv (and the worst elements to FILE_worst.csv)")
    c.add_argument("--rows", type=int, default=32, help="row norms: rows checked at most (default 32)")
    c.add_argument("--top", type=int, default=5, help="worst elements listed per formula (default 5)")
    c.add_argument("--eps", type=float, help="eps of the magnitude division (default by the dtype of m)")
    c.add_argument("--max-bytes", type=float, default=MAX_FILE_BYTES / 2**30, help="file size limit in GiB")
    c.set_defaults(func=_cmd_check)


__all__ = ["BoundsCheckError", "BoundsReport", "check_bounds", "load_file"]
