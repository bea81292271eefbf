"""``dora-num reproduce --check``: regenerated artifacts against the committed ones.

Every file that a notebook writes under ``data/`` or ``figures/`` is compared with
the committed file of the same path.  The default rule is *bytes equal*: the
numerical code is deterministic (fixed-order or exact reductions, activations
rounded once from float64: :mod:`dora_num.repro.determinism`), so the same commit
gives the same bytes on any x86-64 CPU.  An artifact that cannot be so is declared
in :data:`RULES` with its kind and the reason beside it:

- ``"timing"``: wall-clock measurements of this machine; values are reported,
  never judged (the structure must match: same keys / columns).
- ``"numeric"``: numbers may move by at most ``rtol`` (relative) / ``atol``
  (absolute) per value; everything that is not a number must be equal.

The rules are matched in order with :func:`fnmatch.fnmatch` on the repo-relative
path, so an artifact added later is held to bytes-equal until a rule says
otherwise.  Sidecars (``*.provenance.json``) carry timestamps and are not
compared; what *is* checked is that each committed sidecar's ``sha256`` is the
committed artifact's.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

SIDECAR = ".provenance.json"


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str  # "exact" | "numeric" | "timing"
    reason: str
    rtol: float = 0.0
    atol: float = 0.0


# Declared exceptions to "bytes equal", each with its reason.
RULES: tuple[Rule, ...] = (
    Rule("data/03_ground_truth_and_bounds/ground_truth_bench.json", "timing",
         "throughput of the certified ground truth, timed on the machine that runs it"),
)
DEFAULT_RULE = Rule("*", "exact", "deterministic: fixed-order/exact reductions, activations rounded once from "
                                  "float64, so the same commit gives the same bytes on any x86-64 CPU")


def rule_for(rel: str, rules: tuple[Rule, ...] = RULES) -> Rule:
    for r in rules:
        if fnmatch.fnmatch(rel, r.pattern):
            return r
    return DEFAULT_RULE


def timing_paths(rules: tuple[Rule, ...] = RULES) -> list[str]:
    """Patterns of the declared timing artifacts (their bytes change on every run)."""
    return [r.pattern for r in rules if r.kind == "timing"]


@dataclass
class Outcome:
    path: str  # repo-relative
    status: str  # identical | within | drift | timing | new | missing
    kind: str
    max_abs: float | None = None
    max_rel: float | None = None
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("drift", "new", "missing")


# ----------------------------------------------------------------------------
# Reading numbers out of artifacts
# ----------------------------------------------------------------------------

def _read_bytes(p: Path) -> bytes:
    return p.read_bytes()


def _flatten_json(obj, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten_json(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_flatten_json(v, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = obj
    return out


def _table(p: Path):
    import pandas as pd

    name = p.name
    if name.endswith(".csv") or name.endswith(".csv.gz"):
        return pd.read_csv(p, compression="gzip" if name.endswith(".gz") else None)
    if name.endswith(".parquet"):
        return pd.read_parquet(p)
    return None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _diff_values(pairs) -> tuple[float, float, list[str]]:
    """Max |a-b| and max |a-b|/|b| over numeric pairs; non-numeric mismatches listed."""
    max_abs = max_rel = 0.0
    bad: list[str] = []
    for key, a, b in pairs:
        if _is_number(a) and _is_number(b):
            fa, fb = float(a), float(b)
            if math.isnan(fa) and math.isnan(fb) or fa == fb:
                continue
            if math.isnan(fa) or math.isnan(fb) or math.isinf(fa) or math.isinf(fb):
                bad.append(f"{key}: {a!r} vs {b!r}")
                continue
            d = abs(fa - fb)
            max_abs = max(max_abs, d)
            max_rel = max(max_rel, d / abs(fb) if fb != 0 else math.inf)
        elif a != b:
            bad.append(f"{key}: {a!r} vs {b!r}")
    return max_abs, max_rel, bad


def numeric_diff(new: Path, old: Path) -> tuple[float, float, list[str]] | None:
    """``(max_abs, max_rel, structural mismatches)`` between two tables or JSON files;
    ``None`` when the format holds no numbers to compare (figures, binaries)."""
    name = new.name
    if name.endswith(".json"):
        a, b = _flatten_json(json.loads(new.read_text())), _flatten_json(json.loads(old.read_text()))
        if a.keys() != b.keys():
            return 0.0, 0.0, [f"keys differ: {sorted(a.keys() ^ b.keys())[:5]}"]
        return _diff_values((k, a[k], b[k]) for k in sorted(a))
    try:
        ta, tb = _table(new), _table(old)
    except Exception as e:  # noqa: BLE001 - an unreadable table is a mismatch, reported as such
        return 0.0, 0.0, [f"unreadable: {type(e).__name__}: {e}"]
    if ta is None:
        return None
    if list(ta.columns) != list(tb.columns) or ta.shape != tb.shape:
        return 0.0, 0.0, [f"shape/columns differ: {ta.shape} {list(ta.columns)[:6]} vs {tb.shape} {list(tb.columns)[:6]}"]
    pairs = []
    for col in ta.columns:
        for i, (x, y) in enumerate(zip(ta[col].tolist(), tb[col].tolist())):
            pairs.append((f"{col}[{i}]", x, y))
    return _diff_values(pairs)


# ----------------------------------------------------------------------------
# Comparing trees
# ----------------------------------------------------------------------------

def _artifacts(root: Path, subdirs: list[str]) -> dict[str, Path]:
    out = {}
    for sub in subdirs:
        base = root / sub
        if base.is_dir():
            for p in sorted(base.rglob("*")):
                if p.is_file() and not p.name.endswith(SIDECAR) and not p.name.startswith("."):
                    out[str(p.relative_to(root))] = p
    return out


def compare_file(rel: str, new: Path, old: Path | None, rules: tuple[Rule, ...] = RULES) -> Outcome:
    rule = rule_for(rel, rules)
    if old is None or not old.is_file():
        return Outcome(rel, "new", rule.kind, note="not committed")
    if _read_bytes(new) == _read_bytes(old):
        return Outcome(rel, "identical", rule.kind)
    nd = numeric_diff(new, old)
    max_abs, max_rel, bad = nd if nd is not None else (None, None, [])
    note = "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
    if rule.kind == "timing":
        return Outcome(rel, "timing", rule.kind, max_abs, max_rel, note or rule.reason)
    if rule.kind == "numeric" and nd is not None and not bad \
            and (max_abs <= rule.atol or max_rel <= rule.rtol):
        return Outcome(rel, "within", rule.kind, max_abs, max_rel, rule.reason)
    if nd is None:
        note = "bytes differ"
    elif not bad and max_abs == 0.0:
        note = "same values, bytes differ (formatting)"
    return Outcome(rel, "drift", rule.kind, max_abs, max_rel, note)


def compare_trees(new_root: Path, old_root: Path, subdirs: list[str], rules: tuple[Rule, ...] = RULES,
                  expect_all: bool = True) -> list[Outcome]:
    """Compare every artifact under ``new_root/<subdir>`` with ``old_root/<subdir>``.

    ``subdirs`` are repo-relative folders (``data/00_overview``, ``figures/00_overview``)
    of the notebooks that ran; with ``expect_all`` a committed artifact there that was
    not regenerated is reported ``missing``."""
    new, old = _artifacts(new_root, subdirs), _artifacts(old_root, subdirs)
    out = [compare_file(rel, p, old.get(rel), rules) for rel, p in new.items()]
    if expect_all:
        out += [Outcome(rel, "missing", rule_for(rel, rules).kind, note="committed, not regenerated")
                for rel in sorted(old.keys() - new.keys())]
    return sorted(out, key=lambda o: o.path)


def sidecar_mismatches(root: Path, subdirs: list[str]) -> list[str]:
    """Committed artifacts whose sidecar is missing or names another sha256."""
    bad = []
    for rel, p in _artifacts(root, subdirs).items():
        side = Path(str(p) + SIDECAR)
        if not side.is_file():
            bad.append(f"{rel}: no sidecar")
            continue
        want = json.loads(side.read_text()).get("sha256")
        if want != hashlib.sha256(p.read_bytes()).hexdigest():
            bad.append(f"{rel}: sidecar sha256 does not match the file")
    return bad


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.3g}"


def format_table(outcomes: list[Outcome], *, verbose: bool = False) -> str:
    """A plain-text table: every non-identical artifact (all with ``verbose``) and a count line."""
    rows = [o for o in outcomes if verbose or o.status != "identical"]
    head = ("status", "artifact", "max |diff|", "max rel", "note")
    body = [(o.status, o.path, _fmt(o.max_abs), _fmt(o.max_rel), o.note) for o in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head[:-1])]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head[:-1], widths)) + "  " + head[-1]] if body else []
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in body]
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    lines.append(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f" (of {len(outcomes)} artifacts)")
    return "\n".join(lines)


