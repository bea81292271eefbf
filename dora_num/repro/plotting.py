"""Plot theme and deterministic figure saving (PNG with fixed metadata; PDF on request).

Committed figures are PNG only: the 76 PDFs beside them took 1.2 MB of the repository's 15 MB budget
for data and figures.  ``save_figure(..., formats=("png", "pdf"))`` also writes a PDF (deterministic
metadata too) for print.  An opaque figure's PNG is stored as RGB, losslessly (:func:`png_bytes`): its
alpha channel holds only 255, a quarter of the pixels' bytes, about 0.4 MB over the committed figures."""

from __future__ import annotations

import io
import sys
from pathlib import Path

from .layout import text_problems
from .paths import figures_dir
from .provenance import carry_checks, read_provenance, write_artifact

# Fixed metadata so the same data gives the same bytes (no timestamps, no version strings).
_PNG_META = {"Software": None}
_PDF_META = {"Creator": None, "Producer": None, "CreationDate": None}


def png_bytes(fig, meta: dict | None = None) -> bytes:
    """``fig`` as PNG bytes: matplotlib's RGBA rendering, stored as RGB when every pixel is opaque (the same
    pixels, without a channel that carries nothing) and written by Pillow at its highest compression, the
    resolution (pHYs) kept; a figure with any transparent pixel keeps its alpha channel."""
    from PIL import Image

    raw = io.BytesIO()
    fig.savefig(raw, format="png", metadata=_PNG_META if meta is None else meta)
    im = Image.open(io.BytesIO(raw.getvalue()))
    if im.mode == "RGBA" and im.getchannel("A").getextrema() == (255, 255):
        im = im.convert("RGB")
    out = io.BytesIO()
    im.save(out, format="png", optimize=True, **({"dpi": im.info["dpi"]} if "dpi" in im.info else {}))
    return out.getvalue()


def set_theme() -> None:
    import matplotlib

    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    matplotlib.rcParams.update({"figure.dpi": 110, "savefig.dpi": 100, "savefig.bbox": "tight",
                                "pdf.fonttype": 42, "svg.hashsalt": "dora-num"})


def legend_outside(ax, fontsize: float = 7) -> None:
    """Move ``ax``'s legend (seaborn's, with its titles, or matplotlib's) right of the panel,
    its upper left corner at the axes' upper right: clear of the data and the tick labels."""
    import seaborn as sns

    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1.0), fontsize=fontsize, title_fontsize=fontsize)


class SavedFigure(list):
    """The paths written by :func:`save_figure`: a list, shown in a notebook as nothing
    (the figure itself is the output; the staging path it was written to is not)."""

    def __repr__(self) -> str:
        return f"SavedFigure({[p.name for p in self]})"

    def _ipython_display_(self) -> None:
        pass


def _show_saved(fig, rel: str) -> None:
    """In a notebook kernel: show ``fig`` now, its output tagged with the file it was saved to
    (``figures/<rel>``: what the rendered page links, :mod:`dora_num.repro.render`), and close it,
    so the inline backend does not show it a second time, untagged, at the end of the cell."""
    from IPython import get_ipython

    if getattr(get_ipython(), "kernel", None) is None:
        return
    import matplotlib.pyplot as plt
    from IPython.display import display

    from .render import FIGURE_META

    display(fig, metadata={FIGURE_META: rel})
    plt.close(fig)


def save_figure(fig, notebook: str, name: str, *, formats=("png",), **prov) -> SavedFigure:
    """Save ``fig`` as ``figures/<notebook>/<name>.<ext>`` for each of ``formats`` ("png", "pdf"),
    with provenance; its text checked for overlaps and clipping (:mod:`dora_num.repro.layout`: a
    warning on stderr, the result in the sidecar's ``extra.text_layout``); in a notebook, shown
    once, tagged with its file (:func:`_show_saved`)."""
    out = figures_dir(notebook)
    paths = SavedFigure()
    metas = {"png": _PNG_META, "pdf": _PDF_META}
    unknown = set(formats) - set(metas)
    if unknown:
        raise ValueError(f"save_figure: formats must be among {sorted(metas)}, got {sorted(unknown)}")
    problems = text_problems(fig)
    if problems:
        print(f"save_figure {notebook}/{name}: {len(problems)} text(s) overlap or are clipped: {problems[0]}"
              + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), file=sys.stderr)
    layout = {"check": "dora_num.repro.layout.text_problems", "problems": problems}
    prov["extra"] = {**(prov.get("extra") or {}), "text_layout": layout}
    for ext, meta in ((e, metas[e]) for e in formats):
        def w(buf: io.BytesIO, ext=ext, meta=meta):
            if ext == "png":
                buf.write(png_bytes(fig, meta))
            else:
                fig.savefig(buf, format=ext, metadata=meta)

        path = write_artifact(out / f"{name}.{ext}", w, **prov)
        if read_provenance(path).get("extra", {}).get("text_layout") != layout:  # the same bytes as before
            carry_checks(path, {**read_provenance(path), "extra": prov["extra"]})
        paths.append(path)
    _show_saved(fig, f"{notebook}/{name}.png" if "png" in formats else f"{notebook}/{name}.{formats[0]}")
    return paths
