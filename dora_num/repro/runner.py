"""Run the notebooks headlessly with papermill, in order.

Full mode writes every artifact into a staging folder (``build/staging``) and
moves it into ``data/``/``figures/`` (or the ``dest`` folder of a check run) only
after the notebook finished without error, so a failing notebook leaves committed
files untouched; an artifact whose bytes did not change is not moved (its file and
sidecar stay as committed).  SMOKE mode writes into a temporary folder and never
touches the repository's artifacts.  Executed notebooks go to ``build/notebooks/``
(git-ignored); a full run also renders each to ``notebooks/rendered/NN_topic.md``
(:mod:`dora_num.repro.render`).  The kernel runs with the pinned CPU kernel choice
of :mod:`dora_num.repro.determinism`, on the project's kernelspec ``dora-num``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .determinism import pinned_env


class NotebookFailed(RuntimeError):
    """A notebook raised; the message names the notebook and the cell."""


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
    """Notebooks ``NN_topic.ipynb`` in order; ``only`` picks by number or stem."""
    nbs = sorted((Path(notebooks_dir) if notebooks_dir else paths.NOTEBOOKS_DIR).glob("[0-9][0-9]_*.ipynb"))
    if only:
        wanted = {o.split("_")[0].zfill(2) if o[:2].isdigit() else o for o in only}
        picked = [p for p in nbs if p.stem[:2] in wanted or p.stem in wanted]
        missing = sorted(w for w in wanted if not any(p.stem[:2] == w or p.stem == w for p in nbs))
        if missing:
            raise FileNotFoundError(f"no notebook matches {missing}; have {[p.stem for p in nbs]}")
        nbs = picked
    return nbs


def _source_cell(executed: Path) -> tuple[int | str, str]:
    """The failing cell as a 1-based index into the *source* notebook (papermill's
    injected parameters and error-banner cells not counted) and its first line."""
    import nbformat

    skip = {"injected-parameters", "papermill-error-cell-tag"}
    n = 0
    for cell in nbformat.read(executed, as_version=4).cells:
        if skip & set(cell.metadata.get("tags", [])):
            continue
        n += 1
        if cell.cell_type == "code" and any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            first = next((line for line in cell.source.splitlines() if line.strip()), "")
            return n, first[:80]
    return "?", ""


def _promote(staging: Path, dest: Path) -> list[Path]:
    """Move every artifact under ``staging`` (with its sidecar) into ``dest``; one whose
    bytes equal the file already there is dropped, so its committed sidecar stays.
    Returns the artifacts now at ``dest`` that this run produced (changed or not)."""
    from .provenance import sha256_file, unchanged

    out = []
    side = ".provenance.json"
    for src in sorted(p for p in staging.rglob("*") if p.is_file() and not p.name.endswith(side)):
        target = dest / src.relative_to(staging)
        src_side, target_side = Path(str(src) + side), Path(str(target) + side)
        if target.is_file() and unchanged(target, src.read_bytes()):
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


def run_notebook(nb: Path, *, smoke: bool, build_dir: Path, parameters: dict | None = None,
                 progress: bool = False, dest: Path | None = None, smoke_dir: Path | None = None,
                 render: bool = True) -> RunResult:
    """Execute one notebook.  Full mode promotes its artifacts into ``dest`` (default: the
    repository) and renders it to ``dest/notebooks/rendered/``; SMOKE mode writes into
    ``smoke_dir`` (default: a new temporary folder, named on stdout)."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    from .kernel import ensure_kernelspec, notebook_kernel

    executed = build_dir / "notebooks" / nb.name
    executed.parent.mkdir(parents=True, exist_ok=True)
    params = {"SMOKE": smoke, **(parameters or {})}
    if smoke:
        out_root = Path(smoke_dir) if smoke_dir else Path(tempfile.mkdtemp(prefix=f"dora-num-smoke-{nb.stem}-"))
        out_root.mkdir(parents=True, exist_ok=True)
    else:
        out_root = build_dir / "staging" / nb.stem
        shutil.rmtree(out_root, ignore_errors=True)
        out_root.mkdir(parents=True)
    kernel = notebook_kernel(nb)
    ensure_kernelspec(kernel)
    t0 = time.perf_counter()
    try:
        with _environ({paths.OUTPUT_ROOT_ENV: str(out_root), "PYDEVD_DISABLE_FILE_VALIDATION": "1",
                       **pinned_env()}):
            pm.execute_notebook(str(nb), str(executed), parameters=params, kernel_name=kernel,
                                cwd=str(nb.parent), progress_bar=progress, log_output=False,
                                # the kernel listens on loopback only; its "TCP without encryption"
                                # warning on every start says nothing about this use
                                extra_arguments=["--IPKernelApp.log_level=ERROR"])
    except PapermillExecutionError as e:
        cell, first_line = _source_cell(executed)
        raise NotebookFailed(
            f"{nb.name} failed in cell {cell} [{first_line}]: {e.ename}: {e.evalue}\n"
            f"executed copy: {executed}"
        ) from None
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
              smoke_dir: Path | None = None) -> list[RunResult]:
    """Run the notebooks in order; the first failure raises :class:`NotebookFailed`.

    ``dest``: where a full run's artifacts go (default: the repository; ``--check``
    passes a temporary folder).  ``smoke_dir``: where SMOKE artifacts go (one
    subfolder per notebook; default: a temporary folder per notebook)."""
    from tqdm.auto import tqdm

    build_dir = Path(build_dir) if build_dir else paths.REPO_ROOT / "build"
    results = []
    nbs = list_notebooks(only, notebooks_dir)
    if not nbs:
        raise FileNotFoundError(f"no notebooks NN_*.ipynb in {notebooks_dir or paths.NOTEBOOKS_DIR}")
    for nb in tqdm(nbs, desc="notebooks", unit="nb"):
        missing = [] if smoke else missing_recorded_inputs(nb)
        if missing:
            res = RunResult(nb.stem, 0.0, None, [], skipped=f"recorded data missing: {', '.join(missing)}")
            tqdm.write(f"{nb.stem}: SKIPPED ({res.skipped}); its figures are not regenerated")
        else:
            res = run_notebook(nb, smoke=smoke, build_dir=build_dir, parameters=parameters, dest=dest,
                               smoke_dir=None if smoke_dir is None else Path(smoke_dir) / nb.stem)
            where = f"; SMOKE artifacts in {res.out_root}" if smoke else ""
            tqdm.write(f"{nb.stem}: ok in {res.seconds:.1f} s, {len(res.artifacts)} artifacts{where}")
        results.append(res)
    skipped = [r for r in results if r.skipped]
    if skipped:
        tqdm.write(f"{len(skipped)} notebook(s) skipped for missing recorded data: "
                   + "; ".join(f"{r.notebook} ({r.skipped})" for r in skipped))
    return results
