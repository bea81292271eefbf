"""Notebook 01's trained-adapter runs: the plan, and what the recorder, its ingest and the analysis share.

The plan (:func:`full_plan`): ranks x learning rates with ``s = 1``, an rsLoRA run, and the r = 16,
lr 1e-3 configuration twice more (through PEFT; with every initial ``m`` one fp32 ulp off) for the
cross-check of the captured ``g``.  A run's captures (``captures.npz``: :func:`captures_npz`,
:class:`Captures`), module types, the collapse statistics per type, the real activations of the
absorption and the base weights a run used are defined here once.  Recorder:
:mod:`.record_trained`; ingest: :mod:`.ingest_trained`; analysis: :mod:`.trained`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ...adapters.collapse import POOLED, collapse_table
from ...numerics.formats import NARROW_FORMATS


CAPTURE_STEPS = (0, 10, 30, 100, 300, 1000, 3000)
RANKS = (8, 16, 64, 128, 384)
LRS = (1e-4, 1e-3)
CROSSCHECK = (16, 1e-3)  # the configuration run through PEFT and with m + 1 ulp
# The raw record of one run (runs/<name>/ in a launch's output; not a data set: the ingest reads it and
# writes data/adapters/trained): these names are typed here only.
RAW_FILES = {"info": "run.json", "history": "history.csv.gz", "evals": "evals.csv", "captures": "captures.npz",
             "stats": "stats.csv.gz"}  # stats: plan seeds only (seed_stats)
EXPORTS = ((16, 1e-3), (64, 1e-4))  # (rank, lr) of the standard runs exported in PEFT format
COMMIT_MAX_RANK = 16  # exported adapters committed up to this rank (r = 16: 2.75 MB; r = 64: 10.6 MB)
RSLORA_ALPHA = 192.0  # alpha = r/2 at r = 384: the paper's rsLoRA setting, s = 192 / sqrt(384) = 9.80
# The chaos floor of MRR@10: a smaller gain cannot be told from rounding noise.  The largest
# |MRR(m + 1 ulp) - MRR| of the recorded convergence runs is 0.0033 (chaos_floor_mrr).
MIN_DELTA = 0.003
FINAL_MARGIN_S = 10.0  # writes after the final capture (npz, CSVs, sidecars, export): measured < 3 s on CPU


@dataclass(frozen=True)
class RunSpec:
    rank: int
    lr: float
    use_rslora: bool = False
    alpha: float | None = None  # None: alpha = rank (s = 1)
    backend: str = "dora_num"
    perturbed: bool = False  # every initial m moved by one fp32 ulp, random signs (the chaos baseline)
    export: bool = False
    seed: int | None = None  # None: the study configuration's seed (the full plan's runs are seed 0)

    @property
    def name(self) -> str:
        return (f"r{self.rank}_lr{self.lr:g}" + ("_rslora" if self.use_rslora else "")
                + ("_peft" if self.backend == "peft" else "") + ("_ulp" if self.perturbed else "")
                + (f"_s{self.seed}" if self.seed is not None else ""))

    @property
    def scale(self) -> float:
        a = float(self.rank if self.alpha is None else self.alpha)
        return a / math.sqrt(self.rank) if self.use_rslora else a / self.rank

    @property
    def role(self) -> str:
        return "peft_twin" if self.backend == "peft" else "ulp_twin" if self.perturbed else "grid"


def full_plan() -> list[RunSpec]:
    plan = [RunSpec(r, lr, export=(r, lr) in EXPORTS) for lr in LRS for r in RANKS]
    plan.append(RunSpec(384, 1e-4, use_rslora=True, alpha=RSLORA_ALPHA))
    plan += [RunSpec(*CROSSCHECK, backend="peft"), RunSpec(*CROSSCHECK, perturbed=True)]
    return plan


def seeds_plan(seeds) -> list[RunSpec]:
    """The full plan's grid runs (ranks x learning rates, and the rsLoRA run; no twins, no exports) once
    per seed in ``seeds``: the replicates of the collapse fractions (:mod:`.seeds`)."""
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 1:
        raise ValueError(f"seeds must be distinct integers >= 1 (seed 0 is the full plan's record), got {seeds}")
    grid = [s for s in full_plan() if s.role == "grid"]
    return [dataclasses.replace(s, export=False, seed=k) for k in seeds for s in grid]


def seeds_smoke_plan(seeds=(1,)) -> list[RunSpec]:
    """Every code path of the seeds plan on two small runs per seed (both learning rates, one with rsLoRA)."""
    return [RunSpec(8, 1e-3, seed=k) for k in seeds] + [RunSpec(8, 1e-4, use_rslora=True, alpha=4.0, seed=k)
                                                        for k in seeds]


def smoke_plan() -> list[RunSpec]:
    """Every code path of the full plan on four runs: the cross-check trio (export too) and an
    exported rsLoRA run."""
    return [RunSpec(*CROSSCHECK, export=True), RunSpec(*CROSSCHECK, backend="peft"),
            RunSpec(*CROSSCHECK, perturbed=True), RunSpec(8, 1e-3, use_rslora=True, alpha=4.0, export=True)]


def select(plan: list[RunSpec], names) -> list[RunSpec]:
    if not names:
        return plan
    known = {s.name: s for s in plan}
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"runs {unknown} are not in the plan {sorted(known)}")
    return [s for s in plan if s.name in set(names)]


def chaos_floor_mrr(evals_csv=None) -> dict:
    """max and median ``|MRR@10(eager m + 1 ulp) - MRR@10(eager)|`` over the recorded convergence runs
    (steps >= 200: after warmup): the basis of :data:`MIN_DELTA`."""
    from ..convergence.datasets import CONVERGENCE

    e = pd.read_csv(evals_csv or CONVERGENCE.subset("evals").require()[0])
    e = e[(e.metric == "mrr10") & (e.path == "eager") & (e.repeat == 0) & (e.step >= 200)]
    w = e.pivot_table(index=["seed", "step"], columns="perturbed", values="value")
    d = (w[True] - w[False]).abs().dropna()
    return {"max": float(d.max()), "median": float(d.median()), "n": int(d.size)}


def captures_npz(captures: dict[int, dict], names: list[str]) -> bytes:
    """All captures of a run: ``steps [k]``, ``modules [36]``, ``offsets [37]`` (rows of module j:
    ``offsets[j]:offsets[j+1]``), ``m``/``wnorm`` float32 ``[k, rows]``, ``wnorm64`` float64 ``[k, rows]``,
    ``g_is_quotient [k]`` (int8: 1 yes, 0 no, -1 not applicable)."""
    import io

    steps = sorted(captures)
    sizes = [captures[steps[0]]["m"][n].size for n in names]
    arr = {k: np.stack([np.concatenate([captures[s][k][n] for n in names]) for s in steps])
           for k in ("m", "wnorm", "wnorm64")}
    flag = [-1 if captures[s]["g_is_quotient"] is None else int(captures[s]["g_is_quotient"]) for s in steps]
    buf = io.BytesIO()
    np.savez_compressed(buf, steps=np.asarray(steps, dtype=np.int64), modules=np.asarray(names),
                        offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                        m=arr["m"].astype(np.float32), wnorm=arr["wnorm"].astype(np.float32),
                        wnorm64=arr["wnorm64"].astype(np.float64), g_is_quotient=np.asarray(flag, dtype=np.int8))
    return buf.getvalue()


def weights_fingerprint(path) -> str:
    """sha256 over the tensors of a safetensors file (sorted by name: name, dtype, shape, bytes).  Not the
    file's own hash: safetensors writes its metadata in an order that changes from one write to the next."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path)).items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def base_info(base_path=None) -> dict:
    """The base weights a run used: folder, :func:`weights_fingerprint` of ``model.safetensors`` and its
    kind (``bf16-rounded``: written by :func:`dora_num.adapters.model.write_minilm_bf16`; else ``packaged``)."""
    from safetensors import safe_open

    from ...adapters.model import minilm_path

    path = Path(base_path) if base_path is not None else minilm_path()
    f = path / "model.safetensors"
    with safe_open(str(f), "pt") as h:
        note = (h.metadata() or {}).get("note", "")
    return {"path": str(path), "fingerprint": weights_fingerprint(f),
            "kind": "bf16-rounded" if "bf16-rounded" in note else "packaged"}


MODULE_TYPES = ("q", "k", "v", "o", "intermediate", "output")
_TYPE_RE = (("q", r"attention\.self\.query$"), ("k", r"attention\.self\.key$"), ("v", r"attention\.self\.value$"),
            ("o", r"attention\.output\.dense$"), ("intermediate", r"intermediate\.dense$"),
            ("output", r"(?<!attention\.)output\.dense$"))
CROSSCHECK_FACTOR = 2.0  # same-dtype-baseline convention (analysis.AGREEMENT_FACTOR)
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
ZONE_COLUMNS = ("frac_symmetric_zone", "frac_rounds_to_one", "frac_below_one_symmetric",
                "frac_below_one_rounds_to_one")


def module_type(name: str) -> str:
    """``q``, ``k``, ``v``, ``o`` (attention output), ``intermediate`` or ``output`` of a MiniLM linear."""
    for t, pat in _TYPE_RE:
        if re.search(pat, name):
            return t
    raise ValueError(f"{name!r} is not one of MiniLM's encoder linears")


@dataclass
class Captures:
    """One run's captures (:func:`captures_npz`)."""

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


def compact_gm1(gm1: np.ndarray, formats=NARROW_FORMATS) -> dict[str, np.ndarray]:
    """``g - 1`` (float64, exact for g in [0.5, 2]) stored compactly and losslessly for every zone count:
    ``gm1`` in float32, and at the flat positions ``exact_idx`` where the float32 value would move g across
    a zone end of one of ``formats`` (:func:`~dora_num.numerics.collapse.zone_masks`), ``exact_gm1`` in
    float64.  :func:`expand_gm1` inverts it; which values move depends on the trained weights, so on
    the machine that trained them, and is decided here rather than left to chance."""
    from ...numerics.collapse import zone_masks

    gm1 = np.asarray(gm1, dtype=np.float64)
    c = gm1.astype(np.float32)
    g, gc = 1.0 + gm1, 1.0 + c.astype(np.float64)
    moved = np.zeros(gm1.size, dtype=bool)
    for f in formats:
        a, b = zone_masks(g, f), zone_masks(gc, f)
        for k in a:
            moved |= a[k] != b[k]
    idx = np.flatnonzero(moved)
    return {"gm1": c, "exact_idx": idx.astype(np.int64), "exact_gm1": gm1.ravel()[idx]}


def expand_gm1(gm1: np.ndarray, exact_idx=None, exact_gm1=None) -> np.ndarray:
    """float64 ``g - 1`` from :func:`compact_gm1`'s arrays (records without the exact part: float32 only)."""
    out = np.asarray(gm1).astype(np.float64)
    if exact_idx is not None and len(exact_idx):
        out.ravel()[np.asarray(exact_idx)] = exact_gm1
    return out


def collapse_by_type(g_by_module: dict[str, np.ndarray], formats=NARROW_FORMATS, activations: dict | None = None):
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
    """A local folder holding the base weights a run used (``run.json: base``), checked by
    :func:`~.record_trained.weights_fingerprint`: the packaged MiniLM, or its bf16-rounded copy rebuilt by
    :func:`dora_num.adapters.model.write_minilm_bf16`."""
    from ...adapters.model import minilm_path, write_minilm_bf16

    if base["kind"] == "bf16-rounded":
        path = write_minilm_bf16(Path(workdir) / "minilm-bf16")
    else:
        path = minilm_path()
    got = weights_fingerprint(path / "model.safetensors")
    if got != base["fingerprint"]:
        raise ValueError(f"the runs used base weights with fingerprint {base['fingerprint']} ({base['kind']}); "
                         f"{path} has {got}: cannot reproduce their activations here")
    return path
