"""Repository paths, resolved from the package location (never the cwd).

``DORA_NUM_OUTPUT_ROOT`` redirects ``data/`` and ``figures/`` writes (SMOKE runs
point it at a temporary folder so committed artifacts are never touched);
reads of committed data always come from the repository.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
COMMITTED_DATA_DIR = REPO_ROOT / "data"
COMMITTED_FIGURES_DIR = REPO_ROOT / "figures"
OUTPUT_ROOT_ENV = "DORA_NUM_OUTPUT_ROOT"


def output_root() -> Path:
    """Where new artifacts go: the repository, or ``$DORA_NUM_OUTPUT_ROOT``."""
    env = os.environ.get(OUTPUT_ROOT_ENV)
    return Path(env).resolve() if env else REPO_ROOT


def data_dir(*parts: str) -> Path:
    """Output folder under ``data/`` (created)."""
    p = output_root().joinpath("data", *parts)
    p.mkdir(parents=True, exist_ok=True)
    return p


def figures_dir(*parts: str) -> Path:
    """Output folder under ``figures/`` (created)."""
    p = output_root().joinpath("figures", *parts)
    p.mkdir(parents=True, exist_ok=True)
    return p


def committed_data(*parts: str) -> Path:
    """A path under the repository's committed ``data/`` (read side)."""
    return COMMITTED_DATA_DIR.joinpath(*parts)
