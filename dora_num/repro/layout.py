"""Text a reader cannot read: overlapping or clipped labels in a figure.

:func:`text_problems` draws the figure and takes every visible, non-empty text: the
suptitle and other figure texts, each axes' titles, axis labels, the tick labels of the
ticks in view, legend texts and titles, annotations.  A text is *clipped* when its window
extent leaves the area the saved file shows (by more than :data:`TOLERANCE_PX`): the
figure's tight box plus its padding under ``savefig.bbox = "tight"`` (the theme's, and the
inline backend's), else the canvas.  Two texts *overlap* when their extents intersect
by more than :data:`TOLERANCE_PX` in both directions (a rotated text counts by its rotated
box, the axis-aligned box of its glyphs).  :func:`dora_num.repro.plotting.save_figure`
runs it on every figure it saves and records the result in the sidecar (``layout``);
``tests/repro/test_figure_text.py`` holds every committed figure to an empty list.
"""

from __future__ import annotations

import numpy as np

# Two labels that touch (one pixel of antialiasing at 100 dpi) are still readable.
TOLERANCE_PX = 1.0


def _texts(fig) -> list[tuple[str, object]]:
    """``(description, Text)`` of every text the drawn figure shows."""
    out = []

    def add(what, t):
        if t is not None and t.get_visible() and t.get_text().strip():
            out.append((what, t))

    for t in fig.texts:
        add("figure text", t)
    for i, ax in enumerate(fig.axes):
        if not ax.get_visible():
            continue
        name = f"axes {i}"
        for loc in ("left", "center", "right"):
            add(f"{name} title", ax.title if loc == "center" else getattr(ax, f"_{loc}_title"))
        for axis, which in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            if not axis.get_visible():
                continue
            add(f"{name} {which}label", axis.label)
            # in the axis's own scale (log, symlog): a tick out of view keeps a stale label box, and on a
            # log axis spanning 1e16 a tolerance taken in data units would let every tick in
            scale = axis.get_transform()
            lo, hi = sorted(scale.transform(np.asarray(axis.get_view_interval(), dtype=float)))
            span = (hi - lo) or 1.0
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                loc = scale.transform(np.asarray([tick.get_loc()], dtype=float))[0]
                if lo - 1e-9 * span <= loc <= hi + 1e-9 * span:
                    for label in (tick.label1, tick.label2):
                        if label.get_visible() and tick.get_visible():
                            add(f"{name} {which} tick", label)
            add(f"{name} {which} offset", axis.get_offset_text())
        for t in ax.texts:
            add(f"{name} text", t)
        legend = ax.get_legend()
        if legend is not None and legend.get_visible():
            add(f"{name} legend title", legend.get_title())
            for t in legend.get_texts():
                add(f"{name} legend", t)
    for legend in fig.legends:
        if legend.get_visible():
            add("figure legend title", legend.get_title())
            for t in legend.get_texts():
                add("figure legend", t)
    return out


def text_problems(fig) -> list[str]:
    """Every clipped text and every overlapping pair of texts in ``fig`` (module docstring),
    one line each, naming the texts; empty when every label is readable."""
    import matplotlib as mpl
    from matplotlib.transforms import Bbox

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    if mpl.rcParams["savefig.bbox"] == "tight":
        pad = mpl.rcParams["savefig.pad_inches"]
        tight = fig.get_tightbbox(renderer)  # inches
        canvas = Bbox.from_extents(tight.x0 - pad, tight.y0 - pad, tight.x1 + pad,
                                   tight.y1 + pad).transformed(fig.dpi_scale_trans)
    boxes = [(what, t, t.get_window_extent(renderer)) for what, t in _texts(fig)]
    tol = TOLERANCE_PX
    problems = []
    for what, t, b in boxes:
        if b.x0 < canvas.x0 - tol or b.y0 < canvas.y0 - tol or b.x1 > canvas.x1 + tol or b.y1 > canvas.y1 + tol:
            problems.append(f"clipped: {what} {t.get_text()!r}")
    for i, (wa, ta, a) in enumerate(boxes):
        for wb, tb, b in boxes[i + 1:]:
            dx = min(a.x1, b.x1) - max(a.x0, b.x0)
            dy = min(a.y1, b.y1) - max(a.y0, b.y0)
            if dx > tol and dy > tol:
                problems.append(f"overlap: {wa} {ta.get_text()!r} and {wb} {tb.get_text()!r}")
    return problems
