"""Notebook 05's model-level section: tables, a plot beside the paper's numbers, and target verdicts,
from the recorded ``model`` section of the GPU suite (:mod:`dora_num.studies.speed.record_model`:
``model_bench.csv``, ``model_agreement.csv``, ``model_probe.csv``, ``model_predictions.csv`` in
``data/gpu/``).

Every ratio is within one run (interleaved rounds).  A target that is not met is called
``out_of_reach`` only where the floor measured in the same run (the best ratio any DoRA
implementation could reach: PEFT's time over plain LoRA's on the same adapter, which every DoRA
step contains, or the frozen model's peak for memory) lies below the threshold; else ``missed``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .datasets import MODEL
from .released import round_ratios, rounds as parse_rounds
from .report import target_row

# Model level, from Zelenin & Zhuravlyova, "Scaling DoRA: High-Rank Adaptation via Factored Norms
# and Fused Kernels", arXiv:2603.22276v1 (2026): six 8-32B VLMs, r = 384, bf16, against PEFT.
PAPER_MODEL = {"train": (1.46, 1.87), "infer": (1.5, 2.0), "peak_vram_lower_gb": 6.7}

# Targets: (name, rank, checkpointing, mode, threshold) of the speedup over PEFT's default (fp32 adapters)
SPEED_TARGETS = (("model_train_speedup_vs_peft", 384, False, "train", 1.8),
                 ("model_train_speedup_vs_peft", 384, True, "train", 1.8),
                 ("model_train_speedup_vs_peft", 64, False, "train", 1.5),
                 ("model_train_speedup_vs_peft", 64, True, "train", 1.5),
                 ("model_infer_speedup_vs_peft", 384, False, "infer_cold", 2.0))
MEMORY_RATIO = 0.6  # peak with checkpointing <= 0.6 x PEFT's
HOST_US = 250.0  # DoRALinear forward + backward, 4096 -> 4096
PUBLIC_COMPOSE_PCT = 85.0


def load_model(folder: str | Path | None = None) -> dict | None:
    """The recorded model section (DataFrames ``bench``, ``agreement``, ``probe``, ``predictions``),
    or None where it was not recorded."""
    if MODEL.subset("bench").missing(folder):
        return None
    out = {}
    for key in ("bench", "agreement", "probe", "predictions"):
        p = MODEL.path(key, folder)
        out[key] = pd.read_csv(p) if p.is_file() else pd.DataFrame()
    return out


def model_table(bench: pd.DataFrame, predictions: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per rank, checkpointing, mode and variant: ms, peak MB, speedup and memory ratio against
    PEFT's default at the same rank/checkpointing/mode, and the predicted ms where modelled."""
    t = bench.copy()
    keys = ["rank", "checkpointing", "mode"]
    peft = t[t["variant"] == "peft_fp32"].set_index(keys)
    idx = pd.MultiIndex.from_frame(t[keys])
    t["speedup_vs_peft_fp32"] = peft["ms"].reindex(idx).to_numpy() / t["ms"].to_numpy()
    t["mem_ratio_vs_peft_fp32"] = t["peak_extra_bytes"].to_numpy() / peft["peak_extra_bytes"].reindex(idx).to_numpy()
    t["peak_MB"] = t["peak_extra_bytes"] / 1e6
    if predictions is not None and len(predictions):
        pr = predictions.rename(columns={"predicted_ms": "predicted_train_ms"})
        t = t.merge(pr, on=["rank", "checkpointing", "variant"], how="left")
        t.loc[t["mode"] != "train", "predicted_train_ms"] = float("nan")
    return t


def plot_model(mt: pd.DataFrame):
    """Speedup over PEFT's default per rank: training (with and without checkpointing) and
    inference, fp32 and bf16 adapters, with the paper's model-level ranges as bands."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sel = mt[mt["variant"].isin(["dora_num_fp32", "dora_num_bf16", "lora_fp32", "frozen"])].copy()
    sel["case"] = sel["mode"] + sel["checkpointing"].map({True: " +ckpt", False: ""})
    panels = [("train", "training step (fwd+bwd)", PAPER_MODEL["train"]),
              ("train +ckpt", "training step, checkpointing", PAPER_MODEL["train"]),
              ("infer_cold", "inference forward (norm each call)", PAPER_MODEL["infer"])]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
    for ax, (case, title, band) in zip(axes, panels):
        d = sel[sel["case"] == case]
        sns.barplot(data=d, x="rank", y="speedup_vs_peft_fp32", hue="variant", ax=ax)
        ax.axhspan(*band, color="0.85", zorder=0, label="paper (r=384, VLMs)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(title)
        ax.set_xlabel("rank")
    axes[0].set_ylabel("speedup vs PEFT default (fp32 adapters)")
    fig.tight_layout()
    return fig


def model_targets(data: dict | None) -> pd.DataFrame:
    """One row per model-level target: measured, threshold, best possible (the same run's floor),
    verdict (``met`` / ``out_of_reach`` / ``missed``, or ``not_recorded``)."""
    rows = []

    def add(target, shape, measured, threshold, floor, note="", per_round=None):
        recorded = measured is not None and measured == measured  # NaN: ms() found no row
        rows.append(target_row(target, shape, measured, threshold, floor, note, recorded=recorded,
                               per_round=per_round))

    if data is None:
        for name, r, ckpt, mode, thr in SPEED_TARGETS:
            add(name, f"r={r}{' ckpt' if ckpt else ''}", None, thr, None, "model section not recorded")
        add("model_peak_memory_inverse_vs_peft", "ckpt", None, 1 / MEMORY_RATIO, None, "model section not recorded")
        add("layer_host_cost_inverse", "4096x4096 r=384", None, 1.0, None, "probe not recorded")
        add("public_compose_pct_copy", "8192x8192 bf16", None, PUBLIC_COMPOSE_PCT, None, "probe not recorded")
        return pd.DataFrame(rows)
    b = data["bench"]

    def ms(variant, r, ckpt, mode, col="ms"):
        s = b[(b["variant"] == variant) & (b["rank"] == r) & (b["checkpointing"] == ckpt) & (b["mode"] == mode)]
        return float(s[col].iloc[0]) if len(s) else float("nan")

    def per_round(r, ckpt, mode):  # round i of PEFT over round i of ours (the rounds interleave the variants)
        sel = [b[(b["variant"] == v) & (b["rank"] == r) & (b["checkpointing"] == ckpt) & (b["mode"] == mode)]
               for v in ("peft_fp32", "dora_num_fp32")]
        if not all(len(x) and "rounds_ms" in x for x in sel):
            return None
        return round_ratios(sel[0]["rounds_ms"].iloc[0], sel[1]["rounds_ms"].iloc[0])

    for name, r, ckpt, mode, thr in SPEED_TARGETS:
        peft, ours, lora = (ms(v, r, ckpt, mode) for v in ("peft_fp32", "dora_num_fp32", "lora_fp32"))
        frozen = ms("frozen", r, ckpt, mode)
        note = (f"PEFT {peft:.1f} ms, dora_num {ours:.1f} ms, plain LoRA {lora:.1f} ms, frozen model {frozen:.1f} ms"
                + (f"; warm (norm reused) {ms('dora_num_fp32', r, ckpt, 'infer'):.1f} ms" if mode == "infer_cold" else ""))
        add(name, f"r={r}{' ckpt' if ckpt else ''}", peft / ours, thr, peft / lora, note, per_round(r, ckpt, mode))
    for r in sorted(set(b["rank"])):
        peft = ms("peft_fp32", r, True, "train", "peak_extra_bytes")
        ours = ms("dora_num_fp32", r, True, "train", "peak_extra_bytes")
        frozen = ms("frozen", r, True, "train", "peak_extra_bytes")
        add("model_peak_memory_inverse_vs_peft", f"r={r} ckpt", peft / ours, 1 / MEMORY_RATIO, peft / frozen,
            f"peak extra: PEFT {peft / 1e9:.2f} GB, dora_num {ours / 1e9:.2f} GB, frozen model {frozen / 1e9:.2f} GB")
    p = data.get("probe")
    if p is not None and len(p):
        host = p[(p["probe"] == "host_us")].set_index("what")["value"]
        if "dora_linear_fwd_bwd" in host:
            add("layer_host_cost_inverse", str(p[p["what"] == "dora_linear_fwd_bwd"]["shape"].iloc[0]),
                HOST_US / host["dora_linear_fwd_bwd"], 1.0, HOST_US / host["lora_linear_fwd_bwd"],
                f"host us per fwd+bwd: DoRALinear {host['dora_linear_fwd_bwd']:.0f}, nn.Linear + LoRA "
                f"{host['lora_linear_fwd_bwd']:.0f} (the floor: the same GEMMs and autograd nodes without DoRA)")
        comp = p[p["probe"] == "compose_fwd"].set_index("what")
        if "public_compose_fused_fwd" in comp.index:
            add("public_compose_pct_copy", str(comp["shape"].iloc[0]), float(comp.loc["public_compose_fused_fwd", "pct_copy"]),
                PUBLIC_COMPOSE_PCT, float(comp.loc["kernel_compose_fwd", "pct_copy"]),
                f"public {comp.loc['public_compose_fused_fwd', 'value']:.4f} ms, kernel alone "
                f"{comp.loc['kernel_compose_fwd', 'value']:.4f} ms")
    return pd.DataFrame(rows)


def agreement_table(agreement: pd.DataFrame) -> pd.DataFrame:
    """The fidelity rows (small copy vs fp64, full size vs PEFT)."""
    cols = ["scope", "variant", "reference", "rank", "loss_abs_err", "logits_rms_rel_err", "logits_max_rel_err",
            "tol_logits_rms_rel_err", "tol_loss_abs_err", "faithful"]
    return agreement[[c for c in cols if c in agreement.columns]]


# --------------------------------------------------------------------------
# The model matrix (dora-num record model --matrix 1|2)
# --------------------------------------------------------------------------

MATRIX_COST_RATIO = 0.5  # DoRA's cost over plain LoRA in one mode: ours <= 0.5 x PEFT's
MATRIX_EAGER_SPEEDUP = 1.8  # eager training: ours >= 1.8 x PEFT's speed
MATRIX_MEMORY_OVER_LORA = 1.10  # peak training memory <= plain LoRA's + 10%
MATRIX_TARGET_RANKS = (64, 384)
MATRIX_CASES = (("train", False), ("train", True), ("infer", False))  # (mode, checkpointing): the matrix's phases
_MATRIX_VARIANTS = ("lora_fp32", "peft_fp32", "dora_num_fp32")


def load_matrix(folder: str | Path | None = None) -> dict | None:
    """The recorded model matrix: ``bench`` and ``g_error`` of both parts concatenated, ``parts`` (each
    part's commit and card, from its provenance), or None where no part is recorded.  A folder holds
    both parts' files (``part1/``, ``part2/`` below it, as ``data/gpu/matrix``)."""
    from ...repro.provenance import read_provenance
    from .datasets import MODEL_MATRIX

    bench, g, parts = [], [], []
    for k, ds in enumerate(MODEL_MATRIX, start=1):
        root = None if folder is None else Path(folder) / f"part{k}"
        if ds.subset("bench").missing(root):
            continue
        b = pd.read_csv(ds.path("bench", root))
        bench.append(b.assign(part=k))
        gp = ds.path("g_error", root)
        if gp.is_file():
            g.append(pd.read_csv(gp).assign(part=k))
        bp = ds.path("bench", root)
        side = read_provenance(bp) if bp.with_name(bp.name + ".provenance.json").is_file() else {}
        parts.append({"part": k, "ranks": sorted(set(b["rank"])), "git_sha": (side.get("git") or {}).get("sha"),
                      "gpu": (side.get("device") or {}).get("name")})
    if not bench:
        return None
    return {"bench": pd.concat(bench, ignore_index=True),
            "g_error": pd.concat(g, ignore_index=True) if g else pd.DataFrame(), "parts": pd.DataFrame(parts)}


def matrix_table(data: dict) -> pd.DataFrame:
    """One row per rank, case (``train``, ``train`` with checkpointing, ``infer``) and mode (``eager``,
    ``default``, ``reduce-overhead``): the ms and peak extra GB of plain LoRA, PEFT's DoRA and this
    operator; DoRA's cost over plain LoRA in that mode (ms) for PEFT and ours and their ratio (ours /
    PEFT: below 1, ours costs less); ours over PEFT (speed), ours compiled over ours eager; peak memory
    over plain LoRA's and over PEFT's."""
    b = data["bench"]
    b = b[b["variant"].isin(_MATRIX_VARIANTS)]
    keys = ["rank", "checkpointing", "mode", "compile"]
    t = b.pivot_table(index=keys, columns="variant", values=["ms", "peak_extra_bytes"], aggfunc="first", dropna=False)
    t = t[t["ms"].notna().any(axis=1)]  # dropna=False keeps a CPU run's NaN peaks, and every level product too
    out = pd.DataFrame(index=t.index)
    for v in _MATRIX_VARIANTS:
        out[f"{v}_ms"] = t["ms", v]
    for v in ("peft_fp32", "dora_num_fp32"):
        out[f"{v}_cost_ms"] = out[f"{v}_ms"] - out["lora_fp32_ms"]
    out["cost_ours_over_peft"] = out["dora_num_fp32_cost_ms"] / out["peft_fp32_cost_ms"]
    out["speedup_vs_peft"] = out["peft_fp32_ms"] / out["dora_num_fp32_ms"]
    eager = out.xs("eager", level="compile")["dora_num_fp32_ms"]
    out["ours_over_ours_eager"] = [ours / eager.loc[key[:3]] for key, ours in out["dora_num_fp32_ms"].items()]
    for v in _MATRIX_VARIANTS:
        out[f"{v}_peak_GB"] = t["peak_extra_bytes", v] / 1e9
    out["peak_ours_over_lora"] = out["dora_num_fp32_peak_GB"] / out["lora_fp32_peak_GB"]
    out["peak_ours_over_peft"] = out["dora_num_fp32_peak_GB"] / out["peft_fp32_peak_GB"]
    order = {"eager": 0, "default": 1, "reduce-overhead": 2}
    out = out.reset_index()
    return out.sort_values(["rank", "checkpointing", "mode", "compile"],
                           key=lambda s: s.map(order) if s.name == "compile" else s).reset_index(drop=True)


def compiled_rounds_slower(data: dict) -> dict:
    """``{(rank, checkpointing, mode, compile): "r1, r2, r3"}``: the compiled cells where, in some round, our
    compiled step over our eager step of the same round (the two are interleaved) is at least 1, with every
    round's ratio; a median below 1 can hide them."""
    b = data["bench"]
    b = b[(b["variant"] == "dora_num_fp32") & b["ms"].notna()]
    out = {}
    for (r, ckpt, mode), d in b.groupby(["rank", "checkpointing", "mode"]):
        eager = d[d["compile"] == "eager"]
        for _, row in d[d["compile"] != "eager"].iterrows():
            ratios = round_ratios(str(row["rounds_ms"]), str(eager["rounds_ms"].iloc[0]))
            if max(ratios) >= 1:
                out[int(r), bool(ckpt), mode, row["compile"]] = ", ".join(f"{x:.2f}" for x in ratios)
    return out


def _case(mode: str, ckpt: bool) -> str:
    return f"{mode}{' +ckpt' if ckpt else ''}"


def matrix_targets(data: dict | None) -> pd.DataFrame:
    """The matrix's targets, one row each (:func:`~dora_num.studies.speed.report.target_row`; ratios so
    that higher is better): DoRA's cost over plain LoRA, PEFT's over ours (>= 1 / MATRIX_COST_RATIO)
    at r = 64 and 384 in each compiled mode and case; eager training, ours over PEFT's speed (>=
    MATRIX_EAGER_SPEEDUP); ours compiled at least as fast as ours eager (eager ms / compiled ms >= 1);
    peak training memory, PEFT's over ours (>= 1) and plain LoRA's x 1.1 over ours (>= 1), eager and
    compiled (not under ``reduce-overhead``: a replay's CUDA-graph pool, allocated at capture, is not in the
    allocator's peak of the step, so those peaks are not comparable).
    No floor is claimed (``best_possible`` None): the matrix times whole steps, not the kernels a floor
    is made of (docs/operator.md has the profile)."""
    rows = []
    if data is None:
        return pd.DataFrame([target_row("matrix", "-", None, 1.0, None, "model matrix not recorded", recorded=False)])
    t = matrix_table(data)
    b = data["bench"]

    def rounds(variant, r, ckpt, mode, comp):
        s = b[(b["variant"] == variant) & (b["rank"] == r) & (b["checkpointing"] == ckpt) & (b["mode"] == mode)
              & (b["compile"] == comp)]
        return str(s["rounds_ms"].iloc[0]) if len(s) else None  # one round reads back as a number

    def cost_rounds(r, ckpt, mode, comp):  # round i of PEFT's cost over round i of ours
        lo, pe, ou = (rounds(v, r, ckpt, mode, comp) for v in _MATRIX_VARIANTS)
        if None in (lo, pe, ou):
            return None
        lora, peft, ours = (parse_rounds(x) for x in (lo, pe, ou))
        return list((peft - lora) / (ours - lora))

    for _, row in t.iterrows():
        r, ckpt, mode, comp = int(row["rank"]), bool(row["checkpointing"]), row["mode"], row["compile"]
        shape = f"r={r} {_case(mode, ckpt)} {comp}"
        note = (f"ms: LoRA {row['lora_fp32_ms']:.1f}, PEFT {row['peft_fp32_ms']:.1f}, ours {row['dora_num_fp32_ms']:.1f}; "
                f"cost over LoRA: PEFT {row['peft_fp32_cost_ms']:.2f}, ours {row['dora_num_fp32_cost_ms']:.2f}")
        if r in MATRIX_TARGET_RANKS and comp != "eager":
            rows.append(target_row("matrix_cost_peft_over_ours", shape,
                                   row["peft_fp32_cost_ms"] / row["dora_num_fp32_cost_ms"], 1 / MATRIX_COST_RATIO,
                                   None, note, per_round=cost_rounds(r, ckpt, mode, comp)))
        if comp == "eager" and mode == "train":
            rows.append(target_row("matrix_eager_speedup_vs_peft", shape, row["speedup_vs_peft"], MATRIX_EAGER_SPEEDUP,
                                   None, note, per_round=round_ratios(rounds("peft_fp32", r, ckpt, mode, comp),
                                                                      rounds("dora_num_fp32", r, ckpt, mode, comp))))
        if comp != "eager":
            rows.append(target_row("matrix_ours_eager_over_compiled", shape, 1 / row["ours_over_ours_eager"], 1.0,
                                   None, note, per_round=round_ratios(rounds("dora_num_fp32", r, ckpt, mode, "eager"),
                                                                      rounds("dora_num_fp32", r, ckpt, mode, comp))))
        if mode == "train" and comp != "reduce-overhead":  # a replay's graph pool is outside the allocator's peak
            mem = (f"peak extra GB: LoRA {row['lora_fp32_peak_GB']:.2f}, PEFT {row['peft_fp32_peak_GB']:.2f}, "
                   f"ours {row['dora_num_fp32_peak_GB']:.2f}")
            rows.append(target_row("matrix_peak_peft_over_ours", shape, 1 / row["peak_ours_over_peft"], 1.0, None, mem))
            rows.append(target_row("matrix_peak_lora_plus_10pct_over_ours", shape,
                                   MATRIX_MEMORY_OVER_LORA / row["peak_ours_over_lora"], 1.0, None, mem))
    return pd.DataFrame(rows)


def g_error_table(data: dict) -> pd.DataFrame:
    """g's error on each path (PEFT's and ours, eager and compiled) against float64, per projection and
    rank: the max relative error and the same over max |g - 1|; ``compiled_bitwise_eager``: ours
    compiled gave the eager value (the two errors equal to the last bit)."""
    g = data["g_error"]
    t = g.pivot_table(index="shape", columns="what", values="value", aggfunc="first")
    t["ours_compiled_bitwise_eager"] = t["dora_num_compiled"] == t["dora_num_eager"]
    t["peft_over_ours_eager"] = t["peft_eager"] / t["dora_num_eager"]
    return t.reset_index()


def plot_matrix(t: pd.DataFrame):
    """DoRA's cost over plain LoRA (ms per step) by mode, PEFT's and ours, one panel per case, ranks on
    the x axis, the target (half of PEFT's cost) marked on ours."""
    import matplotlib.pyplot as plt

    cases = [c for c in MATRIX_CASES if ((t["mode"] == c[0]) & (t["checkpointing"] == c[1])).any()]
    modes = ["eager", "default", "reduce-overhead"]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.6 * len(cases), 3.8), sharey=True, squeeze=False)
    ranks = sorted(set(t["rank"]))
    width = 0.13
    colors = {"eager": "0.55", "default": "tab:blue", "reduce-overhead": "tab:orange"}
    for ax, (mode, ckpt) in zip(axes[0], cases):
        d = t[(t["mode"] == mode) & (t["checkpointing"] == ckpt)]
        for j, comp in enumerate(modes):
            x0 = [i + (j - 1) * 2.3 * width for i in range(len(ranks))]
            dd = d[d["compile"] == comp].set_index("rank").reindex(ranks)
            ax.bar([x - width / 2 for x in x0], dd["peft_fp32_cost_ms"], width, color=colors[comp], alpha=0.45,
                   hatch="//", edgecolor="k", lw=0.4, label=f"PEFT, {comp}")
            ax.bar([x + width / 2 for x in x0], dd["dora_num_fp32_cost_ms"], width, color=colors[comp],
                   edgecolor="k", lw=0.4, label=f"ours, {comp}")
            ax.scatter([x + width / 2 for x in x0], MATRIX_COST_RATIO * dd["peft_fp32_cost_ms"], marker="_", s=120,
                       color="k", zorder=3, label="target: half PEFT's" if j == 0 else None)
        ax.axhline(0, color="k", lw=0.6)
        absent = [comp for comp in modes if not (d["compile"] == comp).any()]
        if absent:  # a mode the matrix leaves out of this case (checkpointing under CUDA graphs)
            ax.text(0.98, 0.97, "not run: " + ", ".join(absent), transform=ax.transAxes, ha="right", va="top",
                    fontsize=8)
        ax.set_xticks(range(len(ranks)), [f"r={r}" for r in ranks])
        ax.set_title(_case(mode, ckpt).replace("train", "training").replace("infer", "inference"))
    axes[0][0].set_ylabel("DoRA's cost over plain LoRA (ms per step)")
    h, lab = axes[0][0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=4, fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    return fig
