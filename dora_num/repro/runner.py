"""Run the notebooks headlessly with papermill, in order.

Full mode writes every artifact into a staging folder (``build/staging``) and
moves it into ``data/``/``figures/`` only after the notebook finished without
error, so a failing notebook leaves committed files untouched.  SMOKE mode
writes into a temporary folder and never touches the repository's artifacts.
Executed notebooks go to ``build/notebooks/`` (git-ignored).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import paths


class NotebookFailed(RuntimeError):
    """A notebook raised; the message names the notebook and the cell."""


@dataclass
class RunResult:
    notebook: str
    seconds: float
    executed: Path | None
    artifacts: list[Path]
    skipped: str | None = None  # why a full run did not execute the notebook


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
    """Move every file under ``staging`` into ``dest`` (same filesystem: atomic renames)."""
    moved = []
    for src in sorted(p for p in staging.rglob("*") if p.is_file()):
        target = dest / src.relative_to(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, target)
        moved.append(target)
    return moved


def run_notebook(nb: Path, *, smoke: bool, build_dir: Path, parameters: dict | None = None,
                 progress: bool = False) -> RunResult:
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    executed = build_dir / "notebooks" / nb.name
    executed.parent.mkdir(parents=True, exist_ok=True)
    params = {"SMOKE": smoke, **(parameters or {})}
    if smoke:
        out_root = Path(tempfile.mkdtemp(prefix=f"dora-num-smoke-{nb.stem}-"))
    else:
        out_root = build_dir / "staging" / nb.stem
        shutil.rmtree(out_root, ignore_errors=True)
        out_root.mkdir(parents=True)
    old = os.environ.get(paths.OUTPUT_ROOT_ENV)
    os.environ[paths.OUTPUT_ROOT_ENV] = str(out_root)
    t0 = time.perf_counter()
    try:
        pm.execute_notebook(str(nb), str(executed), parameters=params, kernel_name="python3",
                            cwd=str(nb.parent), progress_bar=progress, log_output=False)
    except PapermillExecutionError as e:
        cell, first_line = _source_cell(executed)
        raise NotebookFailed(
            f"{nb.name} failed in cell {cell} [{first_line}]: {e.ename}: {e.evalue}\n"
            f"executed copy: {executed}"
        ) from None
    finally:
        if old is None:
            os.environ.pop(paths.OUTPUT_ROOT_ENV, None)
        else:
            os.environ[paths.OUTPUT_ROOT_ENV] = old
    seconds = time.perf_counter() - t0
    artifacts = sorted(p for p in out_root.rglob("*") if p.is_file()) if smoke else _promote(out_root, paths.REPO_ROOT)
    return RunResult(nb.stem, seconds, executed, artifacts)


def reproduce(only: list[str] | None = None, *, smoke: bool = False, build_dir: Path | None = None,
              parameters: dict | None = None, notebooks_dir: Path | None = None) -> list[RunResult]:
    """Run the notebooks in order; the first failure raises :class:`NotebookFailed`."""
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
            res = run_notebook(nb, smoke=smoke, build_dir=build_dir, parameters=parameters)
            tqdm.write(f"{nb.stem}: ok in {res.seconds:.1f} s, {len(res.artifacts)} artifacts")
        results.append(res)
    skipped = [r for r in results if r.skipped]
    if skipped:
        tqdm.write(f"{len(skipped)} notebook(s) skipped for missing recorded data: "
                   + "; ".join(f"{r.notebook} ({r.skipped})" for r in skipped))
    return results
