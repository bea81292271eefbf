"""Plot theme and deterministic figure saving (PNG + PDF with fixed metadata)."""

from __future__ import annotations

import io
from pathlib import Path

from .paths import figures_dir
from .provenance import write_artifact

# Fixed metadata so the same data gives the same bytes (no timestamps, no version strings).
_PNG_META = {"Software": None}
_PDF_META = {"Creator": None, "Producer": None, "CreationDate": None}


def set_theme() -> None:
    import matplotlib

    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    matplotlib.rcParams.update({"figure.dpi": 110, "savefig.dpi": 100, "savefig.bbox": "tight",
                                "pdf.fonttype": 42, "svg.hashsalt": "dora-num"})


class SavedFigure(list):
    """The paths written by :func:`save_figure`: a list, shown in a notebook as nothing
    (the figure itself is the output; the staging path it was written to is not)."""

    def __repr__(self) -> str:
        return f"SavedFigure({[p.name for p in self]})"

    def _ipython_display_(self) -> None:
        pass


def save_figure(fig, notebook: str, name: str, **prov) -> SavedFigure:
    """Save ``fig`` as ``figures/<notebook>/<name>.png`` and ``.pdf`` with provenance."""
    out = figures_dir(notebook)
    paths = SavedFigure()
    for ext, meta in (("png", _PNG_META), ("pdf", _PDF_META)):
        def w(buf: io.BytesIO, ext=ext, meta=meta):
            fig.savefig(buf, format=ext, metadata=meta)

        paths.append(write_artifact(out / f"{name}.{ext}", w, **prov))
    return paths
