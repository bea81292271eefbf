"""Notebook 05's headline in the README (the H200 targets, the layer against PEFT, the paper's released kernels
on an H100): the sentences and the
statistics they state, read from the committed data (``d``: the ``data/`` folder).
:mod:`dora_num.repro.results` gathers every study folder's ``headline.py`` into the README and checks each
strong word against the statistics it returns."""

from __future__ import annotations

from pathlib import Path

from ...repro.headline import Stats, read_csv, read_json
from .datasets import DORAFACTORS, SUITE, TRAIN_GRAPHS
from .released import SHORT_DTYPE, round_ratios

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
        ratios = round_ratios(fp32.loc[k, "rounds_ms"], ours.loc[k, "rounds_ms"])
        below += int((ratios < met).sum())
        rounds += len(ratios)
    bw = read_csv(d, "05_memory_and_speed/compose_bandwidth.csv.xz")
    fwd = bw[bw.op == "fwd"]
    top = bw.loc[bw.pct_copy.idxmax()]
    counts = t.verdict.value_counts()
    timed = t[(t.verdict == "met") & t.round_lo.notna()]  # met verdicts from medians over interleaved rounds
    oor = t[t.verdict == "out_of_reach"]
    return {"met": int(counts.get("met", 0)), "out_of_reach": int(counts.get("out_of_reach", 0)),
            "met_in_rounds": len(timed), "met_with_round_below": int((timed.round_lo < timed.threshold).sum()),
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
            "fused_fwd_pct_copy_at": _shape(fwd.loc[fwd[fwd.impl == "fused"].pct_copy.idxmax()]),
            "target_fwd_pct_copy": t[t.target == "fwd_pct_copy"].measured.max(),
            "target_fwd_pct_copy_text": " and ".join(
                f"{r.measured:.3g}% ({r['shape']})" for _, r in t[t.target == "fwd_pct_copy"].iterrows())}


def _shape(row) -> str:
    """A compose-bandwidth row's shape and dtype, as the targets table writes them (``16384x8192 bf16``)."""
    return f"{int(row['tokens'])}x{int(row['d_out'])} {SHORT_DTYPE.get(row['dtype'], row['dtype'])}"


def sessions(d: Path) -> Stats:
    """Notebook 05's targets over two sessions (``targets_over_sessions.csv``: a verdict counts where both
    sessions give it, else ``split``) and the layer against PEFT over both sessions' rounds
    (``layer_over_sessions.csv``), per PEFT setting: the lowest and highest per-round ratio."""
    t = read_csv(d, "05_memory_and_speed/targets_over_sessions.csv")
    lay = read_csv(d, "05_memory_and_speed/layer_over_sessions.csv")
    v = t.over_sessions.value_counts()
    s: Stats = {"sessions_targets": len(t), "sessions_met": int(v.get("met", 0)),
                "sessions_missed": int(v.get("missed", 0)), "sessions_out_of_reach": int(v.get("out_of_reach", 0)),
                "sessions_split": int(v.get("split", 0)),
                "sessions_split_met_first": int(((t.over_sessions == "split") & (t.verdict_1 == "met")).sum())}
    for impl, key in (("peft_default", "fp32"), ("peft_bf16_adapters", "bf16")):
        g = lay[lay.impl == impl]
        s |= {f"sessions_layer_{key}_lo": float(g.round_lo.min()), f"sessions_layer_{key}_hi": float(g.round_hi.max()),
              f"sessions_layer_{key}_rounds": int(g["rounds"].sum())}
    return s


def sessions_sentence(s: Stats, card: str) -> str:
    """The first line of the headline once a second session is recorded (:func:`sessions`)."""
    return (f"{card} targets in two sessions (each session's medians; a verdict counts only where both sessions "
            f"give it): {s['sessions_met']} met, {s['sessions_missed']} missed, {s['sessions_out_of_reach']} out of "
            f"reach in both, {s['sessions_split']} split ({s['sessions_split_met_first']} met in the first session "
            f"only); the layer against PEFT's default fp32 adapters {s['sessions_layer_fp32_lo']:.3g}x to "
            f"{s['sessions_layer_fp32_hi']:.3g}x and against bf16 adapters {s['sessions_layer_bf16_lo']:.3g}x to "
            f"{s['sessions_layer_bf16_hi']:.3g}x over both sessions' {s['sessions_layer_fp32_rounds']} rounds")


def _released(d: Path) -> tuple[Stats, str, str]:
    """Notebook 05's table of the paper's released kernels against ours (one run, one card): per op, the
    range of the median-round ratios (their time / ours), the range of the per-round ratios, how many
    configurations' rounds all lie on one side of 1, and the output errors against float64; with the card
    (from the record's provenance) and the gradient of the compose's training step their kernel gets least
    exact."""
    t = read_csv(d, "05_memory_and_speed/released_vs_ours.csv")
    card = read_json(d, DORAFACTORS.file("bench") + ".provenance.json")["device"]["name"]
    train = t[t.op == "compose_train"]
    worst = train.loc[train.grad_err_theirs.idxmax()]
    s: Stats = {"released_rounds": int(t["rounds"].min()),
                "released_rounds_max": int(t["rounds"].max()), "released_configurations": len(t),
                "released_theirs_longer": int((t.interval == "theirs longer").sum()),
                "released_ours_longer": int((t.interval == "ours longer").sum()),
                "released_overlaps": int((t.interval == "overlaps 1").sum())}
    for op, g in t.groupby("op"):
        s |= {f"{op}_ratio_min": g.ratio.min(), f"{op}_ratio_max": g.ratio.max(),
              f"{op}_lo": g.ratio_lo.min(), f"{op}_hi": g.ratio_hi.max(),
              f"{op}_err_theirs_max": g.err_theirs.max(), f"{op}_err_ours_max": g.err_ours.max()}
    small = t[(t.op == "layer_fwd_bwd") & (t.d_out == t[t.op == "layer_fwd_bwd"].d_out.min())]
    s |= {"layer_small_d_out": int(small.d_out.iloc[0]),
          "layer_small_overlaps": int((small.interval == "overlaps 1").sum()), "layer_small_n": len(small),
          "compose_train_grad_err_theirs": float(worst.grad_err_theirs),
          "compose_train_grad_err_ours": float(train.grad_err_ours.max())}
    return s, _card(card), str(worst.grad_err_theirs_of)


def _card(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``."""
    return name.removeprefix("NVIDIA ").split()[0]


def _released_sentence(s: Stats, card: str, grad: str, rest: str) -> str:
    def r(op):
        return (f"{s[op + '_ratio_min']:.3g}x to {s[op + '_ratio_max']:.3g}x (rounds {s[op + '_lo']:.3g} to "
                f"{s[op + '_hi']:.3g})")

    return (f"The paper's released kernels (dorafactors v1.0) against ours on one {card} in one run, their time "
            f"over ours in the same round, median of {s['released_rounds']} interleaved rounds and the range over "
            f"rounds: compose forward {r('compose_fwd')}, their kernel taking g in bf16 (output error "
            f"{s['compose_fwd_err_theirs_max']:.2g} against our {s['compose_fwd_err_ours_max']:.2g}, relative "
            f"to float64); compose training {r('compose_train')}, their {grad} error up to "
            f"{s['compose_train_grad_err_theirs']:.2g} (our worst gradient's {s['compose_train_grad_err_ours']:.2g}); "
            f"row norm {r('row_norm')}, theirs returning bf16 (error "
            f"{s['row_norm_err_theirs_max']:.2g} against our {s['row_norm_err_ours_max']:.2g}); layer forward "
            f"{r('layer_fwd')} and forward+backward {r('layer_fwd_bwd')} with bf16 adapters on both sides, where "
            f"at {s['layer_small_d_out']}->{s['layer_small_d_out']} {s['layer_small_overlaps']} of "
            f"{s['layer_small_n']} ranges include 1; in {s['released_theirs_longer']} of the "
            f"{s['released_configurations']} configurations every round has theirs longer, in "
            f"{s['released_ours_longer']} ours, in {s['released_overlaps']} the rounds do not order them (notebook "
            f"05's suite sections are from an {rest})")


def _matrix(d: Path) -> tuple[str, Stats] | None:
    """The model matrix's sentence and statistics, from notebook 05's tables of it (None where not recorded)."""
    if not (d / "05_memory_and_speed/model_matrix.csv").is_file():
        return None
    from .model_report import compiled_rounds_slower, load_matrix

    t = read_csv(d, "05_memory_and_speed/model_matrix.csv")
    matrix = load_matrix(d / "gpu/matrix")
    parts = matrix["parts"]  # each part's card, from its provenance
    s: Stats = {}
    for mode in ("eager", "default", "reduce-overhead"):
        c = t[t["compile"] == mode].cost_ours_over_peft
        s[f"matrix_cost_{mode}_min"], s[f"matrix_cost_{mode}_max"] = float(c.min()), float(c.max())
    comp = t[t["compile"] != "eager"].ours_over_ours_eager
    s["matrix_compiled_over_eager_max"] = float(comp.max())
    targets = read_csv(d, "05_memory_and_speed/model_matrix_targets.csv")
    cost = targets[targets.target == "matrix_cost_peft_over_ours"]
    s["matrix_cost_met"], s["matrix_cost_n"] = int((cost.verdict == "met").sum()), len(cost)

    def r(mode):
        return f"{s[f'matrix_cost_{mode}_min']:.2g} to {s[f'matrix_cost_{mode}_max']:.2g}"

    s["matrix_rounds_slower"] = len(compiled_rounds_slower(matrix))
    return (f"the model matrix (4 decoder layers at 8B shapes, fp32 adapters, each decoder layer compiled, r "
            f"16/64/384, training with and without checkpointing and inference; two device calls on an "
            f"{_card(str(parts.gpu.iloc[0]))} at one commit, medians of 3 rounds): DoRA's cost over plain LoRA on this "
            f"operator is {r('eager')} times PEFT's eager, {r('default')} under torch.compile (the step waits on the "
            f"Python of the opaque custom ops it was recorded with; the traced ops, the default since, are not in it) and {r('reduce-overhead')} under reduce-overhead (without checkpointing, whose "
            f"capture failed there even for plain LoRA); on medians compiling never made our step slower than our "
            f"eager one (at most {s['matrix_compiled_over_eager_max']:.2f} of it), though in "
            f"{s['matrix_rounds_slower']} cells a round did; the target of half PEFT's cost when compiled is met in "
            f"{s['matrix_cost_met']} of {s['matrix_cost_n']} cells (r 64 and 384)"), s


def headline(d: Path) -> tuple[list[str], Stats]:
    s = _speed(d)
    rel, card, grad = _released(d)
    lines = [f"H200 targets, one session's medians (the H200 session not repeated): {s['met']} met "
             f"({s['met_with_round_below']} of the {s['met_in_rounds']} met from interleaved rounds have a round "
             f"below their threshold), {s['missed']} missed, {s['out_of_reach']} out of reach (below); fused compose "
             f"forward at "
             f"{s['target_fwd_pct_copy_text']} of copy bandwidth"]
    if (d / "05_memory_and_speed/targets_over_sessions.csv").is_file():
        two = sessions(d)
        s |= two
        lines.append(f"how far one session's verdict moves: {sessions_sentence(two, 'H100')}")
    matrix = _matrix(d)
    if matrix is not None:
        lines.append(matrix[0])
        s |= matrix[1]
    return ([*lines,
             f"the {s['layer_targets_met']} met layer targets against PEFT ({s['layer_vs_peft_fp32_min']:.3g}x to "
             f"{s['layer_vs_peft_fp32_max']:.3g}x) compare with PEFT's default fp32 adapters; against PEFT with bf16 "
             f"adapters the layer runs at {s['layer_vs_peft_bf16_min']:.2g}x to {s['layer_vs_peft_bf16_max']:.3g}x, "
             f"and {s['rounds_below_threshold']} of the {s['rounds']} rounds against PEFT's default (every shape) "
             f"fall below "
             f"{s['layer_threshold']:g}x",
             f"{s['oor_on_ceiling']} of the {s['out_of_reach']} verdicts marked out of reach draw their floor at the "
             f"highest bandwidth measured in the same run, {s['ceiling_pct_copy']:.4g}% of the copy kernel's (the "
             f"{s['ceiling_impl']} path's {s['ceiling_op']}), so that no floor rests on a ceiling a measured path "
             f"exceeds (the fused forward reaches {s['fused_fwd_pct_copy']:.3g}% at {s['fused_fwd_pct_copy_at']}); "
             f"{s['oor_on_graphs']} on the "
             f"CUDA-graph floor of their own run, where no path passes {s['graphs_max_pct_floor']:.3g}% of it, and "
             f"{s['out_of_reach'] - s['oor_on_ceiling'] - s['oor_on_graphs']} on plain LoRA's host cost measured "
             f"beside it",
             _released_sentence(rel, card, grad, _card(read_json(d, SUITE.file("device"))["device"]["name"]))],
            s | rel)
