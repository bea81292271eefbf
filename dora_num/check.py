r"""The reviewer's kit: every formula's measured error against the lemma that bounds it, on *your* tensors.

``dn.check_bounds(W, A, B, m, x, scale=s)`` (torch tensors of any float dtype, or numpy arrays),
``dn.check_bounds(file="layer.safetensors")``, ``dn.check_bounds(file=ADAPTER_DIR, base=MODEL_DIR)``
(a PEFT DoRA adapter; every module, or ``module=``), and from the shell ``dora-num bounds check PATH
[--base DIR] [--module NAME] [--device cuda] [--format text|markdown|csv] [--out FILE.csv]``.
Exit status: 0 PASS, 1 a bound violated, 2 unusable input (one line), 3 INCOMPLETE (a check with no
element within a finite bound: nothing checked, or every element unbounded), 4 internal error.

Each row of the report is one check: the measured value of the public operator, the exact value
(certified ground truth rounded once to float64), the bound of the named lemma of docs/bounds.md
under the product model the operator used, and ``err/bound`` of one element (the worst).  Checks:
the bare factored norm (lemma 4), the guarded factored norm (4' or 5'), on CUDA the norm as the
layer's tail runs it, the dense norm (lemma 5), the magnitude division (lemma 6, on every row) and
``g`` end to end, the stable and naive compose on ``x`` (lemmas 1 and 2) in the arithmetic
``DoRALinear`` runs for these dtypes.  Where the norm's products run on tensor cores (16-bit W on CUDA),
lemma 4's charge of ``2u`` per addition is an assumption about the card: the kit applies it only to the
GEMMs a committed probe of this card covers or a probe run now on the layer's shapes confirms
(:mod:`dora_num.check_accumulation`; the header names the evidence), and elsewhere lists the rows resting
on it (lemmas 4 and 4') without a finite bound.  A value violates its bound if it is not finite (or NaN)
against a finite bound, or ``|computed - exact| > bound (1 + 2^-50) + c 2^-52 |exact|``; each check
counts its elements within, without a finite bound (listed with the reason: overflow listed, never
fatal) and not checked.  Row norms: every row where that takes seconds, else a sample keeping zero
rows and the extremes of the norm, kappa and |g - 1|.  float64 W, A, B, m are rounded to fp32 once
and every bound is charged that rounding; float64 ``x`` is refused.  Flush-to-zero is refused by name.
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
FP32_OVERFLOW = (2 - 2.0**-24) * 2.0**127  # fp32 rounds to inf from here up
# name -> (exact keys, PEFT-style suffixes); a key matches if equal to an exact key or ending in a suffix
KEYS = {
    "W": (("W", "weight"), ("base_layer.weight",)),
    "A": (("A",), ("lora_A.weight", "lora_A.default.weight")),
    "B": (("B",), ("lora_B.weight", "lora_B.default.weight")),
    "m": (("m", "magnitude"), ("lora_magnitude_vector", "lora_magnitude_vector.default.weight",
                               "lora_magnitude_vector.default")),
    "x": (("x", "activations", "inputs"), ()),
}
COLUMNS = ["module", "check", "lemma", "model", "r", "scale", "n", "within", "violations", "no_bound", "not_checked",
           "worst_at", "computed", "exact", "abs_err", "bound", "err_over_bound"]


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


# exit status of ``dora-num bounds check`` (BoundsReport.exit_code, docs/bounds.md "The reviewer's kit")
EXIT_PASS, EXIT_FAIL, EXIT_UNUSABLE, EXIT_INCOMPLETE, EXIT_INTERNAL = 0, 1, 2, 3, 4
_FLOATS = ("computed", "exact", "abs_err", "bound", "err_over_bound")


def provenance() -> str:
    """``dora_num`` version and commit, torch version: the first line of every report."""
    from . import __version__
    from .repro.provenance import git_state

    g = git_state()
    sha = g["sha"] or "no git checkout"
    return (f"dora_num {__version__} (commit {sha}{', modified' if g['dirty'] else ''}), torch {torch.__version__}")


@dataclass
class BoundsReport:
    """``table``: one row per check (every column of one element, the worst); ``worst``: the worst
    elements of each check; ``no_bound``: elements without a finite bound and why; ``elements``: every
    checked element with its inputs (``--out``); ``header``: provenance, device, scale constants, eps,
    arithmetic, rows, product models, the accumulation evidence and rules; ``verdict``: one line; ``exit_code``: of the CLI."""

    table: pd.DataFrame
    worst: pd.DataFrame
    no_bound: pd.DataFrame
    header: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elements: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def ok(self) -> bool:
        """No measured error outside its bound (a PASS also needs :attr:`complete`)."""
        return bool((self.table["violations"] == 0).all())

    @property
    def complete(self) -> bool:
        """Every check has at least one element within a finite bound."""
        return bool(len(self.table)) and bool((self.table["within"] > 0).all())

    @property
    def exit_code(self) -> int:
        """0 PASS, 1 FAIL (a bound violated), 3 INCOMPLETE (a check with nothing within a finite bound)."""
        return EXIT_FAIL if not self.ok else (EXIT_PASS if self.complete else EXIT_INCOMPLETE)

    @property
    def verdict(self) -> str:
        t = self.table
        counts = (f"{int(t['within'].sum()):,} within their bounds, {int(t['no_bound'].sum()):,} without a finite "
                  f"bound (listed with the reason), {int(t['not_checked'].sum()):,} not checked")
        if not self.ok:
            bad = t[t["violations"] > 0]
            first = bad.iloc[0]
            return (f"VERDICT: FAIL - {int(bad['violations'].sum()):,} values outside their bounds "
                    f"({len(bad)} check(s)); {counts}; first: {first['check']} (lemma {first['lemma']}) at "
                    f"{first['worst_at']}" + (f" of {first['module']}" if first["module"] else ""))
        if not self.complete:
            empty = t[t["within"] == 0]
            names = sorted({c + (f" of {mod}" if mod else "") for c, mod in zip(empty["check"], empty["module"])})
            return (f"VERDICT: INCOMPLETE - no violation, but {len(empty) or 'every'} check(s) with no element "
                    f"within a finite bound ({'; '.join(names[:4]) or 'nothing checked'}"
                    f"{' ...' if len(names) > 4 else ''}); {counts}")
        return f"VERDICT: PASS - {counts}"

    def _shown(self, df: pd.DataFrame) -> pd.DataFrame:
        """``df`` without the module column where there is one unnamed layer."""
        return df.drop(columns="module") if len(df) and "module" in df and not df["module"].any() else df

    @staticmethod
    def _words(df: pd.DataFrame, digits) -> pd.DataFrame:
        """The float columns as text: a word where there is no number (nothing checked, no finite bound)."""
        out = df.copy()
        for c in _FLOATS:
            if c in out:
                out[c] = [("-" if not np.isfinite(v) and c != "err_over_bound" and c != "bound"
                           else "none" if c == "bound" and not np.isfinite(v)
                           else "no bound" if c == "err_over_bound" and np.isnan(v)
                           else _fmt(v, digits)) for v in out[c]]
        return out

    def to_string(self, digits: int | None = 4) -> str:
        """Plain text; ``digits=None``: every value at full precision (shortest round-trip repr)."""
        with pd.option_context("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 80,
                               "display.max_rows", 1000):
            show = lambda df: self._words(self._shown(df), digits).to_string(index=False)  # noqa: E731
            parts = self.header + ["", show(self.table), ""]
            if len(self.no_bound):
                parts += ["elements without a finite bound:", self._shown(self.no_bound).to_string(index=False), ""]
            if len(self.worst):
                parts += ["worst elements (largest err/bound) of each check:", show(self.worst), ""]
            parts += self.notes + ["", self.verdict]
        return "\n".join(parts)

    def to_markdown(self, digits: int | None = 4) -> str:
        """A report to paste into a review: the rules as a list, the tables in GitHub Markdown."""
        parts = [f"**{self.verdict}**", ""] + [f"- {h}" for h in self.header]
        parts += ["", _md_table(self._words(self._shown(self.table), digits), None)]
        if len(self.no_bound):
            parts += ["", "Elements without a finite bound:", "", _md_table(self._shown(self.no_bound), digits)]
        if len(self.worst):
            parts += ["", "Worst elements of each check:", "", _md_table(self._words(self._shown(self.worst), digits),
                                                                          None)]
        return "\n".join(parts + ([""] + [f"- {n}" for n in self.notes] if self.notes else []))

    def csv_text(self, df: pd.DataFrame | None = None) -> str:
        """``df`` (default the table) as CSV at full precision after a header block of ``# `` comment lines
        (the header, the notes and the verdict): read back with ``pandas.read_csv(path, comment="#")``."""
        df = self.table if df is None else df
        block = "".join(f"# {line}\n" for line in self.header + self.notes + [self.verdict])
        return block + df.to_csv(index=False, float_format="%.17g", lineterminator="\n")

    def to_csv(self, path) -> list[Path]:
        """``path`` (the table), ``*_worst``, ``*_no_bound`` and ``*_elements`` (every checked element with
        its inputs) beside it, each with the header block; returns the paths."""
        path = Path(path)
        out = [path] + [path.with_name(path.stem + sfx + path.suffix) for sfx in ("_worst", "_no_bound", "_elements")]
        for df, p in zip((self.table, self.worst, self.no_bound, self.elements), out):
            p.write_text(self.csv_text(df))
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
                carry = ("; the committed trained adapters were trained on a bf16-rounded all-MiniLM-L6-v2: make "
                         "it with `dora-num record carry DIR`, then pass --base DIR" if "minilm" in named.lower() else "")
                raise BoundsCheckError(f"the base model of {adapter_dir} is {named!r}, not a folder on disk: pass "
                                       f"--base DIR (base= in Python; the base weights W are part of every row "
                                       f"norm){carry}")
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

AUTO_ROW_BUDGET = 1 << 20  # d_out d_in (r + 1) at most for every row by default (~ seconds of exact norms)


def _rows_to_check(Wc, Ac, Bc, g, s, max_rows: int | None, seed: int) -> tuple[np.ndarray, str]:
    """The rows of the expensive checks (the exact row norms): every row where ``max_rows`` allows it
    (default: where ``d_out d_in (r + 1) <= AUTO_ROW_BUDGET``), else a sample that always holds the rows
    where ``W + sBA`` is zero and the extremes (a tenth of the sample each) of the norm (both ends), of
    ``kappa`` and of ``|g - 1|`` (both ends), the rest random (seeded)."""
    from .numerics.bounds import assembly_condition

    d_out, d_in = Wc.shape
    r = Ac.shape[0]
    if max_rows is None:
        max_rows = max(32, AUTO_ROW_BUDGET // max(1, d_in * (r + 1)))
    if d_out <= max_rows:
        return np.arange(d_out), f"every row ({d_out})"
    W64, A64, B64 = (t.double().cpu().numpy() for t in (Wc, Ac, Bc))
    sf = float(np.float32(s))
    norm = np.linalg.norm(W64 + sf * (B64 @ A64), axis=1)
    kappa = assembly_condition((W64 * W64).sum(1), (B64 * (W64 @ A64.T)).sum(1), ((B64 @ A64) ** 2).sum(1), s)
    gm1 = np.abs(g.double().cpu().numpy() - 1.0)
    gm1 = np.where(np.isfinite(gm1), gm1, np.inf)
    zero = np.flatnonzero(~(W64 != 0).any(1) & ~(B64 != 0).any(1))
    k = max(1, max_rows // 10)
    order = lambda v: np.argsort(v, kind="stable")  # noqa: E731
    picks = [zero[: max_rows // 4], order(norm)[:k], order(-norm)[:k], order(-kappa)[:k], order(-gm1)[:k],
             order(gm1)[:k]]
    chosen = np.unique(np.concatenate(picks))
    rest = np.setdiff1d(np.arange(d_out), chosen)
    n_rnd = max(0, max_rows - chosen.size)
    rnd = np.random.Generator(np.random.PCG64(seed)).choice(rest, min(n_rnd, rest.size), replace=False)
    rows = np.sort(np.concatenate([chosen, rnd]))
    return rows, (f"{rows.size} of {d_out} rows ({min(zero.size, max_rows // 4)} zero rows of W + sBA; {k} each of "
                  f"smallest and largest norm, largest kappa, largest and smallest |g - 1|; {rnd.size} random, seed "
                  f"{seed})")


class _Acc:
    """Collects the rows of the tables and every element with its inputs."""

    def __init__(self, module: str, top: int, r: int, scale: float):
        self.module, self.top, self.r, self.scale = module, top, r, scale
        self.table, self.worst, self.no_bound, self.elements, self.notes_extra = [], [], [], [], []

    def add(self, check, lemma, model, computed, exact, bound, where: dict, reason, slack=1.0, inputs=None,
            not_checked: int = 0):
        """One check: ``where`` names each element (``{"row": rows}`` or ``{"token": t, "output": o}``),
        ``inputs`` its inputs (columns of the elements CSV).  A computed value that is not finite, or whose
        error is NaN, against a finite bound is a violation."""
        computed, exact, bound = (np.asarray(v, dtype=np.float64).ravel() for v in (computed, exact, bound))
        lemma = np.broadcast_to(np.asarray(lemma, dtype=object), computed.shape)
        where = {k: np.asarray(v).ravel() for k, v in where.items()}
        at = lambda i: ", ".join(f"{k} {int(v[i])}" for k, v in where.items())  # noqa: E731
        with np.errstate(invalid="ignore"):
            err = np.abs(computed - exact)
            fin = np.isfinite(bound)
            tol = np.where(fin, bound * (1 + 2.0**-50), np.inf) + slack * 2.0**-52 * np.abs(exact)
            within = fin & (err <= tol)  # a NaN err is not within
            viol = fin & ~within
            ratio = np.where(fin & (bound > 0), err / np.where(bound > 0, bound, 1.0), np.where(err == 0, 0.0, np.inf))
        ratio = np.where(fin, np.where(np.isnan(ratio), np.inf, ratio), np.nan)
        key = np.where(fin, ratio, -1.0)
        n = int(err.size)
        row = {"module": self.module, "check": check, "lemma": ", ".join(sorted(set(lemma.tolist()))), "model": model,
               "r": self.r, "scale": self.scale, "n": n, "within": int(within.sum()), "violations": int(viol.sum()),
               "no_bound": int((~fin).sum()), "not_checked": int(not_checked)}
        if n and fin.any():
            i = int(np.argmax(key))
            row.update(worst_at=at(i), computed=float(computed[i]), exact=float(exact[i]), abs_err=float(err[i]),
                       bound=float(bound[i]), err_over_bound=float(ratio[i]))
        else:
            row.update(worst_at="nothing checked" if not n else "no element with a finite bound",
                       computed=math.nan, exact=math.nan, abs_err=math.nan, bound=math.inf, err_over_bound=math.nan)
        self.table.append(row)
        for k, j in enumerate(np.argsort(-key, kind="stable")[: self.top]):
            if fin[j]:
                self.worst.append({"module": self.module, "check": check, "rank": k + 1, "at": at(int(j)),
                                   "lemma": lemma[j], "computed": float(computed[j]), "exact": float(exact[j]),
                                   "abs_err": float(err[j]), "bound": float(bound[j]), "err_over_bound": float(ratio[j])})
        for j in np.flatnonzero(~fin):
            self.no_bound.append({"module": self.module, "check": check, "at": at(int(j)),
                                  "reason": reason(int(j)) if callable(reason) else reason})
        status = np.where(viol, "violation", np.where(within, "within", "no finite bound"))
        cols = {"module": self.module, "check": check, **where, "lemma": lemma, "status": status,
                "computed": computed, "exact": exact, "bound": bound}
        cols.update({k: np.asarray(v, dtype=np.float64).ravel() for k, v in (inputs or {}).items()})
        self.elements.append(pd.DataFrame(cols) if n else pd.DataFrame(columns=list(cols)))


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


CHECKS = ("factored row norm, bare", "factored row norm, guarded", "factored row norm, as run", "dense row norm",
          "magnitude division", "g end to end", "compose_stable", "compose_naive")
OPERATORS = ("factored_row_norm", "dense_row_norm", "magnitude_scale", "compose_stable", "compose_naive")


def gradual_underflow(device) -> str | None:
    """None where fp32 on ``device`` keeps subnormals (assumption 1 of docs/bounds.md), else what is wrong:
    ``2^-70 * 2^-70`` must be the subnormal ``2^-140`` (flush-to-zero returns 0) and ``2^-140 * 2`` must be
    ``2^-139`` (denormals-are-zero reads the input as 0)."""
    t = torch.tensor([2.0**-70, 2.0**-140], dtype=torch.float32, device=device)
    ftz = float((t[:1] * t[:1])[0]) != 2.0**-140
    daz = float((t[1:] * 2.0)[0]) != 2.0**-139
    if not (ftz or daz):
        return None
    what = " and ".join(w for w, on in (("flush-to-zero (2^-70 * 2^-70 gave 0)", ftz),
                                       ("denormals-are-zero (2^-140 * 2 gave 0)", daz)) if on)
    return (f"fp32 on {torch.device(device).type} runs with {what}; the bounds assume gradual underflow "
            "(docs/bounds.md, assumption 1): switch it off (torch.set_flush_denormal(False)) and check again")


def _check_layer(acc: _Acc, W, A, B, m, x, s: float, eps_v: float, max_rows: int | None, seed: int,
                 max_elements: int, ops: dict, cards=None, probed: dict | None = None) -> list[str]:
    """Every check of one layer into ``acc`` (``ops``: the operators under test; ``cards``, ``probed``: the
    accumulation evidence's seam and its verdicts so far, :mod:`dora_num.check_accumulation`); returns its
    header lines."""
    from fractions import Fraction

    from .check_accumulation import accumulation_evidence, charged_route
    from .numerics.bounds import compose_bound, dense_norm_bound, factored_norm_bound, magnitude_scale_bound
    from .numerics.formats import get_format
    from .numerics.ground_truth import compose_exact, mp_dense_row_norm_sq, mp_magnitude_scale, rn64_over_sqrt
    from .ops.config import get_config, override
    from .ops.guard import guard_rows, tail_bg_format
    from .ops.products import fp32_matmul_precision, product_model, tensor_core_gemms

    lines = []
    d_out, d_in = W.shape
    W64, A64, B64 = (t.double().cpu().numpy() for t in (W, A, B))
    Wc, Ac, Bc, mc = _fp32(W), _fp32(A), _fp32(B), _fp32(m)
    if any(t.dtype == torch.float64 for t in (W, A, B, m)):
        lines.append("float64 inputs: rounded to fp32 once (what the operators compute with); exact values are of the "
                     "inputs as given; each bound charges the rounding (||dx|| per row, |fl32(m) - m| in lemma 6)")
    try:
        model = charged_route(product_model(Wc, Ac), cards, Wc, Ac)
    except ValueError as e:
        raise BoundsCheckError(str(e)) from None
    gemm = fp32_matmul_precision(Wc.device.type)
    # lemma 4's 2u per addition on tensor cores is an assumption about the card: confirmed for these GEMMs by
    # a committed probe or one run now, else the rows that rest on it (lemmas 4 and 4') get no finite bound
    ev = accumulation_evidence(model, tensor_core_gemms(Wc, Ac, model), Wc.device, cards, probed)
    e32 = float(np.float32(eps_v))
    # ---- the guarded norm and g on every row (cheap); guard_rows re-derives the guard's decision row by row
    # from the torch tail, which the operator under the same tail must reproduce bit for bit
    with override(norm_tail="torch"):
        gr = guard_rows(Wc, Ac, Bc, s)
        try:
            guarded_t = ops["factored_row_norm"](Wc, Ac, Bc, s)
        except ValueError:  # a row norm beyond fp32: that row has no finite bound below
            guarded_t = gr.guarded
    n_diff = int((gr.guarded.double() != guarded_t.double()).sum()) if d_out else 0
    if n_diff:
        acc.notes_extra.append(f"the factored norm under test differs from the kit's re-derivation of the torch tail "
                               f"on {n_diff} rows (checked against the re-derivation's bounds)")
    g = ops["magnitude_scale"](mc, guarded_t, eps=eps_v, check=False)  # a g beyond fp32: no finite bound there
    m_all, wg_all, g_all = (t.double().cpu().numpy() for t in (m, guarded_t, g))
    all_rows = np.arange(d_out)
    okw = np.isfinite(wg_all)
    g_div, b_div = np.full(d_out, math.nan), np.full(d_out, math.inf)
    if okw.any():
        g_div[okw] = mp_magnitude_scale(m_all[okw], wg_all[okw], e32).value
        b_div[okw] = magnitude_scale_bound(m_all[okw], wg_all[okw], e32, 0.0)
    no_norm = "the computed norm w^ is not finite (the row norm exceeds fp32): no lemma for g = m / w^"
    acc.add("magnitude division", "6", "fp32 division (correctly rounded), the norm taken as exact", g_all, g_div,
            b_div, {"row": all_rows}, lambda i: no_norm if not okw[i] else "g = m / d(w^) may overflow fp32",
            inputs={"m": m_all, "w_hat": wg_all})
    # ---- the expensive checks (exact row norms) on the rows of _rows_to_check
    rows, how = _rows_to_check(Wc, Ac, Bc, g, s, max_rows, seed)
    skipped = d_out - rows.size
    lines.append(f"rows: magnitude division on every row ({d_out}); the row norms and g end to end on {how}; "
                 f"factored norm products: {model.label}; fp32 GEMMs on {Wc.device.type}: {gemm}")
    lines.append(ev.line)
    where = {"row": rows}
    Ws, Bs = W64[rows], B64[rows]
    Q = mp_dense_row_norm_sq(Ws, A64, Bs, s)  # exact, once: the exact norm and the exact g both round it once
    exact_w = np.array([rn64_over_sqrt(q, q) if q else 0.0 for q in Q], dtype=np.float64)
    dx = _input_rounding(Ws, A64, Bs, Wc[rows], Ac, Bc[rows], s)
    bare = gr.bare.double().cpu().numpy()[rows]
    fmt_b = "fp16" if Wc.dtype == torch.float16 else "bf16"
    b4 = factored_norm_bound(Ws, A64, Bs, s, products=model.u, split_pieces=model.pieces, split_format=fmt_b) + dx
    if not ev.confirmed:
        b4 = np.full(rows.size, math.inf)
    acc.add("factored row norm, bare", "4", model.label, bare, exact_w, b4, where,
            ev.reason or "an fp32 intermediate (U, G, B G, a term or a partial sum of the assembly) may overflow",
            not_checked=skipped)
    rec = gr.recomputed.cpu().numpy()[rows]
    rel_out = gr.rel_out.double().cpu().numpy()[rows]
    with np.errstate(invalid="ignore"):
        b45 = np.where(np.isfinite(rel_out), rel_out * (exact_w + dx) + dx, np.inf)
    beyond = exact_w + b45 >= FP32_OVERFLOW  # the value may round to inf: no finite bound
    b45 = np.where(beyond, np.inf, b45)
    # a row certified by lemma 4' rests on the accumulator's charge; a row recomputed in float64 (5') does not
    unconfirmed = ~rec & (not ev.confirmed)
    b45 = np.where(unconfirmed, np.inf, b45)
    wg_r = wg_all[rows]
    acc.add("factored row norm, guarded", np.where(rec, "5'", "4'"), f"{model.label}; guard on the torch tail",
            wg_r, exact_w, b45, where,
            lambda i: (ev.reason if unconfirmed[i] else
                       "the norm is at fp32's overflow threshold (it may round to inf)" if beyond[i] else
                       "lemma 5': the float64 recompute's bound exceeds the norm (a norm of a few subnormal steps, "
                       "or W + sBA cancelling to float64 roundoff)"), not_checked=skipped)
    if bool(gr.recomputed.any()):
        lines.append(f"guard: {int(gr.recomputed.sum())} of {d_out} rows recomputed in float64 (lemma 5'), "
                     "the others certified by lemma 4' from their fp32 terms")
    if Wc.device.type == "cuda" and get_config().norm_tail != "torch":
        # the tail the layer runs there (Triton): its certified rows are fp32 assemblies of the same terms in
        # another order (lemma 4, any order), its recomputed rows lemma 5' (the torch tail's bound where that
        # recomputed too); a row may be decided differently by the two tails, so the larger of the two
        try:
            run = ops["factored_row_norm"](Wc, Ac, Bc, s).double().cpu().numpy()[rows]
        except ValueError:
            run = np.full(rows.size, math.inf)
        # the Triton tail's B G: an fp32 dot (lemma 4 as above), or bf16 pieces on tensor cores (OpConfig.tail_bg),
        # whose MMA is charged 2u per addition as the GEMMs are (the probe above measured cuBLAS's GEMMs, not it)
        tail_bg = tail_bg_format(Bc, get_config())
        b4_run = b4
        tail_label = "B G an fp32 dot"
        if tail_bg is not None:
            b4_run = factored_norm_bound(Ws, A64, Bs, s, products=model.u, split_pieces=model.pieces,
                                         split_format=fmt_b, tail_bg=tail_bg) + dx
            b4_run = b4_run if ev.confirmed else np.full(rows.size, math.inf)
            tail_label = f"B G from bf16 pieces of {tail_bg} B on tensor cores"
            lines.append("tail: B G from bf16 pieces on tensor cores (OpConfig.tail_bg); its MMA is charged 2u per "
                         "addition, the card's probe above measured the products' GEMMs, not this dot")
        acc.add("factored row norm, as run", np.where(rec, "4 or 5'", "4"), f"{model.label}; the {get_config().norm_tail}"
                f" tail (the layer's on this device), {tail_label}", run, exact_w, np.maximum(b4_run, b45), where,
                ev.reason or "an fp32 intermediate may overflow", not_checked=skipped)
    dense = np.empty(rows.size)
    try:
        dense[:] = ops["dense_row_norm"](Wc[rows], Ac, Bc[rows], s).double().cpu().numpy()
    except ValueError:  # some row overflows fp32: row by row, inf where it does (no finite bound there)
        for k, j in enumerate(rows):
            try:
                dense[k] = float(ops["dense_row_norm"](Wc[j:j + 1], Ac, Bc[j:j + 1], s)[0])
            except ValueError:
                dense[k] = math.inf
    acc.add("dense row norm", "5", f"B @ A: fp32 GEMM ({gemm})", dense, exact_w,
            dense_norm_bound(Ws, A64, Bs, s, matmul=gemm) + dx, where,
            "an element of W + sBA or the sum of squares may overflow fp32", not_checked=skipped)
    # ---- g end to end: the exact m / ||W + sBA|| (m / eps on a zero row), rounded once
    m_r, gc = m_all[rows], g_all[rows]
    g_true = np.array([rn64_over_sqrt(Fraction(float(mj)), q) if q else float(Fraction(float(mj)) / Fraction(e32))
                       for mj, q in zip(m_r, Q)], dtype=np.float64)
    zero = exact_w == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(zero, np.where(wg_r == 0, 0.0, np.inf), b45 / np.where(zero, 1.0, exact_w) * (1 + 2.0**-50))
    ok6 = np.isfinite(wg_r) & ~unconfirmed
    b6 = np.full(rows.size, math.inf)
    if ok6.any():
        b6[ok6] = magnitude_scale_bound(m_r[ok6], wg_r[ok6], e32, np.where(np.isfinite(rel), rel, 1.0)[ok6])
    acc.add("g end to end", np.where(rec, "6 with 5'", "6 with 4'"), "fp32 division of the guarded norm", gc, g_true,
            b6, where, lambda i: (ev.reason if unconfirmed[i] else no_norm if not np.isfinite(wg_r[i]) else
                                  "the norm's guarantee is not below 1 (rel >= 1)"
                                  if not rel[i] < 1 else "g may overflow fp32"), slack=4.0, inputs={"m": m_r},
            not_checked=skipped)
    if x is None:
        return lines + ["compose: not checked (no activations x given)"]
    if x.dtype == torch.float64:
        raise BoundsCheckError("x is float64; the compose runs in float16, bfloat16 or float32 activations "
                               "(convert x explicitly)")
    if x.dim() < 1 or x.shape[-1] != d_in:
        raise BoundsCheckError(f"x must be [..., d_in] = [..., {d_in}], got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, d_in)
    if x2.shape[0] * d_out > max_elements:
        raise BoundsCheckError(f"compose check of {x2.shape[0]} tokens x {d_out} outputs = {x2.shape[0] * d_out:,} "
                               f"elements exceeds max_elements={max_elements:,}; pass fewer tokens or raise the limit")
    lin = torch.nn.functional.linear
    with torch.no_grad():  # as DoRALinear without autocast: x cast to A's dtype for the LoRA products (PEFT)
        base = lin(x2, Wc.to(x.device, x.dtype))
        lora = lin(lin(x2.to(Ac.dtype), Ac), Bc)
        formed = {"base": dt_name(base), "lora": dt_name(lora)}
        cdt = torch.promote_types(lora.dtype, base.dtype)  # adapters wider than x: the compose in the wider dtype
        base, lora = base.to(cdt), lora.to(cdt)
    fmt = get_format(cdt)
    fb, fl, fg = (torch.isfinite(t).cpu().numpy() for t in (base, lora, g))
    ok = fb & fl & fg[None, :]
    okt = torch.from_numpy(ok).to(base.device)
    base_s, lora_s = torch.where(okt, base, 0), torch.where(okt, lora, 0)  # no lemma where not finite
    g_s = torch.where(torch.isfinite(g), g, 1.0)
    b64, l64 = base_s.double().cpu().numpy(), lora_s.double().cpu().numpy()
    G = np.broadcast_to(g_s.double().cpu().numpy(), b64.shape)
    exact = np.where(ok, compose_exact(b64, l64, G, s, fmt).value, math.nan)
    tok, out = np.divmod(np.arange(ok.size), d_out)
    why = lambda i: (f"x W^T overflows {formed['base']}" if not fb.flat[i] else  # noqa: E731
                     f"x A^T B^T overflows {formed['lora']}" if not fl.flat[i] else
                     "g = m / w^ is not finite (beyond fp32)" if not fg[i % d_out] else
                     "an intermediate or the output may overflow the format")
    inputs = {"base": np.where(ok, b64, np.where(fb, base.double().cpu().numpy(), math.inf)),
              "lora": np.where(ok, l64, np.where(fl, lora.double().cpu().numpy(), math.inf)),
              "g": np.broadcast_to(g.double().cpu().numpy(), b64.shape)}
    for formula, lemma in (("compose_stable", "1"), ("compose_naive", "2")):
        c = ops[formula](base_s, lora_s, g_s.to(base.device), s).double().cpu().numpy()
        bnd = np.where(ok, compose_bound(formula, b64, l64, G, s, fmt, "fp32"), math.inf)
        final = f"one rounding to {fmt.name}" if fmt.p < 24 else "no final rounding (fp32 output)"
        acc.add(formula, lemma, f"fp32 intermediates, no FMA, {final}", c, exact, bnd, {"token": tok, "output": out},
                why, inputs=inputs)
    n_bad = int((~ok).sum())
    return lines + [f"compose: on {x2.shape[0]} tokens x {d_out} outputs, formed as DoRALinear forms them without "
                    f"autocast: base = x W^T in {dt_name(x)}, lora = "
                    f"(x A^T) B^T with x cast to A's dtype ({dt_name(Ac)}), the compose in {fmt.name} (the wider of "
                    "the two)" + (f"; {n_bad} elements with a non-finite base, lora or g are listed without a bound"
                                  if n_bad else "")]


def dt_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _checked_eps(eps) -> float:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise BoundsCheckError(f"eps must be a number, got {eps!r}") from None
    e32 = float(np.float32(e)) if math.isfinite(e) and abs(e) < 3.4028235677973366e38 else math.inf
    if not (math.isfinite(e) and e > 0 and 0 < e32 < math.inf):
        raise BoundsCheckError(f"eps = {e!r} is not usable: it must be positive and its fp32 value positive and "
                               f"finite (fl32(eps) = {e32!r}); the magnitude division divides by it on zero rows")
    return e


def check_bounds(W=None, A=None, B=None, m=None, x=None, *, scale: float | None = None, file=None, base=None,
                 module=None, eps: float | None = None, max_rows: int | None = None, top: int = 5, seed: int = 0,
                 max_elements: int = MAX_COMPOSE_ELEMENTS, max_bytes: int = MAX_FILE_BYTES, device=None,
                 operators: dict | None = None, accumulation=None) -> BoundsReport:
    """Measured error vs the lemma's bound for every formula (module docstring).

    Pass the tensors (``x`` may be None: then no compose rows), or ``file=``: a one-layer safetensors
    file, or a PEFT DoRA adapter folder / its ``adapter_model.safetensors`` (``base``: the base model;
    ``module``: a name or list of names, default every module; adapters only).  ``scale`` is required
    unless the file carries it (an adapter's config does).  ``max_rows``: rows of the exact norm checks
    per module (default: every row where that takes seconds, else a sample, :func:`_rows_to_check`).
    ``device``: where the operators run (default the tensors' own; files load on the CPU).  ``operators``:
    name -> callable replacing the package's operator of that name (:data:`OPERATORS`), the seam to check
    another implementation.  ``accumulation``: a :class:`~dora_num.check_accumulation.CardProbes`, where the
    evidence for the tensor-core accumulator comes from (default: the card's committed probe where it covers
    the layer's GEMMs, else a probe run now on them).  Raises :class:`BoundsCheckError` (a ``ValueError``) naming the problem for
    unusable input, the flush-to-zero of subnormals included."""
    import dora_num as dn

    from .numerics.formulas import scale_constants
    from .ops.magnitude import default_eps
    from .ops.validation import check_lora_factors, check_scale

    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise BoundsCheckError(f"max_rows (--rows) must be a positive integer, got {max_rows!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise BoundsCheckError(f"top (--top) must be a non-negative integer, got {top!r}")
    ops = {name: getattr(dn, name) for name in OPERATORS}
    for name, fn in (operators or {}).items():
        if name not in OPERATORS or not callable(fn):
            raise BoundsCheckError(f"operators: {name!r} must be one of {OPERATORS} and callable")
        ops[name] = fn
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise BoundsCheckError(f"device {device!r} is not a torch device ({e})") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BoundsCheckError("device cuda: no CUDA device here (check on the CPU, or on a machine with one)")
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
            if module:
                raise BoundsCheckError(f"module= (--module) names modules of a PEFT adapter; {file} is a one-layer "
                                       "file")
            tensors, fscale = load_file(file, max_bytes=max_bytes)
            if scale is not None and fscale is not None and float(scale) != fscale:
                raise BoundsCheckError(f"scale={scale} given but the file says {fscale}")
            layers.append(("", tensors, fscale if scale is None else scale, f"file {file}"))
    else:
        layers.append(("", dict(W=W, A=A, B=B, m=m, x=x), scale, "tensors"))
    lines: dict[str, list[str]] = {}  # header line -> the modules it describes
    probed: dict = {}  # (card, GEMM) -> the accumulation evidence's verdict: a shape is probed once per check
    tables, worst, nob, elements, notes = [], [], [], [], []
    devices = []
    for name, t, sc, source in layers:
        if sc is None:
            raise BoundsCheckError("scale is required (the LoRA scale s: alpha/r, or alpha/sqrt(r) with rsLoRA)")
        if any(t[k] is None for k in "WABm"):
            raise BoundsCheckError("W, A, B and m are required")
        Wt, At, Bt, mt = (_to_torch(k, t[k]) for k in "WABm")
        xt = None if t["x"] is None else _to_torch("x", t["x"])
        dev = device if device is not None else Wt.device
        Wt, At, Bt, mt = (v.to(dev) for v in (Wt, At, Bt, mt))
        xt = None if xt is None else xt.to(dev)
        if dev not in devices:  # assumption 1 on the device the operators run on, before any check
            flush = gradual_underflow(dev)
            if flush:
                raise BoundsCheckError(flush)
            devices.append(dev)
        try:
            d_out, d_in, r = check_lora_factors(Wt, At, Bt)
            s_raw = check_scale(sc)
        except (TypeError, ValueError) as e:
            raise BoundsCheckError(str(e)) from None
        if not abs(s_raw) < 3.4028235677973366e38:  # fl32(scale) would be inf: no fp32 operator can take it
            raise BoundsCheckError(f"scale {s_raw!r} rounds to infinity in fp32; the operators take fl32(scale)")
        if mt.dim() != 1 or mt.shape[0] != d_out:
            raise BoundsCheckError(f"m must be [d_out] = [{d_out}], got shape {tuple(mt.shape)}")
        s, two_s, s_sq = scale_constants(s_raw)
        eps_v = default_eps(mt.dtype) if eps is None else _checked_eps(eps)
        mine = [f"source: {source}",
                f"inputs: W [d_out, d_in] = [{d_out}, {d_in}] {dt_name(Wt)}, A {dt_name(At)}, B {dt_name(Bt)}, "
                f"m {dt_name(mt)}" + (f", x {list(xt.shape)} {dt_name(xt)}" if xt is not None else "") + f"; r = {r}",
                f"scale {s_raw!r}: s = fl32(scale) = {s!r}, 2s = {two_s!r}, s^2 = fl32(s*s) = {s_sq!r} "
                f"(exact s*s = {s * s!r}); eps = {float(np.float32(eps_v))!r} (zero rows only)",
                "arithmetic: fp32 intermediates, no FMA contraction, correctly rounded sqrt and division; "
                "exact values: certified ground truth rounded once to float64; a value violates its bound if "
                "|computed - exact| > bound (1 + 2^-50) + c 2^-52 |exact| (c = 1, 4 for g end to end), or if it "
                "is not finite (or NaN) against a finite bound"]
        acc = _Acc(name, top, r, s_raw)
        mine += _check_layer(acc, Wt, At, Bt, mt, xt, s_raw, eps_v, max_rows, seed, max_elements, ops, accumulation,
                             probed)
        for rows in (acc.table, acc.worst, acc.no_bound):  # the order of the formulas, whatever the order of work
            rows.sort(key=lambda row: CHECKS.index(row["check"]))
        acc.elements.sort(key=lambda df: CHECKS.index(df["check"].iloc[0]) if len(df) else 0)
        for line in mine:
            lines.setdefault(line, []).append(name or f"[{d_out}, {d_in}]")
        tables += acc.table
        worst += acc.worst
        nob += acc.no_bound
        elements += acc.elements
        notes += [(f"{name}: " if name else "") + n for n in acc.notes_extra]
    many = len(layers) > 1
    where = ", ".join(d.type + (f" ({torch.cuda.get_device_name(d)})" if d.type == "cuda" else "") for d in devices)
    header = [provenance(), f"device: {where} (the operators ran there)"]
    header += [line + (f"  [{', '.join(mods)}]" if many and len(mods) < len(layers) else "")
               for line, mods in lines.items()]
    if many:
        header.append(f"modules: {len(layers)} (every row of the tables names its module, its r and its scale)")
    kept = [e for e in elements if len(e)]
    return BoundsReport(pd.DataFrame(tables, columns=COLUMNS), pd.DataFrame(worst),
                        pd.DataFrame(nob, columns=["module", "check", "at", "reason"]), header, notes,
                        pd.concat(kept, ignore_index=True) if kept else pd.DataFrame())


# --------------------------------------------------------------------------
# CLI: dora-num bounds check PATH
# --------------------------------------------------------------------------

def _cmd_check(args) -> int:
    import sys

    try:
        rep = check_bounds(file=args.path, scale=args.scale, base=args.base, module=args.module or None,
                           max_rows=args.rows, top=args.top, max_bytes=int(args.max_bytes * 2**30), eps=args.eps,
                           device=args.device)
    except (BoundsCheckError, OSError) as e:
        print(f"dora-num bounds check: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    except Exception as e:  # noqa: BLE001 - anything else is the kit's own fault, not a verdict on the bounds
        msg = str(e).splitlines()[0] if str(e) else ""
        print(f"dora-num bounds check: internal error (a bug in the kit, please report): {type(e).__name__}: {msg}",
              file=sys.stderr)
        return EXIT_INTERNAL
    digits = None if args.full_precision else 4
    text = {"text": lambda: rep.to_string(digits), "markdown": lambda: rep.to_markdown(digits),
            "csv": lambda: rep.csv_text()}[args.format]()
    print(text)
    if args.out:
        paths = rep.to_csv(args.out)
        print(f"\nwrote {', '.join(map(str, paths))}", file=sys.stderr if args.format == "csv" else sys.stdout)
    return rep.exit_code


def register(sub) -> None:
    """Add ``bounds check PATH`` to the CLI's subparsers."""
    p = sub.add_parser("bounds", help="the reviewer's kit: measured error vs the a-priori bounds")
    bsub = p.add_subparsers(dest="bounds_command", required=True)
    c = bsub.add_parser("check", help="check every bound on a layer file or a PEFT DoRA adapter (see dora_num.check); "
                                      "exit 0: PASS, 1: a bound violated, 2: unusable input, 3: INCOMPLETE (a check "
                                      "with no element within a finite bound), 4: internal error")
    c.add_argument("path", help="a .safetensors file with W, A, B, m (and activations x), or a PEFT DoRA adapter "
                                "folder (or its adapter_model.safetensors)")
    c.add_argument("--base", help="PEFT adapters: the base model folder or weights file (default: the config's "
                                  "base_model_name_or_path where that is a folder)")
    c.add_argument("--module", action="append", help="PEFT adapters: a module name (or name suffix) to check; "
                                                     "repeat for several (default: every module)")
    c.add_argument("--scale", type=float, help="the LoRA scale s (layer files that do not carry it)")
    c.add_argument("--format", choices=("text", "markdown", "csv"), default="text", help="report format (default text)")
    c.add_argument("--full-precision", action="store_true", help="print every value at full precision")
    c.add_argument("--out", help="also write the table to FILE.csv (with FILE_worst.csv, FILE_no_bound.csv and "
                                 "FILE_elements.csv: every checked element with its inputs)")
    c.add_argument("--rows", type=int, default=None, help="rows of the exact norm checks per module (default: every "
                                                          "row where that takes seconds, else a sample with the "
                                                          "extremes)")
    c.add_argument("--top", type=int, default=5, help="worst elements listed per check (default 5)")
    c.add_argument("--eps", type=float, help="eps of the magnitude division (default by the dtype of m)")
    c.add_argument("--device", help="where the operators run, e.g. cuda (default: cpu, where files load)")
    c.add_argument("--max-bytes", type=float, default=MAX_FILE_BYTES / 2**30, help="layer file size limit in GiB")
    c.set_defaults(func=_cmd_check)


__all__ = ["EXIT_FAIL", "EXIT_INCOMPLETE", "EXIT_INTERNAL", "EXIT_PASS", "EXIT_UNUSABLE", "OPERATORS",
           "BoundsCheckError", "BoundsReport", "check_bounds", "gradual_underflow", "load_adapter", "load_file"]
