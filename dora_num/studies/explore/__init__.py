"""The computations behind the interactive explorer (notebook 07): one compose, exactly.

:func:`point` evaluates one compose element (``formula`` in ``compose_stable`` /
``compose_naive``) under an arithmetic of :mod:`dora_num.numerics.emulate` (``fp32``: the
contract; ``fp32_fma``; ``per_op``) and returns the computed value, the exact value (rational
arithmetic), the exact value rounded once to the format, the error in ULPs, the a-priori bound
(:func:`dora_num.numerics.bounds.compose_bound`) and its ulp form
(:func:`~dora_num.numerics.bounds.compose_ulp_bound`), the sum's condition ``kappa_c``
(:func:`~dora_num.numerics.bounds.compose_condition`) against lemma 1's 1-ulp threshold
(:func:`~dora_num.numerics.bounds.one_ulp_condition`), and where ``g`` sits against the format's
collapse zone ``fl(g) = 1`` (``1 - eps/4 <= g <= 1 + eps/2``).  :func:`sweep` does the same
over a range of ``g - 1`` for the plot; :func:`arithmetics` sweeps both formulas under the three
settings of :data:`SETTINGS` (where the naive form collapses, where the final rounding hides it,
where ``g`` itself rounds to 1), :func:`effects` reads the sweeps' facts; :func:`widgets` wires
:func:`point` and :func:`sweep` to ipywidgets, only where a frontend is attached
(:func:`dora_num.repro.notebook.frontend_attached`).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pandas as pd

from ...numerics.bounds import compose_bound, compose_condition, compose_ulp_bound, one_ulp_condition
from ...numerics.emulate import emulate
from ...numerics.formats import STUDIED_FORMATS, get_format, round_fraction, round_to, ulp, ulp_distance
from ...numerics.formulas import scale_constants

NOTEBOOK = "07_explore"  # the notebook this folder backs (names its headline in the README)

FORMULAS = ("compose_stable", "compose_naive")
ARITHS = ("fp32", "fp32_fma", "per_op")


def collapse_zone(fmt) -> tuple[float, float]:
    """``[lo, hi]``: the real ``g`` that round to exactly 1 in ``fmt`` (ties to even included)."""
    f = get_format(fmt)
    return 1.0 - f.eps / 4, 1.0 + f.eps / 2


def _inputs(fmt, g, s, base, lora):
    f = get_format(fmt)
    for name, v in (("g", g), ("s", s), ("base", base), ("lora", lora)):
        if not isinstance(v, (int, float, np.floating)) or not math.isfinite(float(v)):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    g32 = float(np.float32(g))
    if not 0.5 <= g32 <= 2.0:
        raise ValueError(f"g = {g} outside [0.5, 2], where the explorer's exact g - 1 is not an fp32 number")
    b = float(round_to(np.array([float(base)]), f)[0])
    l_ = float(round_to(np.array([float(lora)]), f)[0])
    if not (math.isfinite(b) and math.isfinite(l_)):
        raise ValueError(f"base or lora overflows {f.name} (base={base}, lora={lora})")
    return f, g32, scale_constants(float(s))[0], b, l_


def point(fmt="bf16", formula="compose_stable", arith="fp32", g=1.001, s=0.5, base=1.0, lora=1e-3) -> dict:
    """One element, exactly (module docstring).  ``base`` and ``lora`` are rounded to ``fmt``
    (their storage values are returned), ``g`` and ``s`` to fp32."""
    if formula not in FORMULAS:
        raise ValueError(f"formula must be one of {FORMULAS}, got {formula!r}")
    if arith not in ARITHS:
        raise ValueError(f"arith must be one of {ARITHS}, got {arith!r}")
    f, g32, s32, b, l_ = _inputs(fmt, g, s, base, lora)
    arr = lambda v: np.array([v])  # noqa: E731
    c = float(emulate(formula, {"base": arr(b), "lora": arr(l_), "g": arr(g32), "s": s32}, f, arith)[0])
    X = (Fraction(g32) - 1) * Fraction(b) + Fraction(g32) * Fraction(s32) * Fraction(l_)
    ref = round_fraction(X, f)
    B = float(compose_bound(formula, arr(b), arr(l_), arr(g32), s32, f, arith)[0])
    U = float(compose_ulp_bound(formula, arr(b), arr(l_), arr(g32), s32, f, arith)[0])
    kappa = float(compose_condition(arr(b), arr(l_), arr(g32), s32)[0])
    q = float(ulp(arr(float(X)), f)[0])
    finite = math.isfinite(c) and math.isfinite(ref)
    d = int(abs(ulp_distance(arr(ref), arr(c), f)[0])) if finite else None
    lo, hi = collapse_zone(f)
    return {"format": f.name, "formula": formula, "arith": arith, "g": g32, "g_minus_1": g32 - 1.0, "s": s32,
            "base": b, "lora": l_, "computed": c, "exact": float(X), "exact_rounded": ref,
            "abs_err": float(abs(Fraction(c) - X)) if math.isfinite(c) else math.inf,
            "ulp_error": d,
            "err_ulps": float(abs(Fraction(c) - X) / Fraction(q)) if math.isfinite(c) else math.inf,
            "bound": B, "bound_ulps": B / q, "within_bound": bool(math.isfinite(c) and abs(Fraction(c) - X) <= Fraction(B))
            if math.isfinite(B) else None,
            "ulp_bound": U, "within_ulp_bound": bool(finite and d <= U) if math.isfinite(U) else None,
            "kappa_c": kappa, "one_ulp_condition": one_ulp_condition(f),
            "g_rounds_to_1": bool(round_to(arr(g32), f)[0] == 1.0), "zone_lo": lo, "zone_hi": hi}


def sweep(fmt="bf16", formula="compose_stable", arith="fp32", s=0.5, base=1.0, lora=1e-3, *,
          lo_exp: float = -9.0, hi_exp: float = -1.0, n: int = 121) -> pd.DataFrame:
    """:func:`point` over ``g - 1 = +-10^t``, ``t`` in ``[lo_exp, hi_exp]`` (``n`` values each side)."""
    rows = []
    for t in np.linspace(lo_exp, hi_exp, n):
        for sign in (-1.0, 1.0):
            p = point(fmt, formula, arith, 1.0 + sign * 10.0**t, s, base, lora)
            rows.append({"g_minus_1": p["g_minus_1"], "err_ulps": p["err_ulps"], "bound_ulps": p["bound_ulps"],
                         "computed": p["computed"], "exact": p["exact"]})
    return pd.DataFrame(rows).drop_duplicates("g_minus_1").sort_values("g_minus_1").reset_index(drop=True)


# (format, arithmetic, what it shows): the settings notebook 07 compares on the same (s, base, lora)
SETTINGS = (
    ("fp32", "fp32", "fp32 activations: nothing hides the naive form's cancellation"),
    ("bf16", "fp32", "bf16 activations, fp32 intermediates (the contract): one final rounding hides most of it"),
    ("bf16", "per_op", "bf16 activations, every op in bf16 (eager bf16 PyTorch): g itself rounds to 1"),
)


def arithmetics(s=0.5, base=1.0, lora=1e-5, *, n: int = 121, settings=SETTINGS) -> pd.DataFrame:
    """:func:`sweep` of both formulas under each of ``settings``, in one tidy table (columns
    ``format``, ``arith``, ``setting``, ``formula``, ``g_minus_1``, ``err_ulps``, ``bound_ulps``,
    ``g_rounds_to_1``, ``opposite_signs``: ``(g-1)*base`` and ``s*lora`` of opposite signs)."""
    rows = []
    for fmt, arith, what in settings:
        lo, hi = collapse_zone(fmt)
        for formula in FORMULAS:
            sw = sweep(fmt, formula, arith, s, base, lora, n=n)
            g = 1.0 + sw["g_minus_1"]
            _, _, _, b, l_ = _inputs(fmt, 1.0, s, base, lora)
            rows.append(sw.assign(format=get_format(fmt).name, arith=arith, setting=what, formula=formula,
                                  g_rounds_to_1=(g >= lo) & (g <= hi),
                                  opposite_signs=np.sign(sw["g_minus_1"] * b) * np.sign(s * l_) < 0))
    cols = ["format", "arith", "setting", "formula", "g_minus_1", "err_ulps", "bound_ulps", "g_rounds_to_1",
            "opposite_signs", "computed", "exact"]
    return pd.concat(rows, ignore_index=True)[cols]


def effects(sw: pd.DataFrame) -> dict:
    """Per setting of :func:`arithmetics`' table: the largest error of each formula (ULPs), where the
    stable form is the worse, and whether those points lie in the collapse zone with the two terms of
    opposite signs; and every point within its bound."""
    out = {}
    for (fmt, arith), d in sw.groupby(["format", "arith"], sort=False):
        st = d[d.formula == "compose_stable"].set_index("g_minus_1")
        nv = d[d.formula == "compose_naive"].set_index("g_minus_1").reindex(st.index)
        worse = st["err_ulps"] > nv["err_ulps"]
        w = st[worse]
        out[f"{fmt}/{arith}"] = {
            "stable_max_ulps": float(st["err_ulps"].max()), "naive_max_ulps": float(nv["err_ulps"].max()),
            "naive_over_stable": float(nv["err_ulps"].max() / max(st["err_ulps"].max(), 1e-300)),
            "points": int(len(st)), "stable_worse_points": int(worse.sum()),
            "stable_worse_in_zone_opposite_signs": int((w["g_rounds_to_1"] & w["opposite_signs"]).sum()),
            "all_within_bound": bool((d["err_ulps"] <= d["bound_ulps"]).all()),
        }
    return out


def _symlog_ticks(ax, lin: float, hi: float) -> None:
    """Readable ticks on a symmetric-log ``g - 1`` axis: ``0`` and ``+-10^k`` every other decade."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    top = math.ceil(math.log10(hi))
    decades = list(range(top, int(math.log10(lin)) - 1, -2))
    ticks = sorted([-(10.0**k) for k in decades] + [0.0] + [10.0**k for k in decades])
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())

    def fmt(v, _):
        if v == 0:
            return "0"
        return f"{'-' if v < 0 else ''}$10^{{{round(math.log10(abs(v)))}}}$"

    ax.xaxis.set_major_formatter(FuncFormatter(fmt))


def _y_symlog(ax) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_yscale("symlog", linthresh=0.1)
    top = max(1, math.ceil(math.log10(max(ax.get_ylim()[1], 1.0))))
    ax.yaxis.set_major_locator(FixedLocator([0.0] + [10.0**k for k in range(-1, top + 1)]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: "0" if v == 0 else f"$10^{{{round(math.log10(v))}}}$"))


def plot(sw: pd.DataFrame, pt: dict, ax=None, *, y_ticks: bool = True):
    """Error and bound (ULPs of the format) against ``g - 1`` (symlog), the collapse zone shaded
    (``y_ticks=False``: the caller sets the y axis once the data of every shared panel is drawn)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    gm1 = sw["g_minus_1"]
    lin = 10.0 ** math.floor(math.log10(max(abs(gm1[gm1 != 0]).min(), 1e-12)))
    ax.plot(gm1, sw["err_ulps"], ".", ms=3, label="measured |error| (ULPs)")
    ax.plot(gm1, sw["bound_ulps"], "-", lw=1, color="C3", label="a-priori bound (ULPs)")
    ax.axvspan(pt["zone_lo"] - 1.0, pt["zone_hi"] - 1.0, color="grey", alpha=0.25, label=f"fl(g) = 1 in {pt['format']}")
    ax.axvline(pt["g_minus_1"], color="k", lw=0.8, ls=":")
    ax.plot([pt["g_minus_1"]], [pt["err_ulps"]], "o", color="k", label="this point")
    ax.set_xscale("symlog", linthresh=lin)
    _symlog_ticks(ax, lin, abs(gm1).max())
    if y_ticks:
        _y_symlog(ax)
    ax.set(xlabel="g - 1", ylabel=f"error in ULPs of {pt['format']}")
    ax.set_title(f"{pt['formula']}, {pt['arith']}\ns={pt['s']:.4g}, base={pt['base']:.4g}, lora={pt['lora']:.4g}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    return ax


def point_figure(fmt, arith, s, base, lora, g_minus_1, n: int = 121):
    """Both formulas in one arithmetic, side by side (notebook 07's first figure)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True, layout="constrained")
    for ax, formula in zip(axes, FORMULAS):
        plot(sweep(fmt, formula, arith, s, base, lora, n=n), point(fmt, formula, arith, 1.0 + g_minus_1, s, base, lora),
             ax=ax, y_ticks=False)
    _y_symlog(axes[0])
    axes[1].set_ylabel("")
    return fig


def arithmetics_figure(sw: pd.DataFrame):
    """:func:`arithmetics`' table: per setting, both formulas' errors against ``g - 1``, the zone shaded."""
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(zip(sw["format"], sw["arith"], sw["setting"])))
    fig, axes = plt.subplots(len(settings), 1, figsize=(9, 2.9 * len(settings)), sharex=True, layout="constrained")
    for ax, (fmt, arith, what) in zip(np.atleast_1d(axes), settings):
        d = sw[(sw["format"] == fmt) & (sw["arith"] == arith)]
        for formula, style in zip(FORMULAS, ("o-", "s--")):
            e = d[d["formula"] == formula]
            ax.plot(e["g_minus_1"], e["err_ulps"], style, ms=2.5, lw=0.8, label=formula)
        lo, hi = collapse_zone(fmt)
        ax.axvspan(lo - 1.0, hi - 1.0, color="grey", alpha=0.25, label=f"fl(g) = 1 in {fmt}")
        gm1 = d["g_minus_1"]
        lin = 10.0 ** math.floor(math.log10(max(abs(gm1[gm1 != 0]).min(), 1e-12)))
        ax.set_xscale("symlog", linthresh=lin)
        _symlog_ticks(ax, lin, abs(gm1).max())
        _y_symlog(ax)
        ax.set_title(f"{fmt} / {arith}: {what}", fontsize=9.5)
        ax.set_ylabel(f"ulps of {fmt}")
        ax.legend(fontsize=7, loc="upper left", ncol=3)
    np.atleast_1d(axes)[-1].set_xlabel("g - 1")
    return fig


def widgets(fmt="bf16", formula="compose_stable", arith="fp32", log10_gm1=-3.0, gm1_sign=1.0, s=0.5, base=1.0,
            lora=1e-3, n_sweep: int = 61):
    """An ipywidgets panel: controls, a table of :func:`point` and the plot of :func:`sweep`; ``None``
    where no frontend is attached (papermill, nbclient: a widget comm there can stall the run)."""
    from ...repro.notebook import frontend_attached

    if not frontend_attached():
        print("no live panel: no interactive frontend is attached (papermill/nbclient run); open the notebook "
              "in JupyterLab, or set DORA_NUM_WIDGETS=1")
        return None
    import ipywidgets as W
    import matplotlib.pyplot as plt
    from IPython.display import display

    c = {"fmt": W.Dropdown(options=list(STUDIED_FORMATS), value=fmt, description="format"),
         "formula": W.Dropdown(options=list(FORMULAS), value=formula, description="formula"),
         "arith": W.Dropdown(options=list(ARITHS), value=arith, description="arithmetic"),
         "log10_gm1": W.FloatSlider(value=log10_gm1, min=-9, max=-0.5, step=0.05, description="log10|g-1|"),
         "gm1_sign": W.ToggleButtons(options=[("g > 1", 1.0), ("g < 1", -1.0)], value=gm1_sign, description="side"),
         "s": W.FloatText(value=s, description="s"),
         "base": W.FloatText(value=base, description="base"),
         "lora": W.FloatText(value=lora, description="lora")}
    out = W.Output()

    def update(*_):
        out.clear_output(wait=True)
        with out:
            try:
                g = 1.0 + c["gm1_sign"].value * 10.0 ** c["log10_gm1"].value
                args = (c["fmt"].value, c["formula"].value, c["arith"].value)
                pt = point(*args, g, c["s"].value, c["base"].value, c["lora"].value)
                display(pd.Series(pt).to_frame("value"))
                plot(sweep(*args, c["s"].value, c["base"].value, c["lora"].value, n=n_sweep), pt)
                plt.show()
            except ValueError as e:
                print(f"not evaluated: {e}")

    for w in c.values():
        w.observe(update, names="value")
    update()
    return W.VBox([W.HBox([c["fmt"], c["formula"], c["arith"]]), W.HBox([c["log10_gm1"], c["gm1_sign"]]),
                   W.HBox([c["s"], c["base"], c["lora"]]), out])
