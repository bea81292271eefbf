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
from .released import round_ratios
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
    b = out["bench"]
    compiled = b["compile"].fillna("eager") != "eager" if "compile" in b.columns else pd.Series(False, index=b.index)
    out["bench"], out["compiled"] = b[~compiled].reset_index(drop=True), b[compiled].reset_index(drop=True)
    return out


def compiled_table(data: dict) -> pd.DataFrame:
    """The compiled comparison: per rank, checkpointing and mode (train, infer), the ms of plain LoRA,
    PEFT's DoRA and this operator, eager and under each ``torch.compile`` mode recorded, DoRA's cost
    over plain LoRA in the same compile mode, the speedup over PEFT in the same mode, and the peak
    extra memory (``data["compiled"]`` beside the eager rows of ``data["bench"]``)."""
    eager = data["bench"].assign(compile="eager")
    rows = pd.concat([eager, data.get("compiled", pd.DataFrame())], ignore_index=True)
    rows = rows[rows["variant"].isin(["lora_fp32", "peft_fp32", "dora_num_fp32"])
                & rows["mode"].isin(["train", "infer_cold" if len(data.get("compiled", [])) == 0 else "infer"])]
    keys = ["rank", "checkpointing", "mode", "compile"]
    t = rows.pivot_table(index=keys, columns="variant", values=["ms", "peak_extra_bytes"], aggfunc="first", dropna=False)
    out = pd.DataFrame(index=t.index)
    for v in ("lora_fp32", "peft_fp32", "dora_num_fp32"):
        if ("ms", v) in t.columns:
            out[f"{v}_ms"] = t["ms", v]
            out[f"{v}_peak_MB"] = t["peak_extra_bytes", v] / 1e6
    if {"peft_fp32_ms", "dora_num_fp32_ms"} <= set(out.columns):
        out["speedup_vs_peft"] = out["peft_fp32_ms"] / out["dora_num_fp32_ms"]
    if "lora_fp32_ms" in out.columns:
        for v in ("peft_fp32", "dora_num_fp32"):
            if f"{v}_ms" in out.columns:
                out[f"{v}_cost_over_lora_ms"] = out[f"{v}_ms"] - out["lora_fp32_ms"]
    return out.reset_index()


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
