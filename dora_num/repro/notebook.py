"""``setup()``: the second cell of every notebook.

Sets the plot theme and seeds, decides where artifacts go (the repository, or a
temporary folder in SMOKE mode so committed files are never touched), and
returns a small context with the notebook's output folders and save helpers.
Works the same from JupyterLab (cwd ``notebooks/``) and papermill (any cwd).
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import paths
from .plotting import save_figure, set_theme
from .provenance import save_dataframe, save_json


@dataclass
class NotebookContext:
    name: str
    smoke: bool
    seed: int
    params: dict = field(default_factory=dict)

    @property
    def data_dir(self) -> Path:
        return paths.data_dir(self.name)

    @property
    def figures_dir(self) -> Path:
        return paths.figures_dir(self.name)

    def _prov(self, prov: dict) -> dict:
        prov.setdefault("params", self.params)
        prov.setdefault("seed", self.seed)
        prov.setdefault("producer", f"notebooks/{self.name}.ipynb")
        return prov

    def save_figure(self, fig, name: str, **prov):
        return save_figure(fig, self.name, name, **self._prov(prov))

    def save_table(self, df, filename: str, **prov):
        return save_dataframe(df, self.data_dir / filename, **self._prov(prov))

    def save_json(self, obj, filename: str, **prov):
        return save_json(obj, self.data_dir / filename, **self._prov(prov))


def setup(name: str, *, smoke: bool = False, seed: int = 0, params: dict | None = None) -> NotebookContext:
    """Prepare a notebook run; ``name`` is the notebook's stem, e.g. ``"00_overview"``."""
    set_theme()
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    import torch

    torch.manual_seed(seed)
    if smoke and not os.environ.get(paths.OUTPUT_ROOT_ENV):
        os.environ[paths.OUTPUT_ROOT_ENV] = tempfile.mkdtemp(prefix="dora-num-smoke-")
    return NotebookContext(name=name, smoke=smoke, seed=seed, params=dict(params or {}))
