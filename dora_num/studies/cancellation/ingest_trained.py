"""Notebook 01's trained adapters: the raw record of a launch, and its ingest into the committed record.

A launch of :mod:`.record_trained` returns ``plan.json`` and ``part-K.tar``; :func:`ingest`
(``dora-num record adapters-gpu ingest``) unpacks them (optionally keeping everything: ``--keep``), checks
them, and writes the committed record (default ``data/adapters/trained/``) through
:func:`dora_num.repro.recording.ingest`: every file with a provenance sidecar in the recorded-data
vocabulary (the GPU machine's device, ``measured_at_git_sha``, ``measured_versions``, ...):

The method in full: docs/methods.md, studies/cancellation/ingest_trained.py.
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ...adapters.collapse import collapse_table
from ...numerics.formats import NARROW_FORMATS
from ...repro import recording
from .datasets import TRAINED
from .runs import (BF16_NORM_RMS_PREDICTED, COMMIT_MAX_RANK, CROSSCHECK_CRITERION, CROSSCHECK_FACTOR,
                   CROSSCHECK_FROM_STEP, MODULE_TYPES, RAW_FILES, ZONE_COLUMNS, Captures, activations_for, collapse_by_type,
                   compact_gm1, expand_gm1, module_type, resolve_base)

WINDOW = 50  # steps per row of history_windows.csv


# --------------------------------------------------------------------------
# A launch's raw record (what came back from the device)
# --------------------------------------------------------------------------


@dataclass
class RawRun:
    name: str
    info: dict  # run.json
    history: pd.DataFrame
    evals: pd.DataFrame
    captures: Captures
    folder: Path

    @property
    def final_step(self) -> int:
        """The last capture (the final state; earlier only if a run's final capture failed)."""
        return int(self.info.get("final_capture_step", self.info["steps"]))


@dataclass
class RawRecord:
    plan: dict
    runs: dict[str, RawRun]
    missing: list[str]
    folder: Path


def unpack(files: Path, into: Path) -> Path:
    """Extract ``files/part-*.tar`` into ``into`` (tar's ``data`` filter: no links, nothing outside)."""
    parts = sorted(Path(files).glob("part-*.tar"))
    if not parts:
        raise FileNotFoundError(f"no part-*.tar in {files} (the output folder of a record_trained launch)")
    into.mkdir(parents=True, exist_ok=True)
    for p in parts:
        with tarfile.open(p) as tar:
            tar.extractall(into, filter="data")
    return into


def load_raw(folder: Path) -> RawRecord:
    """The unpacked record: ``plan.json`` and ``runs/<name>/``; runs of the plan without a complete
    folder are listed in ``missing``."""
    folder = Path(folder)
    plan = json.loads((folder / "plan.json").read_text())
    runs, missing = {}, []
    for spec in plan["plan"]:
        d = folder / "runs" / spec["name"]
        need = [d / RAW_FILES[k] for k in ("info", "history", "evals", "captures")]
        if not all(p.is_file() for p in need):
            missing.append(spec["name"])
            continue
        runs[spec["name"]] = RawRun(spec["name"], json.loads(need[0].read_text()), pd.read_csv(need[1]),
                                    pd.read_csv(need[2]), Captures.load(need[3]), d)
    return RawRecord(plan, runs, missing, folder)


def run_labels(info: dict) -> dict:
    s = info["spec"]
    variant = ("PEFT" if s["backend"] == "peft" else "m + 1 ulp" if s["perturbed"] else
               "rsLoRA" if s["use_rslora"] else "standard")
    return {"run": info["name"], "rank": s["rank"], "lr": s["lr"], "variant": variant, "role": info["role"],
            "scale": info["scale"]}


# --------------------------------------------------------------------------
# Collapse statistics per module type
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Cross-check
# --------------------------------------------------------------------------

def crosscheck_table(runs: dict[str, RawRun]) -> pd.DataFrame:
    """Per common capture step, module type (+ ``all``) and g (``layer``, ``params``): RMS and max of
    ``g_peft - g_ours`` and ``g_ulp - g_ours``, their ratio and whether it meets the criterion."""
    peft = next((r for r in runs.values() if r.info["role"] == "peft_twin"), None)
    ulp = next((r for r in runs.values() if r.info["role"] == "ulp_twin"), None)
    if peft is None or ulp is None:
        return pd.DataFrame()
    key = {k: peft.info["spec"][k] for k in ("rank", "lr", "use_rslora", "alpha")}
    ours = next((r for r in runs.values() if r.info["role"] == "grid"
                 and all(r.info["spec"][k] == v for k, v in key.items())), None)
    if ours is None:
        return pd.DataFrame()
    common = sorted(set(ours.captures.steps.tolist()) & set(peft.captures.steps.tolist())
                    & set(ulp.captures.steps.tolist()))
    rows = []
    for step in common:
        for kind in ("layer", "params"):
            get = (lambda r: r.captures.g_layer(step)) if kind == "layer" else (lambda r: r.captures.g_params(step))
            go, gp, gu = get(ours), get(peft), get(ulp)
            groups = {"all": sorted(go)} | {t: [n for n in sorted(go) if module_type(n) == t] for t in MODULE_TYPES}
            for grp, names in groups.items():
                if not names:
                    continue
                dp = np.concatenate([gp[n] - go[n] for n in names])
                du = np.concatenate([gu[n] - go[n] for n in names])
                rp, ru = float(np.sqrt(np.mean(dp**2))), float(np.sqrt(np.mean(du**2)))
                rows.append({"step": step, "g": kind, "group": grp, "rms_peft": rp, "rms_ulp": ru,
                             "max_peft": float(np.abs(dp).max()), "max_ulp": float(np.abs(du).max()),
                             "ratio": rp / ru if ru > 0 else (0.0 if rp == 0 else np.inf)})
    df = pd.DataFrame(rows)
    df["judged"] = df["step"] >= CROSSCHECK_FROM_STEP
    df["meets"] = df["ratio"] <= CROSSCHECK_FACTOR
    return df


def crosscheck_verdict(table: pd.DataFrame, bf16_input_types=()) -> dict:
    """:data:`CROSSCHECK_CRITERION` applied to :func:`crosscheck_table`.  ``bf16_input_types``: the
    module types whose input PEFT's forward sees in bf16 (from its run's recorded input dtypes)."""
    if table.empty:
        return {"criterion": CROSSCHECK_CRITERION, "ran": False}
    j = table[table["judged"]]
    out = {"criterion": CROSSCHECK_CRITERION, "ran": True, "steps": sorted(j["step"].unique().tolist()),
           "bf16_input_types": sorted(bf16_input_types)}
    judged = {"params": j[(j["g"] == "params") & (j["group"] != "all")],
              "layer_fp32_inputs": j[(j["g"] == "layer") & (j["group"] != "all") & ~j["group"].isin(bf16_input_types)]}
    for key, sub in judged.items():
        out[f"agree_g_{key}"] = bool(len(sub) and sub["meets"].all())
        out[f"worst_ratio_g_{key}"] = float(sub["ratio"].max()) if len(sub) else None
        out[f"failing_g_{key}"] = sorted({f"{r.group}@{r.step}" for r in sub[~sub["meets"]].itertuples()})
    at0 = table[(table["step"] == 0) & (table["g"] == "layer") & table["group"].isin(bf16_input_types)]
    out["peft_bf16_norm_rms_step0"] = {r.group: r.rms_peft for r in at0.itertuples()}
    out["peft_bf16_norm_rms_predicted"] = BF16_NORM_RMS_PREDICTED
    return out


def bf16_input_types(runs: dict[str, RawRun]) -> list[str]:
    """Module types whose input the PEFT twin's forward saw in bf16 (all layers alike)."""
    peft = next((r for r in runs.values() if r.info["role"] == "peft_twin"), None)
    if peft is None:
        return []
    return sorted({module_type(n) for n, dt in peft.info["input_dtypes"].items() if dt == "bfloat16"})


# --------------------------------------------------------------------------
# Tables of a raw record
# --------------------------------------------------------------------------

def collapse_over_training(runs: dict[str, RawRun], formats=NARROW_FORMATS, activations: dict | None = None,
                           log=None) -> pd.DataFrame:
    """:func:`collapse_by_type` of ``g = m / wnorm64`` at every capture of every run (tidy)."""
    frames = []
    for name, r in sorted(runs.items()):
        for step in r.captures.steps.tolist():
            df = collapse_by_type(r.captures.g_params(step), formats, activations)
            frames.append(df.assign(**run_labels(r.info), step=int(step), final=int(step) == r.final_step))
        if log:
            log(f"collapse tables: {name}")
    df = pd.concat(frames, ignore_index=True)
    first = ["run", "rank", "lr", "variant", "role", "scale", "step", "final", "group", "format"]
    return df[first + [c for c in df.columns if c not in first]]


def history_windows(runs: dict[str, RawRun], window: int = WINDOW) -> pd.DataFrame:
    frames = []
    for name, r in sorted(runs.items()):
        h = r.history.assign(window=(r.history["step"] - 1) // window)
        agg = h.groupby("window").agg(step_lo=("step", "min"), step_hi=("step", "max"), loss_mean=("loss", "mean"),
                                      loss_min=("loss", "min"), loss_max=("loss", "max"),
                                      grad_norm_mean=("grad_norm", "mean"), lr=("lr", "last"),
                                      seconds_median=("seconds", "median"),
                                      seconds_p90=("seconds", lambda s: float(np.quantile(s, 0.9))))
        frames.append(agg.reset_index(drop=True).assign(run=name))
    df = pd.concat(frames, ignore_index=True)
    return df[["run"] + [c for c in df.columns if c != "run"]]


def outcome_table(runs: dict[str, RawRun]) -> pd.DataFrame:
    rows = []
    for name, r in sorted(runs.items()):
        i = r.info
        rows.append({**run_labels(i), "stop_reason": i["stop_reason"], "steps": i["steps"], "best_step": i["best_step"],
                     "mrr10_base": i["mrr10_base"], "mrr10_best": i["best_mrr10"], "mrr10_final": i["mrr10_final"],
                     "val_loss_base": i["val_loss_base"], "val_loss_final": i["val_loss_final"],
                     "s_per_step": i["median_s_per_step"], "build_s": i["build_s"], "train_s": i["train_s"],
                     "g_is_quotient": i["g_is_quotient"], "compose_path": i["compose_path"],
                     "fused_training_calls": i["dispatch_counts"].get("fused_training", 0)})
    return pd.DataFrame(rows)


def _final_gm1(runs: dict[str, RawRun]) -> tuple[list[str], np.ndarray]:
    """The grid runs' names and their final ``m / wnorm64 - 1`` (float64 ``[n, rows]``)."""
    names = sorted(n for n, r in runs.items() if r.info["role"] == "grid")
    rows = []
    for n in names:
        c, i = runs[n].captures, runs[n].captures.row(runs[n].final_step)
        rows.append(c.m[i].astype(np.float64) / c.wnorm64[i] - 1.0)
    return names, np.stack(rows)


def g_final_npz(runs: dict[str, RawRun]) -> bytes:
    """``runs [n]``, ``steps [n]`` (each run's final capture), ``modules``, ``offsets`` and
    :func:`~.runs.compact_gm1` of ``m / wnorm64 - 1`` (``gm1`` float32 ``[n, rows]``, ``exact_idx``,
    ``exact_gm1``); the grid runs only (the twins' final states are in ``crosscheck.csv`` and
    ``collapse.csv.gz``)."""
    import io

    names, gm1 = _final_gm1(runs)
    buf = io.BytesIO()
    np.savez_compressed(buf, runs=np.asarray(names), steps=np.asarray([runs[n].final_step for n in names]),
                        modules=np.asarray(runs[names[0]].captures.modules),
                        offsets=runs[names[0]].captures.offsets, **compact_gm1(gm1))
    return buf.getvalue()


def compact_differences(runs: dict[str, RawRun], formats=NARROW_FORMATS) -> list[dict]:
    """Zone counts of ``g_final.npz``'s compact ``g - 1`` (as :func:`~.trained.load_trained` expands it)
    that differ from those of the full-precision ``m / wnorm64`` (per run, module, format; empty when the
    compact form loses nothing counted, which :func:`~.runs.compact_gm1` is built to ensure)."""
    bad = []
    names, gm1 = _final_gm1(runs)
    expanded = expand_gm1(**compact_gm1(gm1))
    for k, name in enumerate(names):
        r = runs[name]
        exact = r.captures.split(1.0 + gm1[k])
        compact = r.captures.split(1.0 + expanded[k])
        a, b = collapse_table(exact, formats), collapse_table(compact, formats)
        for col in ZONE_COLUMNS:
            diff = a[col] != b[col]
            bad += [{"run": name, "module": a.loc[i, "module"], "format": a.loc[i, "format"], "column": col,
                     "exact": float(a.loc[i, col]), "compact": float(b.loc[i, col])}
                    for i in np.flatnonzero(diff.to_numpy())]
    return bad


ULP_BINS = 3  # step0_table: m - wnorm distances up to this many ulps counted one by one


def _ulps_apart(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Signed distance ``a - b`` in fp32 ulps, for positive finite float32 ``a``, ``b`` (their bit patterns
    are then ordered like their values)."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    if not (np.isfinite(a).all() and np.isfinite(b).all() and (a > 0).all() and (b > 0).all()):
        raise ValueError("ulp distances are defined here for positive finite float32 values only")
    return a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)


def step0_table(runs: dict[str, RawRun]) -> pd.DataFrame:
    """Per run, its capture at step 0: rows, rows where ``m != wnorm`` (the layer's own fp32 norm: what its
    forward divides by), ``m - wnorm`` in fp32 ulps (``m_minus_wnorm_ulps``: ``{ulps: rows}``, each distance up to
    :data:`ULP_BINS` on its own, larger ones in two bins; empty bins left out), rows where the
    layer's ``g = fl32(m / wnorm)`` is not 1, its ``g - 1`` range, and ``max |m / wnorm64 - 1|`` (the
    parameters' g in float64).  For the PEFT twin ``wnorm`` is PEFT's norm (bf16 where its input is bf16);
    the ulp twin's ``m`` is moved by one ulp on purpose."""
    rows = []
    for name, r in sorted(runs.items()):
        c = r.captures
        if 0 not in c.steps.tolist():
            continue
        i = c.row(0)
        m, wn = c.m[i], c.wnorm[i]
        d = _ulps_apart(m, wn)
        gl = (m / wn).astype(np.float64) - 1.0  # IEEE fp32 quotient, as the layer forms it
        hist = {f"<-{ULP_BINS}": int((d < -ULP_BINS).sum())}
        hist |= {str(k): int((d == k).sum()) for k in range(-ULP_BINS, ULP_BINS + 1)}
        hist[f">{ULP_BINS}"] = int((d > ULP_BINS).sum())
        rows.append({"run": name, "role": r.info["role"], "rows": int(m.size), "rows_m_ne_wnorm": int((d != 0).sum()),
                     "m_minus_wnorm_ulps": {k: v for k, v in hist.items() if v},
                     "rows_layer_g_ne_1": int((gl != 0).sum()), "layer_g_minus_1_min": float(gl.min()),
                     "layer_g_minus_1_max": float(gl.max()),
                     "params_abs_g_minus_1_max": float(np.abs(m.astype(np.float64) / c.wnorm64[i] - 1.0).max())})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------
# Ingest
# --------------------------------------------------------------------------

def _brief(info: dict) -> dict:
    """``run.json`` for the manifest: input dtypes per module type (they are the same in every layer)."""
    out = dict(info)
    by_type: dict[str, set] = {}
    for n, dt in (info.get("input_dtypes") or {}).items():
        by_type.setdefault(module_type(n), set()).add(dt)
    out["input_dtypes"] = {t: "/".join(sorted(v)) for t, v in by_type.items()}
    return out


def ingest(files: Path, dest: Path, *, git_sha: str | None = None, keep=None, n_texts: int | None = None,
           max_rows: int | None = None, replace: bool = False, notes=(), log=print) -> list[Path]:
    """Unpack a launch (``files``: ``plan.json`` + ``part-K.tar``), check it, and write the committed
    record into ``dest`` (docs/methods.md); with ``keep``, the full record stays unpacked there.
    ``n_texts``/``max_rows``: the absorption activations (default: ``dora-num collapse``'s).  A ``dest``
    that already holds files is refused unless ``replace`` (then it is emptied first: no stale file of
    an earlier record survives beside the new one).  ``notes``: what a reader of the record must know
    that the files do not say (e.g. a property of the commit that ran), kept in ``manifest.json`` and in
    every sidecar."""
    import io
    import shutil

    from ...repro.provenance import sha256_file

    files, dest = Path(files), Path(dest)
    if dest.is_dir() and any(dest.iterdir()):
        if not replace:
            raise FileExistsError(f"{dest} already holds a record: pass replace=True (--replace) to overwrite it")
        shutil.rmtree(dest)
    tmp = Path(tempfile.mkdtemp(prefix="dora-num-ingest-"))
    try:
        root = unpack(files, Path(keep) if keep else tmp / "record")
        rec = load_raw(root)
        if not rec.runs:
            raise ValueError(f"no complete run in {files} (missing: {rec.missing})")
        bases = {r.info["base"]["fingerprint"] for r in rec.runs.values()}
        if len(bases) != 1:
            raise ValueError(f"the runs used different base weights: {sorted(bases)}")
        first = next(iter(rec.runs.values()))
        base_dir = resolve_base(first.info["base"], tmp)
        log(f"{len(rec.runs)} runs (missing: {rec.missing or 'none'}); base {first.info['base']['kind']} ok")
        parts = {p.name: p for p in sorted(files.glob("part-*.tar"))}
        sha = git_sha or rec.plan.get("git_sha")
        acts = activations_for(base_dir, n_texts=n_texts, max_rows=max_rows)
        collapse = collapse_over_training(rec.runs, activations=acts, log=log)
        cross = crosscheck_table(rec.runs)
        verdict = crosscheck_verdict(cross, bf16_input_types(rec.runs))
        diffs = compact_differences(rec.runs)
        outcome = outcome_table(rec.runs)
        step0 = step0_table(rec.runs)
        notes = [str(n) for n in notes]
        name_of = TRAINED.relpath
        artifacts = {
            name_of("evals"): pd.concat([r.evals.assign(run=n) for n, r in sorted(rec.runs.items())])[
                ["run", "step", "mrr10", "val_loss", "seconds"]],
            name_of("history_windows"): history_windows(rec.runs), name_of("collapse"): collapse,
            name_of("g_final"): g_final_npz(rec.runs)}
        if not cross.empty:
            artifacts[name_of("crosscheck")] = cross
        exported = {}
        for name, r in sorted(rec.runs.items()):
            adir = r.folder / "adapter"
            if not (adir / "adapter_config.json").is_file():
                continue
            size = sum(p.stat().st_size for p in adir.iterdir() if p.is_file() and not p.name.endswith(".json"))
            committed = r.info["spec"]["rank"] <= COMMIT_MAX_RANK
            exported[name] = {"bytes": size, "committed": committed}
            if not committed:
                continue
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                artifacts[f"exported/{name}/{f}"] = adir / f
            i = r.captures.row(r.final_step)
            buf = io.BytesIO()
            np.savez_compressed(buf, modules=np.asarray(r.captures.modules), offsets=r.captures.offsets,
                                step=np.int64(r.final_step), m=r.captures.m[i], wnorm=r.captures.wnorm[i],
                                wnorm64=r.captures.wnorm64[i])
            artifacts[f"exported/{name}/{TRAINED.filename('export_capture')}"] = buf.getvalue()
        artifacts[name_of("manifest")] = {  # written last: a record without its manifest is refused by load_trained
            "plan_name": rec.plan["plan_name"], "plan": rec.plan["plan"], "config": rec.plan["config"],
            "prediction": rec.plan["prediction"], "wall_s": rec.plan["wall_s"], "elapsed_s": rec.plan.get("elapsed_s"),
            "processes": {k: {"returncode": v["returncode"], "wall_s": v["wall_s"]}
                          for k, v in rec.plan["processes"].items()},
            "missing_runs": rec.missing, "runs": {n: _brief(r.info) for n, r in sorted(rec.runs.items())},
            "outcome": outcome.to_dict(orient="records"), "crosscheck": verdict,
            "step0": step0.to_dict(orient="records"), "notes": notes,
            "compact_certified": not diffs, "compact_differences": diffs[:50],
            "exported": exported, "base": first.info["base"], "git_sha": sha,
            "absorption_activations": {"n_texts": n_texts, "max_rows": max_rows, "dtype": "float64",
                                       "note": "None: dora-num collapse's defaults"},
            "parts": {k: sha256_file(p) for k, p in parts.items()},
            "left_out": {"captures": f"m, wnorm, wnorm64 of every capture (runs/<name>/{RAW_FILES['captures']})",
                         "history": f"per-step loss, gradient norm, lr, seconds (runs/<name>/{RAW_FILES['history']})",
                         "adapters": [n for n, e in exported.items() if not e["committed"]],
                         "bytes": int(sum(p.stat().st_size for p in root.rglob("*") if p.is_file())),
                         "regenerate": TRAINED.how_to_record},
        }
        # One vocabulary of provenance keys (dora_num.repro.recording): the GPU machine's device and
        # versions from a run's own sidecar, the commit it ran, the archives it came back in.
        return recording.ingest(artifacts, dest, machine=recording.machine_from_sidecar(first.folder / RAW_FILES["info"]),
                                producer=TRAINED.producer,
                               git_sha=sha, params=rec.plan["config"], seed=rec.plan["config"]["seed"],
                               extra={"plan": rec.plan["plan_name"], **({"notes": notes} if notes else {})},
                               sources=[files], inputs=parts,
                               float_formats={name_of("evals"): "%.9g", name_of("history_windows"): "%.9g"})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
