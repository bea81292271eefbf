"""Notebook 01's trained adapters, recorded: ingest of a launch, the committed record, its analysis.

A launch of :mod:`.gpu_training` returns ``plan.json`` and ``part-K.tar``; :func:`ingest` unpacks them
(optionally keeping everything: ``--keep``), checks them, and writes the committed record (default
``data/adapters/trained/``), every file with a provenance sidecar whose device and versions are the GPU
machine's:

====================================  ========================================================================
``manifest.json``                     plan, configuration, prediction, per run: why and where it stopped,
                                      MRR@10 base/best/final, time per step; the cross-check verdict; what
                                      is committed and what is left out
``evals.csv``                         run, step, mrr10, val_loss (every evaluation)
``history_windows.csv``               per run and 50-step window: loss mean/min/max, gradient norm, seconds
``collapse.csv.gz``                   per run x capture step x module type (+ pooled) x format: the
                                      collapse statistics of :func:`dora_num.adapters.collapse.collapse_table`
                                      of ``g = m / wnorm64`` (absorption on real activations included)
``g_final.npz``                       per run, ``g - 1`` (float32) at its final capture, every row
``crosscheck.csv``                    PEFT and the 1-ulp twin against ``DoRALinear``, per step and module type
``exported/<run>/``                   the final adapter in PEFT format, with ``final_capture.npz``
                                      (``m``, ``wnorm``, ``wnorm64`` of that state)
====================================  ========================================================================

Left out (``--keep`` has them; the GPU command regenerates them): every capture's ``m``, ``wnorm``,
``wnorm64`` (16 bytes per row: 13 runs x 8 captures x 20,736 rows = 34.5 MB), the per-step history
(~1.3 MB), adapters above r = 16 (r = 64: 10.6 MB).

**g.** ``g = m / wnorm64`` (fp32 ``m`` over the float64 dense norm): the ``g`` of the adapter's
parameters, what ``dora-num collapse`` computes from an exported file, and within a few fp32 ulps of the
``g`` the layer itself uses (``fl32(m / wnorm)``, its factored fp32 norm: both are recorded).  In
``g_final.npz`` it is stored as float32 ``g - 1`` (relative error ``2^-24`` of ``g - 1``, ~1e-10 absolute);
:func:`ingest` checks that every zone count computed from that form equals the one from the full
precision record (``manifest.json: compact_certified``).

**Cross-check** (:data:`CROSSCHECK_CRITERION`, stated before the device run): the r = 16, lr 1e-3
configuration ran three times with the same init, batch order and dropout stream: ``DoRALinear``, PEFT's
DoRA, and ``DoRALinear`` with every initial ``m`` moved by one fp32 ulp (random signs).  The last measures
how far two equally valid executions of the same training drift apart (in the convergence study's H200
runs the loss difference of such twins reached its plateau level, ~1.1e-3, by steps 11-30).  Per module
type and capture step from 30 on: ``RMS(g_PEFT - g_ours) <= 2 RMS(g_ulp - g_ours)``, for the ``g`` each
layer's forward uses (the verdict) and for ``g`` of the parameters (reported beside it).
"""

from __future__ import annotations

import json
import re
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ...adapters.collapse import FORMATS, POOLED, collapse_table

MODULE_TYPES = ("q", "k", "v", "o", "intermediate", "output")
_TYPE_RE = (("q", r"attention\.self\.query$"), ("k", r"attention\.self\.key$"), ("v", r"attention\.self\.value$"),
            ("o", r"attention\.output\.dense$"), ("intermediate", r"intermediate\.dense$"),
            ("output", r"(?<!attention\.)output\.dense$"))
COMMIT_MAX_RANK = 16  # exported adapters committed up to this rank (r = 16: 2.75 MB; r = 64: 10.6 MB)
WINDOW = 50  # steps per row of history_windows.csv
CROSSCHECK_FACTOR = 2.0  # same-dtype-baseline convention (train_adapters.AGREEMENT_FACTOR)
CROSSCHECK_FROM_STEP = 30
# Where PEFT's input is bf16 its forward divides by a norm rounded to bf16; predicted RMS of the relative
# rounding error (uniform in +-2^-8 x the spacing, values spread log-uniformly over an octave):
# 2^-8 / sqrt(3) * sqrt(E[1/v^2]), E[1/v^2] = (1/2 - 1/8) / ln 2 for v in [1, 2).
BF16_NORM_RMS_PREDICTED = 2.0**-8 / 3**0.5 * ((0.5 - 0.125) / np.log(2)) ** 0.5
CROSSCHECK_CRITERION = (f"per module type and every common capture step >= {CROSSCHECK_FROM_STEP}: "
                        f"RMS(g_peft - g_ours) <= {CROSSCHECK_FACTOR:g} x RMS(g_ulp - g_ours), for g of the trained "
                        "parameters (m / float64 norm) in every module type, and for the g each layer's forward "
                        "divides by in the module types whose input PEFT sees in fp32; where PEFT's input is bf16 "
                        "its forward divides by a norm rounded to bf16: predicted RMS(g_peft - g_ours) = "
                        f"{BF16_NORM_RMS_PREDICTED:.2e} at step 0")
RECORD_COMMAND = ("on the H200: python3 -m dora_num.studies.cancellation.gpu_training launch --out $OUT "
                  "--base .carry/minilm; then: python -m dora_num.studies.cancellation.gpu_training ingest "
                  "FILES_DIR --dest data/adapters/trained --git-sha SHA")
ZONE_COLUMNS = ("frac_symmetric_zone", "frac_rounds_to_one", "frac_below_one_symmetric",
                "frac_below_one_rounds_to_one")


def module_type(name: str) -> str:
    """``q``, ``k``, ``v``, ``o`` (attention output), ``intermediate`` or ``output`` of a MiniLM linear."""
    for t, pat in _TYPE_RE:
        if re.search(pat, name):
            return t
    raise ValueError(f"{name!r} is not one of MiniLM's encoder linears")


# --------------------------------------------------------------------------
# A launch's raw record (what came back from the device)
# --------------------------------------------------------------------------

@dataclass
class Captures:
    """One run's captures (:func:`~.gpu_training.captures_npz`)."""

    steps: np.ndarray
    modules: list[str]
    offsets: np.ndarray
    m: np.ndarray  # float32 [k, rows]
    wnorm: np.ndarray  # float32
    wnorm64: np.ndarray  # float64
    g_is_quotient: np.ndarray

    @classmethod
    def load(cls, path) -> "Captures":
        with np.load(path, allow_pickle=False) as z:
            return cls(z["steps"], [str(n) for n in z["modules"]], z["offsets"], z["m"], z["wnorm"], z["wnorm64"],
                       z["g_is_quotient"])

    def row(self, step: int) -> int:
        hit = np.flatnonzero(self.steps == step)
        if not hit.size:
            raise KeyError(f"no capture at step {step} (have {self.steps.tolist()})")
        return int(hit[0])

    def split(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {n: flat[self.offsets[j]:self.offsets[j + 1]] for j, n in enumerate(self.modules)}

    def g_params(self, step: int) -> dict[str, np.ndarray]:
        """``m / wnorm64`` (float64): the g of the adapter's parameters."""
        i = self.row(step)
        return self.split(self.m[i].astype(np.float64) / self.wnorm64[i])

    def g_layer(self, step: int) -> dict[str, np.ndarray]:
        """``fl32(m / wnorm)``: the g the layer's forward uses (IEEE fp32 division, as on the device)."""
        i = self.row(step)
        return self.split((self.m[i] / self.wnorm[i]).astype(np.float64))


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
        return int(self.info["steps"])


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
        raise FileNotFoundError(f"no part-*.tar in {files} (the output folder of a gpu_training launch)")
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
        need = [d / f for f in ("run.json", "history.csv.gz", "evals.csv", "captures.npz")]
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

def collapse_by_type(g_by_module: dict[str, np.ndarray], formats=FORMATS, activations: dict | None = None):
    """:func:`collapse_table` per MiniLM module type and pooled: statistics of the concatenated g;
    absorption as the activation-weighted mean of the per-module fractions (as the pooled row of
    ``collapse_table`` does)."""
    by_type: dict[str, list] = {}
    for n in sorted(g_by_module):
        by_type.setdefault(module_type(n), []).append(n)
    stats = collapse_table({t: np.concatenate([g_by_module[n] for n in ns]) for t, ns in by_type.items()}, formats)
    stats = stats.rename(columns={"module": "group"}).drop(columns=["absorption", "n_activations"])
    if activations is None:
        return stats.assign(absorption=np.nan, n_activations=0)
    per = collapse_table(g_by_module, formats, activations=activations)
    per = per[per["module"] != POOLED].assign(group=lambda d: d["module"].map(module_type))
    rows = []
    for (grp, fmt), sub in list(per.groupby(["group", "format"])) + [((POOLED, f), s) for f, s in per.groupby("format")]:
        w = sub["n_activations"].to_numpy()
        rows.append({"group": grp, "format": fmt, "n_activations": int(w.sum()),
                     "absorption": float(np.nansum(sub["absorption"].to_numpy() * w) / w.sum()) if w.sum() else np.nan})
    return stats.merge(pd.DataFrame(rows), on=["group", "format"], how="left")


def activations_for(base_dir, *, n_texts=None, max_rows=None, seed: int = 0) -> dict[str, np.ndarray]:
    """Real base activations ``x W^T`` of every encoder linear: what ``dora-num collapse`` uses
    (:func:`dora_num.adapters.collapse.analyse_adapter`'s defaults: validation summaries, a seeded
    sample of token rows, the base model evaluated in float64)."""
    import torch

    from ...adapters.collapse import ACTIVATION_ROWS, ACTIVATION_TEXTS, base_activations
    from ...adapters.corpus import load_corpus
    from ...adapters.model import encoder_linear_names, load_base_model

    model, tok = load_base_model(base_dir, dtype=torch.float64)
    texts = [p["summary"] for p in load_corpus(split="validation")[: n_texts or ACTIVATION_TEXTS]]
    return base_activations(model, tok, encoder_linear_names(model), texts, max_rows=max_rows or ACTIVATION_ROWS,
                            seed=seed)


def resolve_base(base: dict, workdir: Path) -> Path:
    """A local folder holding the base weights a run used (``run.json: base``), checked by sha256:
    the packaged MiniLM, or its bf16-rounded copy rebuilt by :func:`dora_num.studies.carry.write_minilm_bf16`."""
    from ...adapters.model import minilm_path
    from ...repro.provenance import sha256_file
    from ..carry import write_minilm_bf16

    if base["kind"] == "bf16-rounded":
        path = write_minilm_bf16(Path(workdir) / "minilm-bf16")
    else:
        path = minilm_path()
    got = sha256_file(path / "model.safetensors")
    if got != base["sha256"]:
        raise ValueError(f"the runs used base weights with sha256 {base['sha256']} ({base['kind']}); {path} has {got}: "
                         "cannot reproduce their activations here")
    return path


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

def collapse_over_training(runs: dict[str, RawRun], formats=FORMATS, activations: dict | None = None,
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


def g_final_npz(runs: dict[str, RawRun]) -> bytes:
    """``runs [n]``, ``steps [n]`` (each run's final capture), ``modules``, ``offsets``, ``gm1`` float32
    ``[n, rows]`` = ``fl32(m / wnorm64 - 1)``; the grid runs only (the twins' final states are in
    ``crosscheck.csv`` and ``collapse.csv.gz``)."""
    import io

    names = sorted(n for n, r in runs.items() if r.info["role"] == "grid")
    caps = [runs[n].captures for n in names]
    gm1 = np.stack([c.m[c.row(runs[n].final_step)].astype(np.float64) / c.wnorm64[c.row(runs[n].final_step)] - 1.0
                    for n, c in zip(names, caps)]).astype(np.float32)
    buf = io.BytesIO()
    np.savez_compressed(buf, runs=np.asarray(names), steps=np.asarray([runs[n].final_step for n in names]),
                        modules=np.asarray(caps[0].modules), offsets=caps[0].offsets, gm1=gm1)
    return buf.getvalue()


def compact_differences(runs: dict[str, RawRun], formats=FORMATS) -> list[dict]:
    """Zone counts of ``g_final.npz``'s float32 ``g - 1`` that differ from those of the full-precision
    ``m / wnorm64`` (per run, module, format; empty when the compact form loses nothing counted)."""
    bad = []
    for name, r in sorted(runs.items()):
        exact = r.captures.g_params(r.final_step)
        compact = {n: 1.0 + (g - 1.0).astype(np.float32).astype(np.float64) for n, g in exact.items()}
        a, b = collapse_table(exact, formats), collapse_table(compact, formats)
        for col in ZONE_COLUMNS:
            diff = a[col] != b[col]
            bad += [{"run": name, "module": a.loc[i, "module"], "format": a.loc[i, "format"], "column": col}
                    for i in np.flatnonzero(diff.to_numpy())]
    return bad


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
           max_rows: int | None = None, log=print) -> list[Path]:
    """Unpack a launch (``files``: ``plan.json`` + ``part-K.tar``), check it, and write the committed
    record into ``dest`` (module docstring); with ``keep``, the full record stays unpacked there.
    ``n_texts``/``max_rows``: the absorption activations (default: ``dora-num collapse``'s)."""
    import shutil

    from ...repro.provenance import read_provenance, save_dataframe, save_json, sha256_file, write_artifact

    files, dest = Path(files), Path(dest)
    tmp = Path(tempfile.mkdtemp(prefix="dora-num-ingest-"))
    try:
        root = unpack(files, Path(keep) if keep else tmp / "record")
        rec = load_raw(root)
        if not rec.runs:
            raise ValueError(f"no complete run in {files} (missing: {rec.missing})")
        bases = {json.dumps(r.info["base"]["sha256"]) for r in rec.runs.values()}
        if len(bases) != 1:
            raise ValueError(f"the runs used different base weights: {sorted(bases)}")
        first = next(iter(rec.runs.values()))
        base_dir = resolve_base(first.info["base"], tmp)
        log(f"{len(rec.runs)} runs (missing: {rec.missing or 'none'}); base {first.info['base']['kind']} ok")
        side = read_provenance(first.folder / "run.json")
        parts = {p.name: p for p in sorted(files.glob("part-*.tar"))}
        prov = dict(device=side.get("device"), params=rec.plan["config"], seed=rec.plan["config"]["seed"],
                    producer="dora_num.studies.cancellation.trained.ingest (GPU launch of gpu_training)",
                    inputs=parts, extra={"measured_at_git_sha": git_sha or rec.plan.get("git_sha"),
                                         "gpu_versions": side.get("versions"), "plan": rec.plan["plan_name"]})
        acts = activations_for(base_dir, n_texts=n_texts, max_rows=max_rows)
        collapse = collapse_over_training(rec.runs, activations=acts, log=log)
        cross = crosscheck_table(rec.runs)
        verdict = crosscheck_verdict(cross, bf16_input_types(rec.runs))
        diffs = compact_differences(rec.runs)
        outcome = outcome_table(rec.runs)
        dest.mkdir(parents=True, exist_ok=True)
        out = [save_dataframe(pd.concat([r.evals.assign(run=n) for n, r in sorted(rec.runs.items())])
                              [["run", "step", "mrr10", "val_loss", "seconds"]], dest / "evals.csv",
                              float_format="%.9g", **prov),
               save_dataframe(history_windows(rec.runs), dest / "history_windows.csv", float_format="%.9g", **prov),
               save_dataframe(collapse, dest / "collapse.csv.gz", **prov),
               write_artifact(dest / "g_final.npz", g_final_npz(rec.runs), **prov)]
        if not cross.empty:
            out.append(save_dataframe(cross, dest / "crosscheck.csv", **prov))
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
            edir = dest / "exported" / name
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                out.append(write_artifact(edir / f, (adir / f).read_bytes(), **prov))
            i = r.captures.row(r.final_step)
            import io

            buf = io.BytesIO()
            np.savez_compressed(buf, modules=np.asarray(r.captures.modules), offsets=r.captures.offsets,
                                step=np.int64(r.final_step), m=r.captures.m[i], wnorm=r.captures.wnorm[i],
                                wnorm64=r.captures.wnorm64[i])
            out.append(write_artifact(edir / "final_capture.npz", buf.getvalue(), **prov))
        manifest = {
            "plan_name": rec.plan["plan_name"], "plan": rec.plan["plan"], "config": rec.plan["config"],
            "prediction": rec.plan["prediction"], "wall_s": rec.plan["wall_s"], "elapsed_s": rec.plan.get("elapsed_s"),
            "processes": {k: {"returncode": v["returncode"], "wall_s": v["wall_s"]}
                          for k, v in rec.plan["processes"].items()},
            "missing_runs": rec.missing, "runs": {n: _brief(r.info) for n, r in sorted(rec.runs.items())},
            "outcome": outcome.to_dict(orient="records"), "crosscheck": verdict,
            "compact_certified": not diffs, "compact_differences": diffs[:50],
            "exported": exported, "base": first.info["base"], "git_sha": git_sha or rec.plan.get("git_sha"),
            "absorption_activations": {"n_texts": n_texts, "max_rows": max_rows, "dtype": "float64",
                                       "note": "None: dora-num collapse's defaults"},
            "parts": {k: sha256_file(p) for k, p in parts.items()},
            "left_out": {"captures": "m, wnorm, wnorm64 of every capture (runs/<name>/captures.npz)",
                         "history": "per-step loss, gradient norm, lr, seconds (runs/<name>/history.csv.gz)",
                         "adapters": [n for n, e in exported.items() if not e["committed"]],
                         "bytes": int(sum(p.stat().st_size for p in root.rglob("*") if p.is_file())),
                         "regenerate": RECORD_COMMAND},
        }
        out.append(save_json(manifest, dest / "manifest.json", **prov))
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------
# The committed record (notebook 01)
# --------------------------------------------------------------------------

RECORDED_DIR = ("adapters", "trained")


@dataclass
class Trained:
    manifest: dict
    evals: pd.DataFrame
    windows: pd.DataFrame
    collapse: pd.DataFrame
    crosscheck: pd.DataFrame
    g_final: dict[str, dict[str, np.ndarray]]  # run -> module -> g (float64, from float32 g - 1)
    final_steps: dict[str, int]
    folder: Path
    outcome: pd.DataFrame = field(default_factory=pd.DataFrame)

    def exported(self) -> dict[str, Path]:
        d = self.folder / "exported"
        return {p.name: p for p in sorted(d.iterdir())} if d.is_dir() else {}


def load_trained(folder=None) -> Trained:
    """The committed record (default ``data/adapters/trained``); a clear error naming the record
    command when it is missing."""
    from ...repro.paths import committed_data

    folder = Path(folder) if folder is not None else committed_data(*RECORDED_DIR)
    need = ("manifest.json", "evals.csv", "history_windows.csv", "collapse.csv.gz", "g_final.npz")
    missing = [n for n in need if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"no recorded trained adapters in {folder} (missing {', '.join(missing)}); "
                                f"record them: {RECORD_COMMAND}")
    manifest = json.loads((folder / "manifest.json").read_text())
    with np.load(folder / "g_final.npz", allow_pickle=False) as z:
        off, mods = z["offsets"], [str(n) for n in z["modules"]]
        g = {str(r): {n: 1.0 + z["gm1"][i, off[j]:off[j + 1]].astype(np.float64) for j, n in enumerate(mods)}
             for i, r in enumerate(z["runs"])}
        steps = {str(r): int(s) for r, s in zip(z["runs"], z["steps"])}
    cross = pd.read_csv(folder / "crosscheck.csv") if (folder / "crosscheck.csv").is_file() else pd.DataFrame()
    return Trained(manifest, pd.read_csv(folder / "evals.csv"), pd.read_csv(folder / "history_windows.csv"),
                   pd.read_csv(folder / "collapse.csv.gz"), cross, g, steps, folder,
                   pd.DataFrame(manifest["outcome"]))


def final_recomputed(tr: Trained, formats=FORMATS) -> pd.DataFrame:
    """The final-step zone fractions of every run recomputed from ``g_final.npz`` (no absorption)."""
    frames = [collapse_by_type(g, formats).assign(run=run, step=tr.final_steps[run]) for run, g in tr.g_final.items()]
    return pd.concat(frames, ignore_index=True)


def check_final_against_record(tr: Trained, formats=FORMATS) -> pd.DataFrame:
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


def exported_table(adapter_dir, activations: dict | None, formats=FORMATS) -> pd.DataFrame:
    """The exported adapter's collapse table from its *recorded* final capture (``m / wnorm64``,
    ``final_capture.npz``): per module and pooled, as ``dora-num collapse`` prints it."""
    with np.load(Path(adapter_dir) / "final_capture.npz", allow_pickle=False) as z:
        off, mods = z["offsets"], [str(n) for n in z["modules"]]
        g = z["m"].astype(np.float64) / z["wnorm64"]
    return collapse_table({n: g[off[j]:off[j + 1]] for j, n in enumerate(mods)}, formats, activations=activations)


def base_for_record(tr: Trained, workdir) -> Path:
    """The base weights folder of the record's runs (rebuilt and checked: :func:`resolve_base`)."""
    return resolve_base(tr.manifest["base"], Path(workdir))


# --------------------------------------------------------------------------
# Analysis for notebook 01
# --------------------------------------------------------------------------

STOP_REASONS = ("plateau", "max_steps", "deadline", "signal")
# The paper's real adapter (PAPER.md): Qwen2-VL-7B, r = 128, 326 modules, 1.77M g values; task, learning
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
        if r.stop_reason not in STOP_REASONS:
            bad.append(f"{r.run}: unknown stop reason {r.stop_reason!r}")
        if e["step"].max() != r.steps:
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


def smoke_record(folder, *, log=print) -> Path:
    """A tiny live CPU record (the cross-check trio, a few steps, :data:`~.gpu_training.SMOKE_NOTEBOOK`)
    recorded in this process and ingested into ``folder/trained``: notebook 01's SMOKE input."""
    from . import gpu_training as G

    folder = Path(folder)
    files = G.record_inline(G.smoke_plan()[:3], "smoke", G.SMOKE_NOTEBOOK, folder / "launch", log=log)
    ingest(files, folder / "trained", n_texts=4, max_rows=16, log=log)
    return folder / "trained"


EARLY_ADAPTER = ("adapters", "minilm_dora_r16")  # CPU, 50 steps; its recorded g: data/adapters/runs/r16_lr0.001.npz
EARLY_RUN = "r16_lr0.001"
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


def exported_tables(tr: Trained, work, *, n_texts=None, max_rows=None, formats=FORMATS,
                    include_early: bool = True) -> pd.DataFrame:
    """Per exported adapter (the record's, and the early CPU one): its collapse table as ``dora-num collapse``
    prints it (per module and pooled), from the recorded ``g`` of the state that was exported, with
    ``g_abs_error_bound`` (the recorded g's error against the exact g) and ``n_near_zone_end`` (rows within
    twice that of a zone end: where a count could differ from another correct float64 evaluation)."""
    from ...adapters.model import minilm_path
    from ...adapters.peft_io import read_config
    from ...repro.paths import committed_data
    from .analysis import load_runs

    cache: dict[str, dict] = {}

    def acts(base_dir: Path) -> dict:
        key = str(base_dir)
        if key not in cache:
            cache[key] = activations_for(base_dir, n_texts=n_texts, max_rows=max_rows)
        return cache[key]

    frames = []
    exp = tr.exported()
    if exp:
        base_dir = base_for_record(tr, work)
        for name, d in exp.items():
            r = read_config(d)["r"]
            with np.load(d / "final_capture.npz", allow_pickle=False) as z:
                off, mods = z["offsets"], [str(n) for n in z["modules"]]
                gall = z["m"].astype(np.float64) / z["wnorm64"]
            g = {n: gall[off[j]:off[j + 1]] for j, n in enumerate(mods)}
            b = {n: float64_g_bound(v, r) for n, v in g.items()}
            frames.append(_table_with_margins(g, b, acts(base_dir), formats).assign(
                adapter=_rel(d), base=tr.manifest["base"]["kind"], g_source="recorded capture: m / wnorm64 (float64)"))
    early_dir = committed_data(*EARLY_ADAPTER)
    if include_early and early_dir.is_dir():
        run = load_runs()[EARLY_RUN]
        g = run["g"][max(run["g"])]
        r = read_config(early_dir)["r"]
        # g - 1 stored in float32: half an ulp of g - 1, 2^-24 |g - 1|, on top of the float64 evaluation
        b = {n: float64_g_bound(v, r) + np.abs(v - 1.0) * 2.0**-24 for n, v in g.items()}
        frames.append(_table_with_margins(g, b, acts(minilm_path()), formats).assign(
            adapter=_rel(early_dir), base="packaged", g_source="recorded g - 1 (float32) of m / float64 norm"))
    df = pd.concat(frames, ignore_index=True)
    return df[["adapter", "base", "g_source"] + [c for c in df.columns if c not in ("adapter", "base", "g_source")]]


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
    }
