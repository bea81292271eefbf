r"""The reviewer's kit: every formula's measured error against the lemma that bounds it, on *your* tensors.

``dn.check_bounds(W, A, B, m, x, scale=s)`` (torch tensors of any float dtype, or numpy arrays),
``dn.check_bounds(file="layer.safetensors")``, ``dn.check_bounds(file=ADAPTER_DIR, base=MODEL_DIR)``
(a PEFT DoRA adapter folder, or its ``adapter_model.safetensors``; every module, or ``module=``), and
from the shell ``dora-num bounds check PATH [--base MODEL] [--module NAME] [--format text|markdown|csv]``.
Exit status 0 (every value within its bound), 1 (a bound violated), 2 (unusable input, named).

Each row of the report is one check: the measured value of the package's public operator, the exact
value (certified ground truth the operator did not produce, rounded once to float64), the bound of the
named lemma of docs/bounds.md under the product model the operator used, and ``err/bound``, all of one
element (the worst of the check).  Checks: the bare factored norm (lemma 4), the guarded factored norm
(lemma 4' where the guard certified the row, 5' where it recomputed it), the dense norm (lemma 5), the
magnitude division with the computed norm taken as exact (lemma 6) and ``g`` end to end (lemma 6 with
the guarded norm's own guarantee), the stable and naive compose on ``x`` (lemmas 1 and 2).  Elements
without a finite bound are listed with the reason.  Rules (printed in every report): a value violates
its bound if ``|computed - exact| > bound (1 + 2^-50) + c 2^-52 |exact|`` (the float64 rounding of the
reference, ``c = 1``, or 4 end to end); float64 W, A, B, m are rounded to fp32 once (what the operators
compute with), the exact values are of the inputs as given, and every bound is charged that rounding
(``||dx||`` per row from the two copies; lemma 6's ``|fl32(m) - m|``); float64 ``x`` is refused.
Row norms are checked on ``max_rows`` rows per module (half the largest ``kappa``, half random, seeded).
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
COLUMNS = ["module", "check", "lemma", "model", "n", "violations", "no_bound", "worst_at", "computed", "exact",
           "abs_err", "bound", "err_over_bound"]


class BoundsCheckError(ValueError):
    """The inputs of a bounds check are unusable; the message names the problem."""


def _fmt(v, digits: int | None) -> str:
    if isinstance(v, (float, np.floating)):
        return repr(float(v)) if digits is None else f"{float(v):.{digits}g}"
    return str(v)


def _md_table(df: pd.DataFrame, digits) -> str:
    cells = [[_fmt(v, digits).replace("|", "\\|") for v in row] for row in df.itertuples(index=False)]
    head = "| " + " | ".join(df.columns) + " |"
    return "\n".join([head, "|" + "---|" * len(df.columns)] + ["| " + " | ".join(c) + " |" for c in cells])


@dataclass
class BoundsReport:
    """``table``: one row per check (every column of one element, the worst); ``worst``: the worst
    elements of each check; ``no_bound``: elements without a finite bound and why; ``header``: the
    scale constants, eps, arithmetic, product models and rules; ``verdict``: one line."""

    table: pd.DataFrame
    worst: pd.DataFrame
    no_bound: pd.DataFrame
    header: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every measured error within its bound."""
        return bool((self.table["violations"] == 0).all())

    @property
    def verdict(self) -> str:
        n = int(self.table["n"].sum())
        nb = int(self.table["no_bound"].sum())
        if self.ok:
            return (f"VERDICT: PASS - all {n:,} checked values within their bounds"
                    + (f" ({nb} without a finite bound, listed with the reason)" if nb else ""))
        bad = self.table[self.table["violations"] > 0]
        first = bad.iloc[0]
        return (f"VERDICT: FAIL - {int(bad['violations'].sum())} of {n:,} values outside their bounds "
                f"({len(bad)} check(s)); first: {first['check']} (lemma {first['lemma']}) at {first['worst_at']}"
                + (f" of {first['module']}" if first["module"] else ""))

    def _shown(self, df: pd.DataFrame) -> pd.DataFrame:
        """``df`` without the module column where there is one unnamed layer."""
        return df.drop(columns="module") if len(df) and "module" in df and not df["module"].any() else df

    def to_string(self, digits: int | None = 4) -> str:
        """Plain text; ``digits=None``: every value at full precision (shortest round-trip repr)."""
        with pd.option_context("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 80,
                               "display.max_rows", 1000):
            fmt = {c: (lambda v: _fmt(v, digits)) for c in ("computed", "exact", "abs_err", "bound", "err_over_bound")}
            parts = self.header + ["", self._shown(self.table).to_string(index=False, formatters=fmt), ""]
            if len(self.no_bound):
                parts += ["elements without a finite bound:", self._shown(self.no_bound).to_string(index=False), ""]
            parts += ["worst elements (largest err/bound) of each check:",
                      self._shown(self.worst).to_string(index=False, formatters=fmt), ""] + self.notes + ["", self.verdict]
        return "\n".join(parts)

    def to_markdown(self, digits: int | None = 4) -> str:
        """A report to paste into a review: the rules as a list, the tables in GitHub Markdown."""
        parts = [f"**{self.verdict}**", ""] + [f"- {h}" for h in self.header]
        parts += ["", _md_table(self._shown(self.table), digits)]
        if len(self.no_bound):
            parts += ["", "Elements without a finite bound:", "", _md_table(self._shown(self.no_bound), digits)]
        parts += ["", "Worst elements of each check:", "", _md_table(self._shown(self.worst), digits)]
        return "\n".join(parts + ([""] + [f"- {n}" for n in self.notes] if self.notes else []))

    def to_csv(self, path) -> list[Path]:
        """``path`` (the table), ``*_worst`` and ``*_no_bound`` beside it, full precision; returns the paths."""
        path = Path(path)
        out = [path, path.with_name(path.stem + "_worst" + path.suffix),
               path.with_name(path.stem + "_no_bound" + path.suffix)]
        for df, p in zip((self.table, self.worst, self.no_bound), out):
            df.to_csv(p, index=False, float_format="%.17g", lineterminator="\n")
        return out

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
        raise BoundsCheckError(f"several tensors could be {name}: {sorted(hits)}; keep one layer per file, or pass "
                               "a PEFT adapter's folder (its adapter_config.json names the modules)")
    return hits[0]


def load_file(path, *, max_bytes: int = MAX_FILE_BYTES) -> tuple[dict[str, torch.Tensor], float | None]:
    """``({W, A, B, m, x}, scale or None)`` from a one-layer safetensors file (the module docstring)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file as st_load

    path = Path(path)
    if not path.is_file():
        raise BoundsCheckError(f"{path}: no such file")
    size = path.stat().st_size
    if size > max_bytes:
        raise BoundsCheckError(f"{path} is {size / 2**30:.2f} GiB, above the limit of {max_bytes / 2**30:.2f} GiB "
                               "(raise it with max_bytes= / --max-bytes, or save one layer per file)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = st_load(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise BoundsCheckError(f"{path} is not a readable safetensors file ({e})") from None
    out = {n: tensors[_pick(n, tensors)] for n in "WABm"}
    out["x"] = tensors[_pick("x", tensors)] if any(k in KEYS["x"][0] for k in tensors) else None
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


def _adapter_dir(path: Path) -> Path | None:
    """The PEFT adapter folder ``path`` names (the folder, or the folder of its weights file), or None."""
    from .adapters.peft_io import CONFIG_NAME

    if path.is_dir():
        return path
    if path.is_file() and (path.parent / CONFIG_NAME).is_file() and path.name.startswith("adapter_model"):
        return path.parent
    return None


def load_adapter(adapter_dir, base=None, modules=None) -> list:
    """The DoRA module states (``dora_num.adapters.peft_io.DoRAModuleState``) of a PEFT adapter on its base
    model: ``base`` a model folder or weights file, or (default) the config's ``base_model_name_or_path``
    where that is a folder or the packaged all-MiniLM-L6-v2; ``modules``: names (or name suffixes) to keep."""
    from .adapters.peft_io import AdapterError, load_peft_dora, read_config

    try:
        cfg = read_config(adapter_dir)
        if base is None:
            named = str(cfg.get("base_model_name_or_path") or "")
            if named and Path(named).is_dir():
                base = named
            elif named.endswith("all-MiniLM-L6-v2"):
                from .adapters.model import minilm_path

                base = minilm_path()
            else:
                raise BoundsCheckError(f"the base model of {adapter_dir} is {named!r}, not a folder on disk: pass "
                                       "--base MODEL_DIR (the base weights W are part of every row norm)")
        states = load_peft_dora(adapter_dir, base)
    except AdapterError as e:
        raise BoundsCheckError(str(e)) from None
    if modules:
        keep = [st for st in states if any(st.name == n or st.name.endswith("." + n) for n in modules)]
        if not keep:
            raise BoundsCheckError(f"no module of {adapter_dir} matches {list(modules)}; it has "
                                   f"{[st.name for st in states][:6]}{' ...' if len(states) > 6 else ''}")
        states = keep
    return states


# --------------------------------------------------------------------------
# the checks of one layer
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


class _Acc:
    """Collects the rows of the three tables."""

    def __init__(self, module: str, top: int):
        self.module, self.top = module, top
        self.table, self.worst, self.no_bound = [], [], []

    def add(self, check, lemma, model, computed, exact, bound, at, reason, slack=1.0):
        computed, exact, bound = (np.asarray(v, dtype=np.float64).ravel() for v in (computed, exact, bound))
        lemma = np.broadcast_to(np.asarray(lemma, dtype=object), computed.shape)
        err = np.abs(computed - exact)
        fin = np.isfinite(bound)
        tol = np.where(fin, bound * (1 + 2.0**-50), np.inf) + slack * 2.0**-52 * np.abs(exact)
        viol = fin & (err > tol)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(fin & (bound > 0), err / np.where(bound > 0, bound, 1.0), np.where(err == 0, 0.0, np.inf))
        ratio = np.where(fin, ratio, np.nan)
        key = np.where(fin, ratio, -1.0)
        i = int(np.argmax(key)) if err.size else 0
        labels = sorted(set(lemma.tolist())) if err.size else []
        self.table.append({"module": self.module, "check": check, "lemma": ", ".join(labels), "model": model,
                           "n": int(err.size), "violations": int(viol.sum()), "no_bound": int((~fin).sum()),
                           "worst_at": at(i) if err.size else "", "computed": float(computed[i]) if err.size else math.nan,
                           "exact": float(exact[i]) if err.size else math.nan,
                           "abs_err": float(err[i]) if err.size else math.nan,
                           "bound": float(bound[i]) if err.size else math.nan,
                           "err_over_bound": float(ratio[i]) if err.size else math.nan})
        for k, j in enumerate(np.argsort(-key, kind="stable")[: self.top]):
            if fin[j]:
                self.worst.append({"module": self.module, "check": check, "rank": k + 1, "at": at(int(j)),
                                   "lemma": lemma[j], "computed": float(computed[j]), "exact": float(exact[j]),
                                   "abs_err": float(err[j]), "bound": float(bound[j]), "err_over_bound": float(ratio[j])})
        for j in np.flatnonzero(~fin):
            self.no_bound.append({"module": self.module, "check": check, "at": at(int(j)),
                                  "reason": reason(int(j)) if callable(reason) else reason})


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype == torch.float64 else t


def _input_rounding(W64, A64, B64, W, A, B, s) -> np.ndarray:
    """Per row a bound on ``| ||W + s B A|| - ||W' + s B' A'|| |`` for the given float64 inputs and their
    fp32 roundings (primed): ``|| |W' - W| + |s| (|B'| |A' - A| + |B' - B| |A|) ||``, evaluated in float64
    from the two copies (relative error below (r + 4) 2^-53: raised by 1 + 2^-40).  0 for fp32 inputs."""
    Wr, Ar, Br = (t.double().cpu().numpy() for t in (W, A, B))
    if np.array_equal(Wr, W64) and np.array_equal(Ar, A64) and np.array_equal(Br, B64):
        return np.zeros(W64.shape[0])
    dx = np.abs(Wr - W64) + abs(s) * (np.abs(Br) @ np.abs(Ar - A64) + np.abs(Br - B64) @ np.abs(A64))
    return np.sqrt((dx * dx).sum(1)) * (1 + 2.0**-40)


def _check_layer(acc: _Acc, W, A, B, m, x, s: float, eps_v: float, max_rows: int, seed: int,
                 max_elements: int) -> list[str]:
    """Every check of one layer into ``acc``; returns the layer's header lines."""
    import dora_num as dn

    from .numerics.bounds import compose_bound, dense_norm_bound, factored_norm_bound, magnitude_scale_bound
    from .numerics.formats import get_format
    from .numerics.ground_truth import compose_exact, mp_dense_row_norm, mp_magnitude_scale
    from .ops.config import override
    from .ops.guard import guard_rows
    from .ops.products import fp32_matmul_precision, product_model

    lines = []
    W64, A64, B64 = (t.double().cpu().numpy() for t in (W, A, B))
    Wc, Ac, Bc, mc = _fp32(W), _fp32(A), _fp32(B), _fp32(m)
    if any(t.dtype == torch.float64 for t in (W, A, B, m)):
        lines.append("float64 inputs: rounded to fp32 once (what the operators compute with); exact values are of the "
                     "inputs as given; each bound charges the rounding (||dx|| per row, |fl32(m) - m| in lemma 6)")
    rows, how = _rows_to_check(Wc, Ac, Bc, s, max_rows, seed)
    at_row = lambda i: f"row {int(rows[i])}"  # noqa: E731
    model = product_model(Wc, Ac)
    gemm = fp32_matmul_precision(Wc.device.type)
    lines.append(f"rows: {how}; factored norm products: {model.label}; fp32 GEMMs on {Wc.device.type}: {gemm}")
    Ws, Bs = W64[rows], B64[rows]
    exact_w = mp_dense_row_norm(Ws, A64, Bs, s).value
    dx = _input_rounding(Ws, A64, Bs, Wc[rows], Ac, Bc[rows], s)
    # ---- the factored norm, bare (lemma 4) and guarded (4' / 5'), both from the torch tail (the CPU's; on CUDA
    # the Triton tail sums cross and ba in another order, within the same lemmas): guard_rows re-derives the
    # guard's decision row by row, and must reproduce the operator's returned norm bit for bit
    with override(norm_tail="torch"):
        gr = guard_rows(Wc, Ac, Bc, s)
        try:
            guarded_t = dn.factored_row_norm(Wc, Ac, Bc, s)
        except ValueError:  # a row norm beyond fp32: that row has no finite bound below
            guarded_t = gr.guarded
    if not torch.equal(gr.guarded, guarded_t):
        raise RuntimeError("the kit's re-derivation of the guard does not reproduce the operator (a bug: please report)")
    bare = gr.bare.double().cpu().numpy()[rows]
    fmt_b = "fp16" if Wc.dtype == torch.float16 else "bf16"
    b4 = factored_norm_bound(Ws, A64, Bs, s, products=model.u, split_pieces=model.pieces, split_format=fmt_b) + dx
    acc.add("factored row norm, bare", "4", model.label, bare, exact_w, b4, at_row,
            "an fp32 intermediate (U, G, B G, a term or a partial sum of the assembly) may overflow")
    rec = gr.recomputed.cpu().numpy()[rows]
    rel_out = gr.rel_out.double().cpu().numpy()[rows]
    with np.errstate(invalid="ignore"):
        b45 = np.where(np.isfinite(rel_out), rel_out * (exact_w + dx) + dx, np.inf)
    acc.add("factored row norm, guarded", np.where(rec, "5'", "4'"), f"{model.label}; guard on the torch tail",
            gr.guarded.double().cpu().numpy()[rows], exact_w, b45, at_row,
            lambda i: ("lemma 5': the float64 recompute's bound exceeds the norm (a norm of a few subnormal steps, "
                       "or W + sBA cancelling to float64 roundoff)"))
    if bool(gr.recomputed.any()):
        lines.append(f"guard: {int(gr.recomputed.sum())} of {W.shape[0]} rows recomputed in float64 (lemma 5'), "
                     "the others certified by lemma 4' from their fp32 terms")
    dense = np.empty(rows.size)
    try:
        dense[:] = dn.dense_row_norm(Wc[rows], Ac, Bc[rows], s).double().cpu().numpy()
    except ValueError:  # some row overflows fp32: row by row, inf where it does (no finite bound there)
        for k, j in enumerate(rows):
            try:
                dense[k] = float(dn.dense_row_norm(Wc[j:j + 1], Ac, Bc[j:j + 1], s)[0])
            except ValueError:
                dense[k] = math.inf
    acc.add("dense row norm", "5", f"B @ A: fp32 GEMM ({gemm})", dense, exact_w,
            dense_norm_bound(Ws, A64, Bs, s, matmul=gemm) + dx, at_row,
            "an element of W + sBA or the sum of squares may overflow fp32")
    # ---- lemma 6: the division with the computed norm taken as exact, and g end to end
    e32 = float(np.float32(eps_v))
    wg = guarded_t.to(W.device)
    g = dn.magnitude_scale(mc, wg, eps=eps_v, check=False)  # a g beyond fp32: no finite bound there
    gc = g.double().cpu().numpy()[rows]
    m_r, wg_r = m.double().cpu().numpy()[rows], wg.double().cpu().numpy()[rows]
    g_div = mp_magnitude_scale(m_r, wg_r, e32).value
    acc.add("magnitude division", "6", "fp32 division (correctly rounded), the norm taken as exact", gc, g_div,
            magnitude_scale_bound(m_r, wg_r, e32, 0.0), at_row, "g = m / d(w^) may overflow fp32")
    zero = exact_w == 0
    g_true = m_r / np.where(zero, e32, exact_w)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(zero, np.where(wg_r == 0, 0.0, np.inf), b45 / np.where(zero, 1.0, exact_w) * (1 + 2.0**-50))
    b6 = magnitude_scale_bound(m_r, wg_r, e32, np.where(np.isfinite(rel), rel, 1.0))
    acc.add("g end to end", np.where(rec, "6 with 5'", "6 with 4'"), "fp32 division of the guarded norm", gc, g_true,
            b6, at_row, lambda i: ("the norm's guarantee is not below 1 (rel >= 1)" if not rel[i] < 1
                                   else "g may overflow fp32"), slack=4.0)
    if x is None:
        return lines + ["compose: not checked (no activations x given)"]
    if x.dtype == torch.float64:
        raise BoundsCheckError("x is float64; the compose runs in float16, bfloat16 or float32 activations "
                               "(convert x explicitly)")
    d_out, d_in = W.shape
    if x.dim() < 1 or x.shape[-1] != d_in:
        raise BoundsCheckError(f"x must be [..., d_in] = [..., {d_in}], got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, d_in)
    if x2.shape[0] * d_out > max_elements:
        raise BoundsCheckError(f"compose check of {x2.shape[0]} tokens x {d_out} outputs = {x2.shape[0] * d_out:,} "
                               f"elements exceeds max_elements={max_elements:,}; pass fewer tokens or raise the limit")
    fmt = get_format(x.dtype)
    with torch.no_grad():
        base = torch.nn.functional.linear(x2, Wc.to(x.device, x.dtype))
        lora = torch.nn.functional.linear(torch.nn.functional.linear(x2, Ac.to(x.device, x.dtype)),
                                          Bc.to(x.device, x.dtype))
    if not (bool(torch.isfinite(base).all()) and bool(torch.isfinite(lora).all())):
        raise BoundsCheckError(f"x W^T or x A^T B^T overflows {x.dtype} for these inputs; no compose to check")
    b64, l64 = base.double().cpu().numpy(), lora.double().cpu().numpy()
    G = np.broadcast_to(g.double().cpu().numpy(), b64.shape)
    exact = compose_exact(b64, l64, G, s, fmt).value
    at_el = lambda i: f"token {i // d_out}, output {i % d_out}"  # noqa: E731
    for formula, fn, lemma in (("compose_stable", dn.compose_stable, "1"), ("compose_naive", dn.compose_naive, "2")):
        c = fn(base, lora, g.to(x.device), s).double().cpu().numpy()
        acc.add(formula, lemma, f"fp32 intermediates, no FMA, one rounding to {fmt.name}", c, exact,
                compose_bound(formula, b64, l64, G, s, fmt, "fp32"), at_el,
                "an intermediate or the output may overflow the format")
    return lines + [f"compose: on {x2.shape[0]} tokens x {d_out} outputs (base = x W^T and lora = x A^T B^T formed as "
                    f"DoRALinear forms them, in {fmt.name}; the check is of the compose for those inputs)"]


def check_bounds(W=None, A=None, B=None, m=None, x=None, *, scale: float | None = None, file=None, base=None,
                 module=None, eps: float | None = None, max_rows: int = 32, top: int = 5, seed: int = 0,
                 max_elements: int = MAX_COMPOSE_ELEMENTS, max_bytes: int = MAX_FILE_BYTES) -> BoundsReport:
    """Measured error vs the lemma's bound for every formula (module docstring).

    Pass the tensors (``x`` may be None: then no compose rows), or ``file=``: a one-layer safetensors
    file, or a PEFT DoRA adapter folder / its ``adapter_model.safetensors`` (``base``: the base model;
    ``module``: a name or list of names, default every module).  ``scale`` is required unless the file
    carries it (an adapter's config does).  Raises :class:`BoundsCheckError` (a ``ValueError``) naming
    the problem for unusable input."""
    from .numerics.formulas import scale_constants
    from .ops.magnitude import default_eps
    from .ops.validation import check_lora_factors, check_scale

    layers = []  # (module name, tensors, scale, source)
    if file is not None:
        if any(v is not None for v in (W, A, B, m, x)):
            raise BoundsCheckError("pass either file= or the tensors, not both")
        adir = _adapter_dir(Path(file))
        if adir is not None:
            if scale is not None:
                raise BoundsCheckError("scale= is given by the adapter's config (alpha / r, or alpha / sqrt(r)); "
                                       "do not pass it")
            names = [module] if isinstance(module, str) else module
            for st in load_adapter(adir, base, names):
                layers.append((st.name, dict(W=st.W, A=st.A, B=st.B, m=st.m, x=None), st.scale, f"PEFT adapter {adir}"))
        else:
            tensors, fscale = load_file(file, max_bytes=max_bytes)
            if scale is not None and fscale is not None and float(scale) != fscale:
                raise BoundsCheckError(f"scale={scale} given but the file says {fscale}")
            layers.append(("", tensors, fscale if scale is None else scale, f"file {file}"))
    else:
        layers.append(("", dict(W=W, A=A, B=B, m=m, x=x), scale, "tensors"))
    lines: dict[str, list[str]] = {}  # header line -> the modules it describes
    tables, worst, nob = [], [], []
    for name, t, sc, source in layers:
        if sc is None:
            raise BoundsCheckError("scale is required (the LoRA scale s: alpha/r, or alpha/sqrt(r) with rsLoRA)")
        if any(t[k] is None for k in "WABm"):
            raise BoundsCheckError("W, A, B and m are required")
        Wt, At, Bt, mt = (_to_torch(k, t[k]) for k in "WABm")
        xt = None if t["x"] is None else _to_torch("x", t["x"])
        try:
            d_out, d_in, r = check_lora_factors(Wt, At, Bt)
            s_raw = check_scale(sc)
        except (TypeError, ValueError) as e:
            raise BoundsCheckError(str(e)) from None
        if mt.dim() != 1 or mt.shape[0] != d_out:
            raise BoundsCheckError(f"m must be [d_out] = [{d_out}], got shape {tuple(mt.shape)}")
        s, two_s, s_sq = scale_constants(s_raw)
        eps_v = default_eps(mt.dtype) if eps is None else float(eps)
        dt = lambda v: str(v.dtype).removeprefix("torch.")  # noqa: E731
        mine = [f"source: {source}",
                f"inputs: W [d_out, d_in] {dt(Wt)}, A {dt(At)}, B {dt(Bt)}, m {dt(mt)}"
                + (f", x {list(xt.shape)} {dt(xt)}" if xt is not None else "") + f"; r = {r}",
                f"scale {s_raw!r}: s = fl32(scale) = {s!r}, 2s = {two_s!r}, s^2 = fl32(s*s) = {s_sq!r} "
                f"(exact s*s = {s * s!r}); eps = {float(np.float32(eps_v))!r} (zero rows only)",
                "arithmetic: fp32 intermediates, no FMA contraction, correctly rounded sqrt and division; "
                "exact values: certified ground truth rounded once to float64; a value violates its bound if "
                "|computed - exact| > bound (1 + 2^-50) + c 2^-52 |exact| (c = 1, 4 for g end to end)"]
        acc = _Acc(name, top)
        mine += _check_layer(acc, Wt, At, Bt, mt, xt, s_raw, eps_v, max_rows, seed, max_elements)
        for line in mine:
            lines.setdefault(line, []).append(name or f"[{d_out}, {d_in}]")
        tables += acc.table
        worst += acc.worst
        nob += acc.no_bound
    many = len(layers) > 1
    header = [line + (f"  [{len(mods)} of {len(layers)} modules]" if many and len(mods) < len(layers) else "")
              for line, mods in lines.items()]
    if many:
        header.append(f"modules: {len(layers)} (every row of the tables names its module)")
    notes: list[str] = []
    return BoundsReport(pd.DataFrame(tables, columns=COLUMNS), pd.DataFrame(worst),
                        pd.DataFrame(nob, columns=["module", "check", "at", "reason"]), header, notes)


# --------------------------------------------------------------------------
# CLI: dora-num bounds check PATH
# --------------------------------------------------------------------------

def _cmd_check(args) -> int:
    import sys

    try:
        rep = check_bounds(file=args.path, scale=args.scale, base=args.base, module=args.module or None,
                           max_rows=args.rows, top=args.top, max_bytes=int(args.max_bytes * 2**30), eps=args.eps)
    except (BoundsCheckError, OSError) as e:
        print(f"dora-num bounds check: {e}", file=sys.stderr)
        return 2
    digits = None if args.full_precision else 4
    text = {"text": lambda: rep.to_string(digits), "markdown": lambda: rep.to_markdown(digits),
            "csv": lambda: rep.table.to_csv(index=False, float_format="%.17g", lineterminator="\n")}[args.format]()
    print(text)
    if args.out:
        paths = rep.to_csv(args.out)
        print(f"\nwrote {', '.join(map(str, paths))}")
    return 0 if rep.ok else 1


def register(sub) -> None:
    """Add ``bounds check PATH`` to the CLI's subparsers."""
    p = sub.add_parser("bounds", help="the reviewer's kit: measured error vs the a-priori bounds")
    bsub = p.add_subparsers(dest="bounds_command", required=True)
    c = bsub.add_parser("check", help="check every bound on a layer file or a PEFT DoRA adapter (see dora_num.check); "
                                      "exit 0: all within, 1: a bound violated, 2: unusable input")
    c.add_argument("path", help="a .safetensors file with W, A, B, m (and activations x), or a PEFT DoRA adapter "
                                "folder (or its adapter_model.safetensors)")
    c.add_argument("--base", help="PEFT adapters: the base model folder or weights file (default: the config's "
                                  "base_model_name_or_path where that is a folder)")
    c.add_argument("--module", action="append", help="PEFT adapters: a module name (or name suffix) to check; "
                                                     "repeat for several (default: every module)")
    c.add_argument("--scale", type=float, help="the LoRA scale s (layer files that do not carry it)")
    c.add_argument("--format", choices=("text", "markdown", "csv"), default="text", help="report format (default text)")
    c.add_argument("--full-precision", action="store_true", help="print every value at full precision")
    c.add_argument("--out", help="also write the table to FILE.csv (with FILE_worst.csv, FILE_no_bound.csv)")
    c.add_argument("--rows", type=int, default=32, help="row norms: rows checked per module at most (default 32)")
    c.add_argument("--top", type=int, default=5, help="worst elements listed per check (default 5)")
    c.add_argument("--eps", type=float, help="eps of the magnitude division (default by the dtype of m)")
    c.add_argument("--max-bytes", type=float, default=MAX_FILE_BYTES / 2**30, help="layer file size limit in GiB")
    c.set_defaults(func=_cmd_check)


__all__ = ["BoundsCheckError", "BoundsReport", "check_bounds", "load_adapter", "load_file"]
