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
over a range of ``g - 1`` for the plot; :func:`widgets` wires both to ipywidgets.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pandas as pd

from ..numerics.bounds import compose_bound, compose_condition, compose_ulp_bound, one_ulp_condition
from ..numerics.emulate import emulate
from ..numerics.formats import FORMATS, get_format, round_fraction, round_to, ulp, ulp_distance
from ..numerics.formulas import scale_constants

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


def plot(sw: pd.DataFrame, pt: dict, ax=None):
    """Error and bound (ULPs of the format) against ``g - 1`` (symlog), the collapse zone shaded."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    lin = 10.0 ** math.floor(math.log10(max(min(abs(sw["g_minus_1"][sw["g_minus_1"] != 0]).min(), 1e-9), 1e-12)))
    ax.plot(sw["g_minus_1"], sw["err_ulps"], ".", ms=3, label="measured |error| (ULPs)")
    ax.plot(sw["g_minus_1"], sw["bound_ulps"], "-", lw=1, color="C3", label="a-priori bound (ULPs)")
    ax.axvspan(pt["zone_lo"] - 1.0, pt["zone_hi"] - 1.0, color="grey", alpha=0.25, label=f"fl(g) = 1 in {pt['format']}")
    ax.axvline(pt["g_minus_1"], color="k", lw=0.8, ls=":")
    ax.plot([pt["g_minus_1"]], [pt["err_ulps"]], "o", color="k", label="this point")
    ax.set_xscale("symlog", linthresh=lin)
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set(xlabel="g - 1", ylabel=f"error in ULPs of {pt['format']}",
           title=f"{pt['formula']}, {pt['arith']}, s={pt['s']:.4g}, base={pt['base']:.4g}, lora={pt['lora']:.4g}")
    ax.legend(fontsize=7, loc="upper left")
    return ax


def widgets(fmt="bf16", formula="compose_stable", arith="fp32", log10_gm1=-3.0, gm1_sign=1.0, s=0.5, base=1.0,
            lora=1e-3, n_sweep: int = 61):
    """An ipywidgets panel: controls, a table of :func:`point` and the plot of :func:`sweep`."""
    import ipywidgets as W
    import matplotlib.pyplot as plt
    from IPython.display import display

    c = {"fmt": W.Dropdown(options=list(FORMATS), value=fmt, description="format"),
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
