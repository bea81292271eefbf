"""Notebook 01's trained adapters: the committed record (``data/adapters/trained``) and its analysis.

:func:`load_trained` reads what :func:`.ingest_trained.ingest` wrote; the functions below make notebook
01's tables: what "trained" means for each run (:func:`outcome`, with the stop labels re-derived from the
evaluations by :func:`check_stop_labels`), the collapse fractions at the final step (:func:`final_pivot`,
recomputed from the committed per-row ``g`` by :func:`check_final_against_record`), the paper's adapter
beside ours (:func:`paper_beside`), and the exported adapters' tables as ``dora-num collapse`` prints them,
from the recorded ``g`` of the exported state (:func:`exported_tables`; the tests hold the command to them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ...adapters.collapse import POOLED, collapse_table
from ...numerics.formats import NARROW_FORMATS
from .datasets import TRAINED
from .runs import ZONE_COLUMNS, activations_for, collapse_by_type, expand_gm1, resolve_base

READ = ("manifest", "evals", "history_windows", "collapse", "g_final")  # the roles of TRAINED that load_trained reads


@dataclass
class Trained:
    manifest: dict
    evals: pd.DataFrame
    windows: pd.DataFrame
    collapse: pd.DataFrame
    crosscheck: pd.DataFrame
    g_final: dict[str, dict[str, np.ndarray]]  # run -> module -> g (float64, from runs.compact_gm1)
    final_steps: dict[str, int]
    folder: Path
    outcome: pd.DataFrame = field(default_factory=pd.DataFrame)

    def exported(self) -> dict[str, Path]:
        d = self.folder / "exported"
        return {p.name: p for p in sorted(d.iterdir())} if d.is_dir() else {}


def load_trained(folder=None) -> Trained:
    """The committed record (default ``data/adapters/trained``), or a record in ``folder``;
    :class:`~dora_num.repro.recording.RecordedDataMissing` naming the missing files and the record
    command when it is incomplete."""
    TRAINED.subset(*READ).require(folder)
    folder = Path(folder) if folder is not None else TRAINED.paths()[0].parent
    def path(role):
        return TRAINED.path(role, folder)

    manifest = json.loads(path("manifest").read_text())
    with np.load(path("g_final"), allow_pickle=False) as z:
        off, mods = z["offsets"], [str(n) for n in z["modules"]]
        gm1 = expand_gm1(z["gm1"], *((z["exact_idx"], z["exact_gm1"]) if "exact_idx" in z.files else ()))
        g = {str(r): {n: 1.0 + gm1[i, off[j]:off[j + 1]] for j, n in enumerate(mods)} for i, r in enumerate(z["runs"])}
        steps = {str(r): int(s) for r, s in zip(z["runs"], z["steps"])}
    cross = pd.read_csv(path("crosscheck")) if path("crosscheck").is_file() else pd.DataFrame()
    return Trained(manifest, pd.read_csv(path("evals")), pd.read_csv(path("history_windows")),
                   pd.read_csv(path("collapse")), cross, g, steps, folder,
                   pd.DataFrame(manifest["outcome"]))


def final_recomputed(tr: Trained, formats=NARROW_FORMATS) -> pd.DataFrame:
    """The final-step zone fractions of every run recomputed from ``g_final.npz`` (no absorption)."""
    frames = [collapse_by_type(g, formats).assign(run=run, step=tr.final_steps[run]) for run, g in tr.g_final.items()]
    return pd.concat(frames, ignore_index=True)


def check_final_against_record(tr: Trained, formats=NARROW_FORMATS) -> pd.DataFrame:
    """Rows where :func:`final_recomputed` differs from ``collapse.csv.gz``'s final rows in a zone
    fraction (empty: the committed g reproduces the recorded table)."""
    key = ["run", "group", "format"]
    rec = tr.collapse[tr.collapse["final"] & tr.collapse["run"].isin(tr.g_final)][key + list(ZONE_COLUMNS)]
    j = final_recomputed(tr, formats)[key + list(ZONE_COLUMNS)].merge(rec, on=key, how="outer",
                                                                      suffixes=("", "_recorded"))
    bad = np.zeros(len(j), dtype=bool)
    for c in ZONE_COLUMNS:
        bad |= ~(j[c] == j[f"{c}_recorded"]).to_numpy()
    return j[bad].reset_index(drop=True)


def base_for_record(tr: Trained, workdir) -> Path:
    """The base weights folder of the record's runs (rebuilt and checked: :func:`resolve_base`)."""
    return resolve_base(tr.manifest["base"], Path(workdir))


# --------------------------------------------------------------------------
# Analysis for notebook 01
# --------------------------------------------------------------------------

STOP_REASONS = ("plateau", "max_steps", "deadline", "signal", "diverged")  # or "error: ..." (record_trained.run_one)
# The paper's real adapter (docs/paper.md): Qwen2-VL-7B, r = 128, 326 modules, 1.77M g values; task, learning
# rate and steps not stated (the paper's own training recipe, for its Qwen3.5-9B convergence runs: r = 384,
# rsLoRA, lr 1e-5 cosine, 2000 steps).
PAPER_ADAPTER = {"source": "paper: Qwen2-VL-7B, r=128", "model_params": "7B", "modules": 326, "n_g": 1_770_000,
                 "task": "not stated", "lr": "not stated", "steps": "not stated", "g_std": 0.0015,
                 "bf16_frac_symmetric_zone": 1.00, "fp16_frac_symmetric_zone": 0.20}


def outcome(tr: Trained) -> pd.DataFrame:
    """Per run: why and where it stopped, MRR@10 and validation loss against the base model (step 0)."""
    o = tr.outcome.copy()
    o["mrr10_gain_best"] = o["mrr10_best"] - o["mrr10_base"]
    o["mrr10_gain_final"] = o["mrr10_final"] - o["mrr10_base"]
    o["converged"] = o["stop_reason"] == "plateau"
    cols = ["run", "variant", "rank", "lr", "scale", "stop_reason", "steps", "best_step", "mrr10_base", "mrr10_best",
            "mrr10_final", "mrr10_gain_best", "val_loss_base", "val_loss_final", "s_per_step", "train_s"]
    return o[cols].sort_values(["variant", "lr", "rank"]).reset_index(drop=True)


def check_stop_labels(tr: Trained) -> list[str]:
    """Problems with the recorded stop reasons, re-derived from ``evals.csv`` (empty: every label holds).

    ``plateau``: the last ``patience`` evaluations did not beat the best before them by more than
    ``min_delta``; ``deadline``/``signal``: fewer than ``max_steps`` steps; ``max_steps``: all of them."""
    cfg = tr.manifest["config"]
    bad = []
    for r in tr.outcome.itertuples():
        e = tr.evals[tr.evals["run"] == r.run].sort_values("step")
        if r.stop_reason not in STOP_REASONS and not str(r.stop_reason).startswith("error: "):
            bad.append(f"{r.run}: unknown stop reason {r.stop_reason!r}")
        if e["step"].max() != r.steps and not str(r.stop_reason).startswith("error: "):
            bad.append(f"{r.run}: last evaluation at {e['step'].max()}, not at the final step {r.steps}")
        if r.stop_reason == "plateau":
            p = cfg["patience"]
            scores = e[e["step"] % cfg["eval_every"] == 0]["mrr10"].to_numpy()
            if len(scores) <= p or scores[-p:].max() - cfg["min_delta"] > _keras_best(scores[:-p], cfg["min_delta"]):
                bad.append(f"{r.run}: labelled plateau, but its last {p} evaluations improved on the best")
        elif r.stop_reason == "max_steps" and r.steps != cfg["max_steps"]:
            bad.append(f"{r.run}: labelled max_steps at step {r.steps}")
        elif r.stop_reason in ("deadline", "signal") and r.steps >= cfg["max_steps"]:
            bad.append(f"{r.run}: labelled {r.stop_reason} but reached max_steps")
    return bad


def _keras_best(scores, min_delta: float) -> float:
    best = -np.inf
    for s in scores:
        if s - min_delta > best:
            best = s
    return best


def pooled(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["group"] == POOLED].reset_index(drop=True)


def final_by_module_type(tr: Trained) -> pd.DataFrame:
    """The final-step collapse rows of the standard runs per module type (pooled rows left out)."""
    c = tr.collapse
    return c[c["final"] & (c["group"] != POOLED) & c["variant"].eq("standard")].reset_index(drop=True)


def final_pivot(tr: Trained) -> pd.DataFrame:
    """The closing-note table: pooled fractions at each run's final step, per (variant, rank, lr) x format."""
    f = pooled(tr.collapse[tr.collapse["final"]])
    f = f.merge(tr.outcome[["run", "steps", "stop_reason"]], on="run")
    keep = ["variant", "rank", "lr", "steps", "stop_reason", "format", "g_std", "frac_rounds_to_one",
            "frac_symmetric_zone", "absorption"]
    return f[keep].sort_values(["format", "variant", "lr", "rank"]).reset_index(drop=True)


def paper_beside(tr: Trained) -> pd.DataFrame:
    """The paper's real adapter beside ours at the final step (bf16 and fp16, the paper's symmetric zone,
    and the exact zone it does not report), with what differs: task, model size, lr, steps."""
    rows = [{**PAPER_ADAPTER, "format": fmt, "frac_symmetric_zone": PAPER_ADAPTER[f"{fmt}_frac_symmetric_zone"],
             "frac_rounds_to_one": np.nan} for fmt in ("bf16", "fp16")]
    f = final_pivot(tr)
    for r in f[f["format"].isin(["bf16", "fp16"])].itertuples():
        rows.append({"source": f"ours: MiniLM-L6, r={r.rank} ({r.variant})", "model_params": "22.7M", "modules": 36,
                     "n_g": 20_736, "task": "contrastive retrieval (stdlib docstrings)", "lr": r.lr, "steps": r.steps,
                     "g_std": r.g_std, "format": r.format, "frac_symmetric_zone": r.frac_symmetric_zone,
                     "frac_rounds_to_one": r.frac_rounds_to_one})
    cols = ["source", "model_params", "modules", "n_g", "task", "lr", "steps", "format", "g_std",
            "frac_symmetric_zone", "frac_rounds_to_one"]
    return pd.DataFrame(rows)[cols]


def normal_zone_fraction(std: float, fmt, mean: float = 1.0) -> float:
    """The fraction of ``g ~ N(mean, std^2)`` inside the paper's symmetric zone ``|g - 1| < eps/2`` of
    ``fmt``: what a fraction would be if ``g`` were normal with that spread (a prediction from ``std`` alone)."""
    from scipy.stats import norm

    from ...numerics.formats import get_format

    h = get_format(fmt).eps / 2
    return float(norm.cdf(1 + h, mean, std) - norm.cdf(1 - h, mean, std))


def paper_markdown(tr: Trained) -> str:
    """The paper's adapter beside ours, in words, from the numbers: how much of each fraction std(g) alone
    predicts (a normal g of that spread), for the paper's std and for ours, and where our runs sit."""
    f = final_pivot(tr)
    c = tr.collapse[tr.collapse["final"] & (tr.collapse["group"] == POOLED)].set_index(["run", "format"])
    std_runs = tr.outcome[tr.outcome["variant"] == "standard"]
    ps = PAPER_ADAPTER["g_std"]
    pred = {fmt: normal_zone_fraction(ps, fmt) for fmt in ("bf16", "fp16")}
    lines = [f"**The paper's fractions follow from its spread.** A normal $g$ with the paper's std {ps:g} would have "
             f"{pred['bf16']:.1%} of its values in the bf16 symmetric zone and {pred['fp16']:.1%} in fp16's; the paper "
             f"reports {PAPER_ADAPTER['bf16_frac_symmetric_zone']:.0%} and {PAPER_ADAPTER['fp16_frac_symmetric_zone']:.0%}."]
    rows, above = [], 0
    for r in std_runs.sort_values(["lr", "rank"]).itertuples():
        b, h = c.loc[(r.run, "bf16")], c.loc[(r.run, "fp16")]
        above += bool(b.frac_symmetric_zone > normal_zone_fraction(b.g_std, "bf16", b.g_mean))
        rows.append(f"| r={r.rank}, lr {r.lr:g} | {r.steps} | {b.g_std:.2e} | {b.frac_symmetric_zone:.1%} | "
                    f"{normal_zone_fraction(b.g_std, 'bf16', b.g_mean):.1%} | {h.frac_symmetric_zone:.1%} | "
                    f"{normal_zone_fraction(h.g_std, 'fp16', h.g_mean):.1%} |")
    lines.append("**Ours, at the final step** (standard runs; *normal*: the fraction a normal $g$ with the run's "
                 "mean and std would have):\n\n| run | steps | std(g) | bf16 sym. | bf16 normal | fp16 sym. | "
                 "fp16 normal |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    lines.append(f"In {above} of {len(rows)} runs more of $g$ lies in the bf16 zone than a normal of the same std would "
                 "put there: $g$ is more concentrated near 1 than a normal, with heavier tails carrying the std. The "
                 "std is still the first-order predictor, for the paper's adapter as for ours.")
    s = f[(f["format"] == "bf16") & (f["variant"] == "standard")]
    closest = s.iloc[(s["g_std"] - ps).abs().argmin()]
    lines.append(f"Our spreads run from {s['g_std'].min():.2e} to {s['g_std'].max():.2e}: {s['g_std'].min() / ps:.1f} to "
                 f"{s['g_std'].max() / ps:.0f} times the paper's. The closest, r={closest['rank']}, lr "
                 f"{closest['lr']:g} (std {closest['g_std']:.2e}, {closest['steps']} steps), has "
                 f"{closest['frac_symmetric_zone']:.1%} of $g$ in the bf16 symmetric zone.")
    return "\n\n".join(lines)


U64 = 2.0**-53


def float64_g_bound(g: np.ndarray, rank: int, d_in: int = 1536) -> np.ndarray:
    """Bound on ``|g_fp64 - g|`` for ``g = m / ||W + sBA||`` with the norm evaluated densely in float64:
    relative ``(r + d_in + 2) u_64`` for the norm (:func:`dora_num.adapters.collapse.g_exact`) plus one
    rounding of the quotient."""
    return np.abs(g) * ((rank + d_in + 2) * U64 + U64)


def _near_zone_ends(g: np.ndarray, fmt, width: np.ndarray) -> int:
    from ...numerics.collapse import exact_zone
    from ...numerics.formats import get_format

    f = get_format(fmt)
    ends = np.array([*exact_zone(f), 1.0 - f.eps / 2, 1.0 + f.eps / 2])
    return int((np.abs(g[:, None] - ends[None, :]).min(axis=1) <= width).sum())


def _table_with_margins(g: dict[str, np.ndarray], bound: dict[str, np.ndarray], acts, formats) -> pd.DataFrame:
    df = collapse_table(g, formats, activations=acts)
    allg, allb = np.concatenate([g[n] for n in sorted(g)]), np.concatenate([bound[n] for n in sorted(g)])
    near, bmax = [], []
    for r in df.itertuples():
        gg, bb = (allg, allb) if r.module == POOLED else (g[r.module], bound[r.module])
        near.append(_near_zone_ends(gg, r.format, 2 * bb))  # the recorded g's error and dora-num collapse's
        bmax.append(float(bb.max()))
    return df.assign(g_abs_error_bound=bmax, n_near_zone_end=near)


def _rel(p: Path) -> str:
    from ...repro.paths import REPO_ROOT

    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(Path(p).resolve())


def exported_tables(tr: Trained, work=None, *, n_texts=None, max_rows=None, formats=NARROW_FORMATS) -> pd.DataFrame:
    """Per exported adapter of the record: its collapse table as ``dora-num collapse`` prints it (per module
    and pooled), from the recorded ``g`` of the state that was exported, with ``g_abs_error_bound`` (the
    recorded g's error against the exact g) and ``n_near_zone_end`` (rows within twice that of a zone end:
    where a count could differ from another correct float64 evaluation).  ``n_texts``/``max_rows``: the
    activations (``None`` or 0: ``dora-num collapse``'s defaults).  ``work``: where the bf16-rounded base is
    rebuilt when the runs used it (45 MB; default: a temporary folder)."""
    if work is None:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dora-num-01-") as tmp:
            return exported_tables(tr, Path(tmp), n_texts=n_texts, max_rows=max_rows, formats=formats)
    from ...adapters.peft_io import read_config

    exp = tr.exported()
    if not exp:
        raise ValueError(f"the record in {tr.folder} has no exported adapter")
    acts = activations_for(base_for_record(tr, work), n_texts=n_texts, max_rows=max_rows)
    frames = []
    for name, d in exp.items():
        r = read_config(d)["r"]
        with np.load(d / TRAINED.filename("export_capture"), allow_pickle=False) as z:
            off, mods = z["offsets"], [str(n) for n in z["modules"]]
            gall = z["m"].astype(np.float64) / z["wnorm64"]
        g = {n: gall[off[j]:off[j + 1]] for j, n in enumerate(mods)}
        b = {n: float64_g_bound(v, r) for n, v in g.items()}
        frames.append(_table_with_margins(g, b, acts, formats).assign(
            adapter=_rel(d), base=tr.manifest["base"]["kind"], g_source="recorded capture: m / wnorm64 (float64)"))
    df = pd.concat(frames, ignore_index=True)
    return df[["adapter", "base", "g_source"] + [c for c in df.columns if c not in ("adapter", "base", "g_source")]]


def step0(tr: Trained) -> pd.DataFrame:
    """The state at step 0 per run (``manifest.json: step0``, :func:`.ingest_trained.step0_table`): where the
    layer's ``g`` was not exactly 1 at init, and by how much."""
    if "step0" not in tr.manifest:
        raise ValueError(f"{TRAINED.path('manifest', tr.folder)} has no step0 table: re-ingest the record")
    cols = ["run", "role", "rows", "rows_m_ne_wnorm", "m_minus_wnorm_ulps", "rows_layer_g_ne_1", "layer_g_minus_1_min",
            "layer_g_minus_1_max", "params_abs_g_minus_1_max"]
    return pd.DataFrame(tr.manifest["step0"])[cols]


def headline(tr: Trained) -> dict:
    """What notebook 01 asserts and reports about the trained adapters."""
    o = outcome(tr)
    std = o[o["variant"] == "standard"]
    fin = final_pivot(tr)
    return {
        "runs": int(len(o)), "stop_reasons": o["stop_reason"].value_counts().to_dict(),
        "steps_min_max": [int(o["steps"].min()), int(o["steps"].max())],
        "g_is_quotient": bool(all(v is not False for v in tr.outcome["g_is_quotient"])),
        "min_mrr10_gain_standard": float(std["mrr10_gain_best"].min()) if len(std) else float("nan"),
        "crosscheck": {k: v for k, v in tr.manifest["crosscheck"].items() if k != "criterion"},
        "final_bf16_exact_zone": {f"{r.variant} r={r.rank} lr={r.lr:g}": r.frac_rounds_to_one
                                  for r in fin[fin["format"] == "bf16"].itertuples()},
        "final_bf16_symmetric_zone": {f"{r.variant} r={r.rank} lr={r.lr:g}": r.frac_symmetric_zone
                                      for r in fin[fin["format"] == "bf16"].itertuples()},
        "final_g_std": {f"{r.variant} r={r.rank} lr={r.lr:g}": r.g_std
                        for r in fin[fin["format"] == "bf16"].itertuples()},
        "mrr10_base_best": {r.run: [r.mrr10_base, r.mrr10_best] for r in o.itertuples()},
        "step0": _step0_summary(tr),
    }


def _step0_summary(tr: Trained) -> dict:
    """The ``DoRALinear`` runs' (grid) step-0 state: the most rows whose layer g is not 1, and its range."""
    if "step0" not in tr.manifest:
        return {}
    s = step0(tr)
    s = s[s["role"] == "grid"]
    return {"rows": int(s["rows"].max()), "rows_layer_g_ne_1_max": int(s["rows_layer_g_ne_1"].max()),
            "layer_g_minus_1_min": float(s["layer_g_minus_1_min"].min()),
            "layer_g_minus_1_max": float(s["layer_g_minus_1_max"].max())}
