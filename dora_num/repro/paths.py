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


# --------------------------------------------------------------------------
# Recorded data: committed files a notebook reads but does not make
# --------------------------------------------------------------------------

class RecordedDataMissing(FileNotFoundError):
    """Recorded data a computation needs is not in the repository; the message names
    every missing file and the command that records it."""


def _resolve(p: str | os.PathLike) -> Path:
    """A ``str`` is a path under the committed ``data/`` (``"gpu/fma_sqrt.csv"``); a
    ``Path`` is taken as it is."""
    return committed_data(*Path(p).parts) if isinstance(p, str) else Path(p)


def missing(files) -> list[Path]:
    """The files of ``files`` (see :func:`_resolve`) that do not exist."""
    return [q for q in map(_resolve, files) if not q.exists()]


def require(files, how_to_record: str) -> list[Path]:
    """The resolved paths of ``files``, or :class:`RecordedDataMissing` naming each missing
    file and ``how_to_record`` (the one way the package says "recorded data missing";
    :mod:`dora_num.repro.recording` re-exports it for the studies)."""
    files = list(files)
    if not files:
        raise ValueError("require() needs at least one file")
    gone = missing(files)
    if gone:
        raise RecordedDataMissing(f"recorded data missing: {', '.join(str(p) for p in gone)}; "
                                  f"record it with: {how_to_record}")
    return [_resolve(p) for p in files]
