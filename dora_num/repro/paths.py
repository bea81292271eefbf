"""Repository paths, resolved from the package location (never the cwd).

``DORA_NUM_OUTPUT_ROOT`` redirects ``data/`` and ``figures/`` writes (SMOKE runs
point it at a temporary folder so committed artifacts are never touched);
reads of committed data always come from the repository.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
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
    file and ``how_to_record`` (the one way the package says "recorded data missing")."""
    files = list(files)
    if not files:
        raise ValueError("require() needs at least one file")
    gone = missing(files)
    if gone:
        raise RecordedDataMissing(f"recorded data missing: {', '.join(str(p) for p in gone)}; "
                                  f"record it with: {how_to_record}")
    return [_resolve(p) for p in files]


@dataclass(frozen=True)
class DataSet:
    """A recorded data set: its ``files`` (paths under ``data/``), the command that records them
    and the notebooks that read them (``notebooks``: needed by a full run; ``optional``: read
    where present).

    ``recorder`` is a ``dora-num record`` command (``"exhaustive --only census"``; its first word
    is the subcommand), a device script (``"python3 .ci/gpu/..."``, ``"bash .ci/gpu/..."``) or a
    notebook run (``"notebook 01 with RECOMPUTE_PAPER_SHAPE=True"``).  ``where``: the machine it
    needs; ``ingest``: measured into ``--out`` there, then ingested here (a CPU recorder writes
    into ``data/`` itself).  The table of all of them: :mod:`dora_num.studies.datasets`.

    ``files`` is declared as ``{role: path}``: writers and readers ask for a file by its role
    (:meth:`path`, :meth:`filename`), so a file's name is typed once, here (tests/studies/test_datasets.py
    fails on a declared name typed anywhere else).  ``module`` and ``about``: the ``dora-num record``
    subcommand's module and its one-line help (given by one data set of each subcommand; the recorder
    registry, :data:`dora_num.studies.datasets.RECORDERS`, is derived from them)."""

    name: str
    files: tuple[str, ...]
    recorder: str
    notebooks: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    where: str = "the H200"
    ingest: bool = True
    module: str = ""
    about: str = ""
    roles: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self):
        if isinstance(self.files, Mapping):
            object.__setattr__(self, "roles", tuple(self.files))
            object.__setattr__(self, "files", tuple(self.files.values()))
        if self.roles and len(self.roles) != len(self.files):
            raise ValueError(f"{self.name}: {len(self.roles)} roles for {len(self.files)} files")

    @property
    def kind(self) -> str:
        """``"record"`` (a ``dora-num record`` subcommand), ``"script"`` or ``"notebook"``."""
        first = self.recorder.split()[0]
        return "notebook" if first == "notebook" else "script" if first in ("python3", "bash") else "record"

    @property
    def subcommand(self) -> str | None:
        return self.recorder.split()[0] if self.kind == "record" else None

    @property
    def producer(self) -> str:
        """What every sidecar of the data set names as its producer."""
        if self.kind == "record":
            return f"dora-num record {self.subcommand}"
        if self.kind == "notebook":
            return f"notebooks/{_notebook_stem(self.recorder.split()[1])}.ipynb"
        return self.recorder

    @property
    def how_to_record(self) -> str:
        if self.kind == "notebook":
            return f"run {self.recorder} ({self.where})"
        if self.kind == "script":
            return (f"here ({self.where}): {self.recorder}" if not self.ingest else
                    f"on {self.where}: {self.recorder}, then ingest its output with repro.recording.ingest")
        if not self.ingest:
            return f"here ({self.where}): dora-num record {self.recorder}"
        rest = self.recorder.split(maxsplit=1)[1:]
        return (f"on {self.where}: dora-num record {' '.join([self.subcommand, '--out DIR', *rest])}; "
                f"then here: dora-num record {self.subcommand} --ingest DIR --git-sha SHA")

    def file(self, role: str | None = None) -> str:
        """The file of ``role`` (the only file where ``role`` is None), as declared: a path under ``data/``."""
        if role is None:
            if len(self.files) != 1:
                raise ValueError(f"{self.name} has {len(self.files)} files: name one by its role ({', '.join(self.roles)})")
            return self.files[0]
        if role not in self.roles:
            raise ValueError(f"{self.name} has no file {role!r}; its roles: {', '.join(self.roles) or 'none'}")
        return self.files[self.roles.index(role)]

    def filename(self, role: str | None = None) -> str:
        """The base name of the file of ``role`` (the only file where ``role`` is None), e.g. what a recorder
        writes into its own output folder."""
        return Path(self.file(role)).name

    def relpath(self, role: str | None = None) -> str:
        """The file of ``role`` relative to the data set's :attr:`folder` (its name inside a record)."""
        return os.path.relpath(self.file(role), self.folder)

    def path(self, role: str | None = None, folder: str | os.PathLike | None = None) -> Path:
        """The file of ``role`` (the only file where ``role`` is None) under ``data/``, or at its place under
        ``folder`` (another record, a recorder's output folder): see :meth:`paths`."""
        return self.paths(folder)[self.files.index(self.file(role))]

    def subset(self, *roles: str) -> "DataSet":
        """The same data set restricted to the files of ``roles`` (what one reader needs of it)."""
        for r in roles:
            self.file(r)  # an unknown role fails here, by name
        files = {r: f for r, f in zip(self.roles, self.files) if r in roles}  # in the declaration's order
        return DataSet(self.name, files, self.recorder, self.notebooks, self.optional, self.where, self.ingest,
                       self.module, self.about)

    @property
    def folder(self) -> str:
        """The folder under ``data/`` that holds every file of the data set."""
        return os.path.commonpath([os.path.dirname(f) or "." for f in self.files])

    def paths(self, folder: str | os.PathLike | None = None) -> list[Path]:
        """The files under ``data/``, or at the same places under ``folder`` (another record)."""
        if folder is None:
            return [_resolve(f) for f in self.files]
        return [Path(folder) / os.path.relpath(f, self.folder) for f in self.files]

    def dest(self) -> Path:
        """Where an ingest writes the data set (under :func:`output_root`'s ``data/``; created)."""
        return data_dir(*Path(self.folder).parts)

    def missing(self, folder: str | os.PathLike | None = None) -> list[Path]:
        return missing(self.paths(folder))

    def require(self, folder: str | os.PathLike | None = None) -> list[Path]:
        """:meth:`paths`, or :class:`RecordedDataMissing` naming each missing file and how to record it."""
        return require(self.paths(folder), self.how_to_record)


def _notebook_stem(number: str) -> str:
    stems = sorted(p.stem for p in NOTEBOOKS_DIR.glob(f"{number}_*.ipynb"))
    return stems[0] if stems else number
