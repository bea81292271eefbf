"""Notebook 01's headline in the README and its two takeaways (g rounding to 1; the stable compose within 1 ulp):
the sentences and the statistics they state, read from the committed data (``d``: the ``data/`` folder).
:mod:`dora_num.repro.results` gathers every study folder's ``headline.py`` into the README and checks each
strong word against the statistics it returns."""

from __future__ import annotations

import math
from pathlib import Path

from ...repro.headline import Stats, joined, pct, pct_short_of_one, read_csv, read_json
from ..bounds.datasets import COMPOSE_GPU
from .datasets import PAPER_SHAPE, TRAINED_SEEDS

# shown under the headline in the README (figures/01_cancellation_at_g1/*.png)
FIGURES = ("trained_final_exact_zone", "compose_ulp_error_vs_rho")


def _final(d: Path, fmt: str):
    """Notebook 01: the collapse fractions of the standard runs at their final step, in ``fmt``."""
    f = read_csv(d, "01_cancellation_at_g1/trained_final_fractions.csv")
    return f[(f.variant == "standard") & (f.format == fmt)]


def _at_best(d: Path, fmt: str = "bf16"):
    """Notebook 01: each run's outcome with its collapse fraction at the best checkpoint (NaN where that
    step was not captured) and at the final step, in ``fmt``."""
    o = read_csv(d, "01_cancellation_at_g1/trained_outcome.csv")
    c = read_csv(d, "01_cancellation_at_g1/trained_collapse_over_training.csv")
    c = c[c.format == fmt]
    best = c.rename(columns={"step": "best_step", "frac_rounds_to_one": "at_best"})[["run", "best_step", "at_best"]]
    final = c[c.final].rename(columns={"frac_rounds_to_one": "at_final"})[["run", "at_final"]]
    return o.merge(best, on=["run", "best_step"], how="left").merge(final, on="run")


def _count(h: dict) -> tuple[int, int, int]:
    """``(within 1 ulp, elements, of them beyond lemma 1's condition)`` of a compose claim of headline.json."""
    n = h["stable_fp32_n_well_conditioned"] + h["stable_fp32_n_ill_conditioned"]
    return round(h["stable_fp32_frac_within_1ulp"] * n), n, h["stable_fp32_n_ill_conditioned"]


def _collapse(d: Path) -> Stats:
    """Notebook 01: what the trained runs show about g rounding to 1 in bf16, and how far it carries."""
    runs = _at_best(d)
    std = runs[runs.variant == "standard"]
    lo_lr, hi_lr = std.lr.min(), std.lr.max()
    seen = runs[runs.at_best.notna()]
    low = std.loc[std.at_final.idxmin()]
    p = read_csv(d, "01_cancellation_at_g1/paper_vs_ours_collapse.csv")
    ours = p[p.source.str.startswith("ours")]
    return {"runs": len(runs), "standard_runs": len(std),
            "models": ours.model_params.nunique(), "model_params": ours.model_params.iloc[0],
            "seeds_per_configuration": int(runs.groupby(["variant", "rank", "lr"]).size().max()),
            "lr_low": lo_lr, "lr_high": hi_lr,
            "paper_adapter_lr": p[p.source.str.startswith("paper")].lr.iloc[0],
            "final_low_lr_min": std[std.lr == lo_lr].at_final.min(),
            "final_low_lr_max": std[std.lr == lo_lr].at_final.max(),
            "final_high_lr_min": std[std.lr == hi_lr].at_final.min(),
            "final_high_lr_max": std[std.lr == hi_lr].at_final.max(),
            "final_min": std.at_final.min(), "final_max": std.at_final.max(),
            "steps_after_best_min": int((runs.steps - runs.best_step).min()),
            "steps_after_best_max": int((runs.steps - runs.best_step).max()),
            "best_captured_runs": len(seen), "best_captured_step": joined(seen.best_step),
            "best_captured_lr": joined(seen.lr),
            "at_best_min": seen.at_best.min(), "at_best_max": seen.at_best.max(),
            "at_final_of_those_min": seen.at_final.min(), "at_final_of_those_max": seen.at_final.max(),
            "low_end_rank": int(low["rank"]), "low_end_lr": low.lr,
            "low_end_mrr_best": low.mrr10_best, "low_end_mrr_final": low.mrr10_final}


def _seeds(d: Path) -> Stats:
    """Notebook 01's seeds: the bf16 fraction of g that rounds to 1 per configuration at the last capture
    and at the best checkpoint, pooled over seeds and modules with its 95 % interval, and the scaling model
    carried to the paper's adapter."""
    f = read_csv(d, "01_cancellation_at_g1/seeds_fractions.csv")
    f = f[(f.format == "bf16") & (f.zone == "one")]
    sc = read_json(d, "01_cancellation_at_g1/seeds_scaling.json")
    p = read_csv(d, "01_cancellation_at_g1/paper_vs_ours_collapse.csv")
    ours = p[p.source.str.startswith("ours")]
    std = f[f.variant == "standard"]
    out: Stats = {"models": ours.model_params.nunique(), "model_params": ours.model_params.iloc[0],
                  "configurations": f.config.nunique(), "runs": int(f[f.checkpoint == "final"].n_seeds.sum()),
                  "seeds_per_configuration": int(f[f.checkpoint == "final"].n_seeds.min()),
                  "seeds_at_best": int(f[f.checkpoint == "best"].n_seeds.min()),
                  "lr_low": std.lr.min(), "lr_high": std.lr.max(),
                  "paper_adapter_lr": p[p.source.str.startswith("paper")].lr.iloc[0],
                  "final_min": std[std.checkpoint == "final"].fraction.min()}
    for at in ("final", "best"):
        for name, lr in (("low_lr", std.lr.min()), ("high_lr", std.lr.max())):
            t = std[(std.checkpoint == at) & (std.lr == lr)]
            lo_row, hi_row = t.loc[t.fraction.idxmin()], t.loc[t.fraction.idxmax()]
            out.update({f"{at}_{name}_min": lo_row.fraction, f"{at}_{name}_min_ci": (lo_row.lo, lo_row.hi),
                        f"{at}_{name}_max": hi_row.fraction, f"{at}_{name}_max_ci": (hi_row.lo, hi_row.hi)})
    out["standard_configurations"] = std.config.nunique()
    others = sorted(set(f[f.variant != "standard"].config))  # what the standard ranges leave out (rsLoRA)
    out["others"] = len(others)
    for i, config in enumerate(others):
        for at in ("final", "best"):
            row = f[(f.config == config) & (f.checkpoint == at)].iloc[0]
            out.update({f"other{i}_name": f"{row.variant} r = {int(row['rank'])}, lr {row.lr:g}",
                        f"other{i}_{at}": row.fraction, f"other{i}_{at}_ci": (row.lo, row.hi)})
    low = std[std.checkpoint == "final"].loc[std[std.checkpoint == "final"].fraction.idxmin()]
    low_best = std[(std.checkpoint == "best") & (std.config == low.config)].iloc[0]
    out.update({"low_end_rank": int(low["rank"]), "low_end_lr": low.lr, "low_end_final": low.fraction,
                "low_end_best": low_best.fraction, "low_end_best_steps": low_best.steps,
                **_low_end_quality(d, low.config)})
    lr, pp = sc["held_out_lr"], sc["paper"]
    down = sc["held_out_lr_by_value"][f"lr={std.lr.min():g}"]  # fitted on the higher lr, predicting the lower
    mid = pp["by_w"][1]
    out.update({"scaling_held_out_lr_factor": math.exp(lr["rmse_log"]),
                "scaling_down_factor": math.exp(-down["bias_log"]), "scaling_down_q_hi": down["q_hi"],
                "scaling_down_level": down["level"], "paper_pred_mid": mid["g_std"],
                "paper_pred_mid_lo": mid["lo"], "paper_pred_mid_hi": mid["hi"], "paper_pred_w_mid": mid["w"],
                "paper_pred_lo": pp["lo"], "paper_pred_hi": pp["hi"], "paper_measured_std": pp["measured_g_std"],
                "paper_setting_lr": pp["setting"]["lr"],
                "paper_vs_interval": ", ".join(
                    f"{'inside' if b['measured_inside'] else 'above' if pp['measured_g_std'] > b['hi'] else 'below'} "
                    f"it at ||W_j|| = {b['w']:.2g}" for b in pp["by_w"]),
                "paper_w_low": pp["by_w"][0]["w"], "paper_w_high": pp["by_w"][-1]["w"]})
    return out


def _low_end_quality(d: Path, config: str) -> Stats:
    """Validation MRR@10 of the low end's runs (every seed): at the base model, at its best evaluation and at
    its last (``trained_seeds/evals.csv``): whether the low end is a run degraded past its best."""
    e = read_csv(d, TRAINED_SEEDS.file("evals"))
    e = e[e.run.str.replace(r"_s\d+$", "", regex=True) == config].sort_values("step")
    per = e.groupby("seed").mrr10.agg(["first", "max", "last"])
    return {"low_end_mrr_base": per["first"].min(), "low_end_mrr_best_min": per["max"].min(),
            "low_end_mrr_best_max": per["max"].max(), "low_end_mrr_last_min": per["last"].min(),
            "low_end_mrr_last_max": per["last"].max(), "low_end_seeds": len(per)}


def _ci(x: float, ci) -> str:
    return f"{pct(x)} [{pct(ci[0])}, {pct(ci[1])}]"


def _seeds_text(s: Stats) -> str:
    def span(at, which):
        return (f"{_ci(s[f'{at}_{which}_min'], s[f'{at}_{which}_min_ci'])} to "
                f"{_ci(s[f'{at}_{which}_max'], s[f'{at}_{which}_max_ci'])}")

    steps = str(s["low_end_best_steps"]).split(";")
    at = f"step {steps[0]} in each of its {len(steps)} seeds" if len(set(steps)) == 1 else f"steps {', '.join(steps)}"
    others = "".join(
        f"; {s[f'other{i}_name']}: {_ci(s[f'other{i}_final'], s[f'other{i}_final_ci'])} at the last capture, "
        f"{_ci(s[f'other{i}_best'], s[f'other{i}_best_ci'])} at the best" for i in range(s["others"]))
    degraded = s["low_end_mrr_last_max"] < s["low_end_mrr_best_min"]
    return (f"{s['runs']} DoRA runs of one model (MiniLM, {s['model_params']} parameters): "
            f"{s['configurations']} configurations x {s['seeds_per_configuration']} seeds, each run until validation "
            f"MRR@10 stopped improving, at learning rates {s['lr_low']:g} and {s['lr_high']:g} (the paper does not "
            f"state its adapter's; its convergence recipe's, {s['paper_setting_lr']:g}, is "
            f"{s['lr_low'] / s['paper_setting_lr']:.0f}x lower than our lower one, "
            f"[docs/paper.md](docs/paper.md)). At the last capture ({s['seeds_per_configuration']} seeds; 95% "
            f"intervals over seeds and modules, which with this few seeds read somewhat too narrow: "
            f"[docs/methods.md](docs/methods.md)) g rounds to 1 in bf16, over the {s['standard_configurations']} "
            f"configurations with standard scaling, for {span('final', 'low_lr')} of values at lr "
            f"{s['lr_low']:g} and {span('final', 'high_lr')} at lr {s['lr_high']:g}; at the best checkpoint "
            f"({s['seeds_at_best']} seeds) for {span('best', 'low_lr')} and {span('best', 'high_lr')}{others}. "
            f"The low end is the r = {s['low_end_rank']}, lr {s['low_end_lr']:g} configuration "
            f"{'degraded ' if degraded else ''}past its best ({pct(s['low_end_best'])} at the best checkpoint, {at}, "
            f"{pct(s['low_end_final'])} at the end; validation MRR@10 {s['low_end_mrr_best_min']:.3g} to "
            f"{s['low_end_mrr_best_max']:.3g} at its best, {s['low_end_mrr_last_min']:.3g} to "
            f"{s['low_end_mrr_last_max']:.3g} at the end, {s['low_end_mrr_base']:.3g} before training). A scaling "
            f"model of |g-1| fitted on these runs misses held-out learning rates by a factor "
            f"{s['scaling_held_out_lr_factor']:.2g} (rms), and one-sidedly downwards: fitted on lr {s['lr_high']:g} "
            f"it predicts lr {s['lr_low']:g}'s |g-1| {s['scaling_down_factor']:.2g} times too small (geometric mean"
            f"{', on at least ' + pct((1 + s['scaling_down_level']) / 2) + ' of captures' if s['scaling_down_q_hi'] < 0 else ''}"
            f"); carried down another tenfold to the paper's adapter (its recipe assumed) it predicts std(g) "
            f"{s['paper_pred_mid']:.2g} ({s['paper_pred_mid_lo']:.2g} to {s['paper_pred_mid_hi']:.2g}, 90%) at "
            f"||W_j|| = {s['paper_pred_w_mid']:.2g} and {s['paper_pred_lo']:.2g} to {s['paper_pred_hi']:.2g} over "
            f"||W_j|| in {s['paper_w_low']:.2g} to {s['paper_w_high']:.2g}; the paper's measured "
            f"{s['paper_measured_std']:g} lies {s['paper_vs_interval']}"
            f"{' (above: the side that downward bias predicts, so no evidence against the paper' + chr(39) + 's number)' if 'above' in s['paper_vs_interval'] and s['scaling_down_factor'] > 1 else ''}")


def _paper_adapter(d: Path) -> str:
    """The paper's adapter, as notebook 01 puts it beside ours (paper_vs_ours_collapse.csv)."""
    p = read_csv(d, "01_cancellation_at_g1/paper_vs_ours_collapse.csv")
    b = p[p.source.str.startswith("paper") & (p.format == "bf16")].iloc[0]
    return (f"the paper's {b.source.removeprefix('paper: ').split(',')[0]} adapter: std {b.g_std:.2g}, "
            f"{pct(b.frac_symmetric_zone)} in bf16's zone")


def _compose(d: Path) -> Stats:
    """Notebooks 01 and 03: how exact the stable compose with fp32 intermediates is, on the trained adapter
    (the g sweep and every module at the trained g) and on every 16-bit pair (the exhaustive GPU run), beside
    the naive form with fp32 intermediates on the same real elements."""
    sw = read_csv(d, "01_cancellation_at_g1/compose_error_sweep.csv.gz")
    sw = sw[(sw.variant == "fp32 intermediates")]
    st = sw[sw.formula == "compose_stable"]
    al = read_csv(d, "01_cancellation_at_g1/compose_claim_all_modules.csv.gz")
    al = al[(al.format == "bf16") & (al.variant == "fp32 intermediates")]
    sa, na = al[al.formula == "compose_stable"], al[al.formula == "compose_naive"]
    ex = read_csv(d, COMPOSE_GPU.file("results"))
    ex = ex[(ex.formula == "compose_stable") & (ex.arith == "fp32")]
    worst = ex.loc[ex[ex.format == "bf16"].frac_correctly_rounded.idxmin()]
    off = lambda t: round((t.ulp_mean * t.n).sum()) if t.ulp_max.max() <= 1 else float("nan")  # noqa: E731
    return {"sweep_n": int(st.n.sum()), "sweep_within_1ulp": int(st.n_le1.sum()), "sweep_one_ulp_off": off(st),
            "sweep_pairs": int(st.n.iloc[0] * st.module.nunique()), "sweep_g": int(st.groupby("format").g.nunique().max()),
            "sweep_formats": int(st.format.nunique()),
            "modules": int(sa.module.nunique()), "modules_n": int(sa.n.sum()), "modules_one_ulp_off": off(sa),
            "modules_within_1ulp": int(sa.n_le1.sum()),
            "naive_n": int(na.n.sum()), "naive_beyond_1ulp": int((na.n - na.n_le1).sum()),
            "naive_frac_within_1ulp": na.n_le1.sum() / na.n.sum(), "naive_ulp_max": na.ulp_max.max(),
            "exhaustive_settings": int(ex.groupby("format").size().max()),
            "frac_correctly_rounded_min": worst.frac_correctly_rounded,
            "frac_correctly_rounded_min_g": worst.g_label.replace("ulp32", " fp32 ulps"),
            "frac_correctly_rounded_min_s": worst.s_label,
            "ulp_max_bf16": int(ex[ex.format == "bf16"].max_ulp.max()),
            "ulp_max_fp16": int(ex[ex.format == "fp16"].max_ulp.max()),
            "beyond_1ulp_where_well_conditioned": int(ex.kappa_le_one_ulp_over_1ulp.sum()),
            "within_1ulp_all": float(st.n_le1.sum() == st.n.sum() and sa.n_le1.sum() == sa.n.sum()),
            **_compose_fp32_formed(d)}


def _compose_fp32_formed(d: Path) -> Stats:
    """Notebook 02's compose study on the same trained adapter, base and lora formed in fp32 (stored in bf16
    or kept in fp32): the production compose's elements beyond 1 ulp in each output format."""
    c = read_csv(d, "02_fma_and_sqrt/compose_summary.csv")
    c = c[(c.set == "trained") & (c.formula == "compose_stable") & (c.placement == "none")].set_index("fmt")
    return {"nb02_n": int(c.n.max()),
            "nb02_bf16_beyond_1ulp": round((1 - c.loc["bf16", "within_1ulp_of_exact"]) * c.loc["bf16", "n"]),
            "nb02_bf16_ulp_max": int(c.loc["bf16", "max_abs_ulp_vs_exact"]),
            "fp32_out_within_1ulp": c.loc["fp32", "within_1ulp_of_exact"],
            "fp32_out_ulp_max": int(c.loc["fp32", "max_abs_ulp_vs_exact"])}


def _compose_fp32_text(s: Stats) -> str:
    return (f"with base and lora formed in fp32 (notebook 02, the same adapter) {s['nb02_bf16_beyond_1ulp']} of "
            f"{s['nb02_n']:,} bf16 outputs are beyond 1 ulp (up to {s['nb02_bf16_ulp_max']}), and in fp32 outputs "
            f"it is within 1 ulp on {pct(s['fp32_out_within_1ulp'])} (up to {s['fp32_out_ulp_max']:,} ulps, where "
            f"the sum cancels)")


def _compose_counter(s: Stats) -> str:
    where = ("every error above 1 ulp where the sum cancels beyond lemma 1's condition"
             if s["beyond_1ulp_where_well_conditioned"] == 0 else
             f"{s['beyond_1ulp_where_well_conditioned']:,} errors above 1 ulp where the sum does not cancel")
    return (f"it is not always correctly rounded: on the swept elements {s['sweep_one_ulp_off']:,} are 1 ulp off, "
            f"over all {s['modules']} modules at the trained g {s['modules_one_ulp_off']:,} of "
            f"{s['modules_n']:,} bf16 elements; on every 16-bit pair (the exhaustive GPU run, "
            f"{s['exhaustive_settings']} settings of g and s per format) it is correctly rounded on as few as "
            f"{pct(s['frac_correctly_rounded_min'])} of bf16 pairs (g = {s['frac_correctly_rounded_min_g']}, "
            f"s = {s['frac_correctly_rounded_min_s']}) and up to {s['ulp_max_bf16']} ulps (bf16) and "
            f"{s['ulp_max_fp16']} ulps (fp16) off, {where}")


def headline(d: Path) -> tuple[list[str], Stats]:
    h = read_json(d, "01_cancellation_at_g1/headline.json")
    sweep, tr, canc = h["g_sweep"], h["trained"], h["naive_cancellation"]
    o = read_csv(d, "01_cancellation_at_g1/trained_outcome.csv")
    b, h16 = _final(d, "bf16"), _final(d, "fp16")
    lo, hi = tr["steps_min_max"]
    ok, n, ill = _count(sweep)
    cs, c, sd = _compose(d), _collapse(d), _seeds(d)
    return ([f"the stable compose with fp32 intermediates is within 1 ulp of the correctly rounded result on {ok:,} "
             f"of {n:,} real-activation elements of a trained adapter, |g-1| swept across the collapse zones (lemma 1 "
             f"guarantees it where the compose sum is well conditioned; {ill} elements lie beyond that and were within "
             f"1 ulp too); {_compose_fp32_text(cs)}; {_compose_counter(cs)}",
             f"the naive form's error follows its own cancellation ratio |base|/|result| (Spearman "
             f"{canc['bf16']['spearman_log2rho_vs_mean_ulp']:.3g} over the bins, bf16), not |g-1|: on a trained adapter "
             f"the lora term keeps the result from cancelling (Spearman of its error against |g-1|: "
             f"{sweep['naive_fp32_bf16']['spearman_absd_vs_mean_ulp']:.2g})",
             f"{tr['runs']} DoRA runs of one model (MiniLM) on the H200, one seed each, until validation MRR@10 "
             f"stopped improving "
             f"({lo} to {hi} steps; MRR@10 {o.mrr10_base.min():.3g} at the base, {o.mrr10_best.min():.3g} to "
             f"{o.mrr10_best.max():.3g} at the best)",
             f"at the final step (ranks {b['rank'].min()}-{b['rank'].max()}, lr {joined(b['lr'])}) g rounds to 1 in "
             f"bf16 for {pct(b.frac_rounds_to_one.min())} to {pct(b.frac_rounds_to_one.max())} of values (the "
             f"paper's zone |g-1| < eps/2: {pct(b.frac_symmetric_zone.min())} to {pct(b.frac_symmetric_zone.max())}), "
             f"in fp16 for {pct(h16.frac_rounds_to_one.min())} to {pct(h16.frac_rounds_to_one.max())}; std(g) "
             f"{b.g_std.min():.2g} to {b.g_std.max():.2g} ({_paper_adapter(d)}); at the best checkpoint, where it "
             f"was captured ({c['best_captured_runs']} runs), {pct(c['at_best_min'])} to {pct(c['at_best_max'])} "
             f"in bf16",
             f"the grid again with seeds 1 to {sd['seeds_per_configuration'] - 1} (an H100), "
             f"{sd['seeds_per_configuration']} seeds per configuration "
             f"at the last capture: g rounds to 1 in bf16 for {pct(sd['final_low_lr_min'])} to "
             f"{pct(sd['final_low_lr_max'])} of values at lr {sd['lr_low']:g} and {pct(sd['final_high_lr_min'])} to "
             f"{pct(sd['final_high_lr_max'])} at lr {sd['lr_high']:g} (95% intervals over seeds and modules in the "
             f"notebook; {sd['seeds_at_best']} seeds at the best checkpoint)"],
            {**cs, **c, **{f"seeds_{k}": v for k, v in sd.items()}})


def _t_collapse(d: Path) -> tuple[str, Stats]:
    s = _seeds(d)
    return (f"**In bf16 g rounds to exactly 1 for part of a trained adapter's values, how large a part depends on "
            f"the learning rate and on when the run is stopped.** {_seeds_text(s)}. Where g rounds to 1 the (g-1) "
            f"part of DoRA's update is invisible unless g is kept in fp32 ({_paper_adapter(d)}).", s)


def _t_compose(d: Path) -> tuple[str, Stats]:
    s = _compose(d)
    at1 = read_csv(d, PAPER_SHAPE.file()).iloc[0]
    s["paper_benchmark_ratio"] = at1.ratio_max_abs
    every16 = s["within_1ulp_all"] == 1 and s["nb02_bf16_beyond_1ulp"] == 0
    return (f"**In 16-bit outputs the stable compose with fp32 intermediates is within 1 ulp of the correctly "
            f"rounded result {'on every real element measured' if every16 else 'on all but a handful of real elements'}"
            f"; in fp32 outputs it is not.** On real activations of a trained MiniLM adapter, formed in 16 bits as "
            f"DoRALinear forms them, it is within 1 ulp on "
            f"{s['sweep_within_1ulp']:,} of {s['sweep_n']:,} elements ({s['sweep_pairs']:,} (base, lora) pairs x "
            f"{s['sweep_g']} swept values of g x {s['sweep_formats']} formats) and on "
            f"{s['modules_within_1ulp']:,} of {s['modules_n']:,} bf16 elements of all {s['modules']} modules; "
            f"{_compose_fp32_text(s)}; {_compose_counter(s)}. The naive form with fp32 intermediates is within 1 ulp on "
            f"{pct_short_of_one(s['naive_frac_within_1ulp'])} of the same {s['naive_n']:,} real bf16 elements "
            f"({s['naive_beyond_1ulp']} beyond, up to {s['naive_ulp_max']:,.0f} ulps): that is what the stable form "
            f"gains there. The paper's peak-error gain is reproduced ({at1.ratio_max_abs:.2f}x at g = 1 on its "
            f"benchmark; its numbers: [docs/paper.md](docs/paper.md)), and the stable form's peak error there is "
            f"the output's own bf16 rounding ({at1.stable_max_abs:.3g}).", s)


# the README's numbered takeaways this notebook backs: (function, the figure that shows it)
TAKEAWAYS = (
    (_t_collapse, "01_cancellation_at_g1/trained_final_exact_zone"),
    (_t_compose, "01_cancellation_at_g1/compose_ulp_error_vs_rho"),
)
