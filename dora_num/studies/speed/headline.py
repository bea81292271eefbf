"""Notebook 05's headline in the README (the H200 targets, the layer against PEFT): the sentences and the
statistics they state, read from the committed data (``d``: the ``data/`` folder).
:mod:`dora_num.repro.results` gathers every study folder's ``headline.py`` into the README and checks each
strong word against the statistics it returns."""

from __future__ import annotations

from pathlib import Path

from ...repro.headline import Stats, read_csv
from .datasets import TRAIN_GRAPHS

# shown under the headline in the README (figures/05_memory_and_speed/*.png)
FIGURES = ("compose_pct_copy_bf16",)


def _speed(d: Path) -> Stats:
    """Notebook 05: the targets' verdicts, the layer against PEFT like for like (bf16 adapters on both sides)
    and per round, and the ceiling the out-of-reach verdicts' floors are drawn at (the copy bandwidth or the
    highest bandwidth a measured path reached, whichever is higher)."""
    t = read_csv(d, "05_memory_and_speed/targets.csv")
    lay = read_csv(d, "05_memory_and_speed/layer_vs_peft.csv")
    lay = lay[lay["mode"] == "fwd_bwd"]
    key = ["d_in", "d_out", "rank", "tokens"]
    ours = lay[lay.impl == "dora_num"].set_index(key)
    fp32 = lay[lay.impl == "peft_default"].set_index(key)
    bf16 = lay[lay.impl == "peft_bf16_adapters"].set_index(key).dora_num_speedup
    met = t[t.target == "layer_fwd_bwd_speedup_vs_peft"].threshold.iloc[0]
    below = rounds = 0
    for k in fp32.index:  # round i of PEFT's default over round i of ours (the rounds interleave them)
        a = [float(x) for x in fp32.loc[k, "rounds_ms"].split(";")]
        b = [float(x) for x in ours.loc[k, "rounds_ms"].split(";")]
        below += sum(x / y < met for x, y in zip(a, b))
        rounds += len(a)
    bw = read_csv(d, "05_memory_and_speed/compose_bandwidth.csv")
    fwd = bw[bw.op == "fwd"]
    top = bw.loc[bw.pct_copy.idxmax()]
    counts = t.verdict.value_counts()
    oor = t[t.verdict == "out_of_reach"]
    return {"met": int(counts.get("met", 0)), "out_of_reach": int(counts.get("out_of_reach", 0)),
            "missed": int(counts.get("missed", 0)),
            "layer_targets_met": int(((t.target == "layer_fwd_bwd_speedup_vs_peft") & (t.verdict == "met")).sum()),
            "layer_vs_peft_fp32_min": fp32.dora_num_speedup.min(), "layer_vs_peft_fp32_max": fp32.dora_num_speedup.max(),
            "layer_vs_peft_bf16_min": bf16.min(), "layer_vs_peft_bf16_max": bf16.max(),
            "layer_threshold": met, "rounds_below_threshold": below, "rounds": rounds,
            "oor_on_ceiling": int(oor.note.str.contains("the ceiling").sum()),
            "oor_on_graphs": int(oor.note.str.contains("CUDA graphs").sum()),
            "graphs_max_pct_floor": float(read_csv(d, TRAIN_GRAPHS.file("timing")).pct_copy.max()),
            "ceiling_pct_copy": float(top.pct_copy), "ceiling_impl": str(top.impl), "ceiling_op": str(top.op),
            "max_measured_pct_copy": float(bw.pct_copy.max()),
            # the ceiling the targets table drew its bandwidth floors at (report.target_status)
            "floor_ceiling_pct": float(t[t.target.isin(("fwd_pct_copy", "bwd_pct_copy"))].best_possible.min()),
            "fused_fwd_pct_copy": fwd[fwd.impl == "fused"].pct_copy.max(),
            "target_fwd_pct_copy": t[t.target == "fwd_pct_copy"].measured.max()}


def headline(d: Path) -> tuple[list[str], Stats]:
    s = _speed(d)
    return ([f"H200 targets, one session's medians without intervals: {s['met']} met, {s['missed']} missed, "
             f"{s['out_of_reach']} out of reach (below); fused compose forward at "
             f"{s['target_fwd_pct_copy']:.3g}% of "
             f"copy bandwidth",
             f"the {s['layer_targets_met']} met layer targets against PEFT ({s['layer_vs_peft_fp32_min']:.3g}x to "
             f"{s['layer_vs_peft_fp32_max']:.3g}x) compare with PEFT's default fp32 adapters; against PEFT with bf16 "
             f"adapters the layer runs at {s['layer_vs_peft_bf16_min']:.2g}x to {s['layer_vs_peft_bf16_max']:.3g}x, "
             f"and {s['rounds_below_threshold']} of the {s['rounds']} rounds against PEFT's default (every shape) "
             f"fall below "
             f"{s['layer_threshold']:g}x",
             f"{s['oor_on_ceiling']} of the {s['out_of_reach']} verdicts marked out of reach draw their floor at the "
             f"highest bandwidth measured in the same run, {s['ceiling_pct_copy']:.4g}% of the copy kernel's (the "
             f"{s['ceiling_impl']} path's {s['ceiling_op']}), so that no floor rests on a ceiling a measured path "
             f"exceeds (the fused forward reaches {s['fused_fwd_pct_copy']:.3g}%); {s['oor_on_graphs']} on the "
             f"CUDA-graph floor of their own run, where no path passes {s['graphs_max_pct_floor']:.3g}% of it, and "
             f"{s['out_of_reach'] - s['oor_on_ceiling'] - s['oor_on_graphs']} on plain LoRA's host cost measured "
             f"beside it"],
            s)
