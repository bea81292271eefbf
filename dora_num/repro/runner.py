"""Run the notebooks headlessly with papermill, in order.

Full mode writes every artifact into a staging folder (``build/staging``) and
moves it into ``data/``/``figures/`` (or the ``dest`` folder of a check run) only
after the notebook finished without error, so a failing notebook leaves committed
files untouched; an artifact whose bytes did not change is not moved (its file and
sidecar stay as committed).  SMOKE mode writes into a temporary folder and never
touches the repository's artifacts.  Executed notebooks go to ``build/notebooks/``
(git-ignored); a full run also renders each to ``notebooks/rendered/NN_topic.md``
(:mod:`dora_num.repro.render`).  The kernel runs with the pinned CPU kernel choice
of :mod:`dora_num.repro.determinism`, on the project's kernelspec ``dora-num``, with
``DORA_NUM_WIDGETS=0`` (no widget comm headless: :func:`dora_num.repro.notebook.frontend_attached`).

Limits (:class:`Limits`): every cell runs under papermill's ``execution_timeout`` and the
whole notebook under a wall-clock limit (each cell's timeout is the smaller of the two that
is left); a notebook that ran past either, or whose kernel died, is run again ``retries``
times from a fresh kernel and staging folder, then fails with one message naming the
notebook, the cell and the limit.  Progress: one line per notebook, papermill's bar per cell.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .determinism import pinned_env
from .notebook import WIDGETS_ENV


class NotebookFailed(RuntimeError):
    """A notebook raised; the message names the notebook and the cell."""


class NotebookTimedOut(NotebookFailed):
    """A cell ran past its limit (or the kernel died) on every attempt: ``what`` happened where,
    and ``hint``."""

    def __init__(self, what: str, hint: str):
        super().__init__(f"{what}; {hint}")
        self.what, self.hint = what, hint


@dataclass(frozen=True)
class Limits:
    """Wall-clock limits of one notebook run (``dora-num reproduce --cell-timeout/--timeout``)."""

    # The slowest cell of a full run, notebook 01's compose claim on every module, took 170 s on 2 cores
    # shared with other jobs (build/notebooks/*.ipynb, papermill.duration); 10x that is a hung kernel.
    cell_s: float = 1800.0
    # The slowest notebook, 02, took 12 minutes of a full run on 2 shared cores (the same files); 5x that.
    notebook_s: float = 3600.0
    retries: int = 1  # runs again after a timeout or a dead kernel (nbclient's widget-comm stall is intermittent)

    def __post_init__(self):
        if not (self.cell_s > 0 and self.notebook_s > 0 and self.retries >= 0):
            raise ValueError(f"limits must be positive (retries >= 0), got {self}")


# A SMOKE run of each notebook takes under 60 s on 2 idle cores; a slower one is reported, not failed
# (its time depends on the machine's load: a benchmark's claim, not a test's).
SMOKE_BUDGET_S = 60.0


@dataclass
class RunResult:
    notebook: str
    seconds: float
    executed: Path | None
    artifacts: list[Path]
    skipped: str | None = None  # why a full run did not execute the notebook
    out_root: Path | None = None  # where the artifacts are (SMOKE: the temporary folder)


def missing_recorded_inputs(nb: Path) -> list[str]:
    """Recorded inputs (repo-relative paths) a notebook's full mode needs and that are absent.

    A notebook declares them in its metadata, ``{"dora_num": {"requires": [...]}}``
    (repository-relative paths; every notebook declares the list, empty if it reads
    no recorded data): data that a GPU run or a long CPU recording produced.  SMOKE
    mode never needs them.
    """
    import nbformat

    meta = nbformat.read(nb, as_version=4).metadata.get("dora_num", {})
    return [r for r in meta.get("requires", []) if paths.missing([paths.REPO_ROOT / r])]


def list_notebooks(only: list[str] | None = None, notebooks_dir: Path | None = None) -> list[Path]:
    """Notebooks ``NN_topic.ipynb`` in order; ``only`` picks by number (``0``, ``00``), stem
    (``00_overview``), name (``overview``) or file (``notebooks/00_overview.ipynb``)."""
    nbs = sorted((Path(notebooks_dir) if notebooks_dir else paths.NOTEBOOKS_DIR).glob("[0-9][0-9]_*.ipynb"))
    if only:
        def matches(p: Path, w: str) -> bool:
            w = Path(w).stem if w.endswith(".ipynb") else w
            return w in (p.stem, p.stem[3:]) or (w.isdigit() and w.zfill(2) == p.stem[:2])

        missing = [w for w in only if not any(matches(p, w) for p in nbs)]
        if missing:
            raise FileNotFoundError(f"no notebook matches {missing}; have {[p.stem for p in nbs]} "
                                    "(a number, a stem or a name: 00, 00_overview, overview)")
        nbs = [p for p in nbs if any(matches(p, w) for w in only)]
    return nbs


_SKIP_TAGS = {"injected-parameters", "papermill-error-cell-tag"}


def _first_line(source: str) -> str:
    return next((line for line in source.splitlines() if line.strip()), "")[:80]


def _source_cell(executed: Path) -> tuple[int | str, str]:
    """The failing cell as a 1-based index into the *source* notebook (papermill's
    injected parameters and error-banner cells not counted) and its first line."""
    import nbformat

    n = 0
    for cell in nbformat.read(executed, as_version=4).cells:
        if _SKIP_TAGS & set(cell.metadata.get("tags", [])):
            continue
        n += 1
        if cell.cell_type == "code" and any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return n, _first_line(cell.source)
    return "?", ""


def _cell_position(nb, cell) -> tuple[int | str, str]:
    """``cell``'s 1-based index in the source notebook (as :func:`_source_cell`) and its first line."""
    n = 0
    for c in nb.cells:
        if _SKIP_TAGS & set(c.metadata.get("tags", [])):
            continue
        n += 1
        if c is cell or (c.get("id") and c.get("id") == cell.get("id")):
            return n, _first_line(c.source)
    return "?", _first_line(cell.get("source", ""))


def _promote(staging: Path, dest: Path) -> list[Path]:
    """Move every artifact under ``staging`` (with its sidecar) into ``dest``; one whose
    bytes equal the file already there is dropped, so its committed sidecar stays (with the
    current result of the checks on its content, :data:`~dora_num.repro.provenance.CHECK_FIELDS`).
    Returns the artifacts now at ``dest`` that this run produced (changed or not)."""
    from .provenance import carry_checks, sha256_file, unchanged

    out = []
    side = ".provenance.json"
    for src in sorted(p for p in staging.rglob("*") if p.is_file() and not p.name.endswith(side)):
        target = dest / src.relative_to(staging)
        src_side, target_side = Path(str(src) + side), Path(str(target) + side)
        if target.is_file() and unchanged(target, src.read_bytes()):
            if src_side.is_file():  # the same bytes: the committed sidecar stays, with the checks' current result
                carry_checks(target, json.loads(src_side.read_text()))
            src.unlink()
            src_side.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            if src_side.is_file():
                os.replace(src_side, target_side)
            os.replace(src, target)
            if target_side.is_file():
                assert json.loads(target_side.read_text())["sha256"] == sha256_file(target), target
        out.append(target)
    return out


@contextmanager
def _environ(changes: dict[str, str]):
    """Set environment variables for the kernel subprocess, restored afterwards."""
    old = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Clock:
    """Each cell's timeout: the cell limit or what is left of the notebook's, the smaller
    (nbclient's ``timeout_func``); remembers the cell it last timed, to name it."""

    def __init__(self, limits: Limits):
        self.limits, self.deadline, self.cell = limits, time.monotonic() + limits.notebook_s, None

    def __call__(self, cell) -> int:
        self.cell = cell
        return max(1, math.ceil(min(self.limits.cell_s, self.deadline - time.monotonic())))

    def notebook_limit_hit(self) -> bool:
        return time.monotonic() >= self.deadline - 1


def _execute(nb: Path, executed: Path, params: dict, kernel: str, out_root: Path, limits: Limits,
             progress: bool) -> None:
    """One papermill run under ``limits``; a timeout or a dead kernel raises :class:`NotebookTimedOut`."""
    import nbformat
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    clock = _Clock(limits)
    try:
        with _environ({paths.OUTPUT_ROOT_ENV: str(out_root), "PYDEVD_DISABLE_FILE_VALIDATION": "1",
                       WIDGETS_ENV: "0", **pinned_env()}):
            pm.execute_notebook(str(nb), str(executed), parameters=params, kernel_name=kernel,
                                cwd=str(nb.parent), progress_bar=progress, log_output=False,
                                execution_timeout=math.ceil(limits.cell_s), timeout_func=clock,
                                # the kernel listens on loopback only; its "TCP without encryption"
                                # warning on every start says nothing about this use
                                extra_arguments=["--IPKernelApp.log_level=ERROR"])
    except PapermillExecutionError as e:
        cell, first_line = _source_cell(executed)
        raise NotebookFailed(
            f"{nb.name} failed in cell {cell} [{first_line}]: {e.ename}: {e.evalue}\n"
            f"executed copy: {executed}"
        ) from None
    except (CellTimeoutError, DeadKernelError) as e:
        cell, first_line = ("?", "") if clock.cell is None else _cell_position(nbformat.read(nb, as_version=4), clock.cell)
        if isinstance(e, DeadKernelError):
            what = "the kernel died"
        elif clock.notebook_limit_hit():
            what = f"the notebook ran past its limit of {limits.notebook_s:.0f} s (--timeout)"
        else:
            what = f"the cell ran past its limit of {limits.cell_s:.0f} s (--cell-timeout)"
        raise NotebookTimedOut(f"{nb.name}: {what} in cell {cell} [{first_line}]",
                               f"a hung kernel or a slower machine (raise the limit); executed copy so far: {executed}"
                               ) from None


def run_notebook(nb: Path, *, smoke: bool, build_dir: Path, parameters: dict | None = None,
                 progress: bool = False, dest: Path | None = None, smoke_dir: Path | None = None,
                 render: bool = True, limits: Limits = Limits()) -> RunResult:
    """Execute one notebook.  Full mode promotes its artifacts into ``dest`` (default: the
    repository) and renders it to ``dest/notebooks/rendered/``; SMOKE mode writes into
    ``smoke_dir`` (default: a new temporary folder, named on stdout).  A timeout or a dead
    kernel is retried ``limits.retries`` times, then raises :class:`NotebookTimedOut`."""
    from .kernel import ensure_kernelspec, notebook_kernel

    executed = build_dir / "notebooks" / nb.name
    executed.parent.mkdir(parents=True, exist_ok=True)
    params = {"SMOKE": smoke, **(parameters or {})}
    if smoke:
        out_root = Path(smoke_dir) if smoke_dir else Path(tempfile.mkdtemp(prefix=f"dora-num-smoke-{nb.stem}-"))
    else:
        out_root = build_dir / "staging" / nb.stem
    kernel = notebook_kernel(nb)
    ensure_kernelspec(kernel)
    t0 = time.perf_counter()
    for attempt in range(limits.retries + 1):
        shutil.rmtree(out_root, ignore_errors=True)  # each attempt starts from an empty folder
        out_root.mkdir(parents=True)
        try:
            _execute(nb, executed, params, kernel, out_root, limits, progress)
            break
        except NotebookTimedOut as e:
            if attempt == limits.retries:
                raise NotebookTimedOut(f"{e.what} (after {attempt + 1} attempt{'s' if attempt else ''})",
                                       e.hint) from None
            print(f"{e.what}; running it again ({attempt + 2} of {limits.retries + 1})", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    if smoke:
        return RunResult(nb.stem, seconds, executed, sorted(p for p in out_root.rglob("*") if p.is_file()),
                         out_root=out_root)
    dest = Path(dest) if dest is not None else paths.REPO_ROOT
    artifacts = _promote(out_root, dest)
    if render:
        from .render import render_notebook

        render_notebook(executed, dest / "notebooks" / "rendered" / f"{nb.stem}.md", nb.stem)
    return RunResult(nb.stem, seconds, executed, artifacts, out_root=dest)


def reproduce(only: list[str] | None = None, *, smoke: bool = False, build_dir: Path | None = None,
              parameters: dict | None = None, notebooks_dir: Path | None = None, dest: Path | None = None,
              smoke_dir: Path | None = None, limits: Limits = Limits(), progress: bool = False) -> list[RunResult]:
    """Run the notebooks in order; the first failure raises :class:`NotebookFailed`.

    ``dest``: where a full run's artifacts go (default: the repository; ``--check``
    passes a temporary folder).  ``smoke_dir``: where SMOKE artifacts go (one
    subfolder per notebook; default: a temporary folder per notebook).  ``progress``:
    papermill's per-cell bar on stderr."""
    build_dir = Path(build_dir) if build_dir else paths.REPO_ROOT / "build"
    results = []
    nbs = list_notebooks(only, notebooks_dir)
    if not nbs:
        raise FileNotFoundError(f"no notebooks NN_*.ipynb in {notebooks_dir or paths.NOTEBOOKS_DIR}")
    t0 = time.perf_counter()
    for i, nb in enumerate(nbs, 1):
        head = f"[{i}/{len(nbs)}] {nb.stem}"
        missing = [] if smoke else missing_recorded_inputs(nb)
        if missing:
            res = RunResult(nb.stem, 0.0, None, [], skipped=f"recorded data missing: {', '.join(missing)}")
            print(f"{head}: SKIPPED ({res.skipped}); its figures are not regenerated", flush=True)
        else:
            print(f"{head}: running (limits {limits.cell_s:.0f} s a cell, {limits.notebook_s:.0f} s in all)",
                  flush=True)
            res = run_notebook(nb, smoke=smoke, build_dir=build_dir, parameters=parameters, dest=dest,
                               smoke_dir=None if smoke_dir is None else Path(smoke_dir) / nb.stem, limits=limits,
                               progress=progress)
            where = f"; SMOKE artifacts in {res.out_root}" if smoke else ""
            slow = (f" (over the SMOKE budget of {SMOKE_BUDGET_S:.0f} s on 2 idle cores)"
                    if smoke and res.seconds > SMOKE_BUDGET_S else "")
            print(f"{head}: ok in {res.seconds:.1f} s{slow}, {len(res.artifacts)} artifacts{where}; "
                  f"{time.perf_counter() - t0:.0f} s so far", flush=True)
        results.append(res)
    skipped = [r for r in results if r.skipped]
    if skipped:
        print(f"{len(skipped)} notebook(s) skipped for missing recorded data: "
              + "; ".join(f"{r.notebook} ({r.skipped})" for r in skipped), flush=True)
    return results
