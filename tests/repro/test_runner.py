"""The papermill runner: SMOKE runs of every notebook, failure reporting, and
that a failing notebook leaves committed artifacts untouched."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (notebook tooling, absent on the GPU image)")

from dora_num.repro import paths
from dora_num.repro.kernel import KERNELSPEC
from dora_num.repro.render import page_problems, relative_links, render_text
from dora_num.repro.runner import Limits, NotebookFailed, NotebookTimedOut, list_notebooks, reproduce

NOTEBOOKS = list_notebooks()


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_smoke(nb, tmp_path):
    """Each notebook runs headless in SMOKE mode, touches no committed file, and renders to a page
    that shows every figure it made."""
    before = _tree_digest(paths.COMMITTED_DATA_DIR), _tree_digest(paths.COMMITTED_FIGURES_DIR)
    (res,) = reproduce([nb.stem], smoke=True, build_dir=tmp_path, smoke_dir=tmp_path / "smoke")
    assert res.executed.is_file()
    assert res.out_root == tmp_path / "smoke" / nb.stem  # written under pytest's tmp_path, which it cleans
    # its time is reported by the runner against SMOKE_BUDGET_S, not judged here (it depends on the load)
    after = _tree_digest(paths.COMMITTED_DATA_DIR), _tree_digest(paths.COMMITTED_FIGURES_DIR)
    assert before == after
    # rendered as `make reproduce` renders it: every figure the run made is saved and linked, every link resolves
    page = paths.REPO_ROOT / "notebooks" / "rendered" / f"{nb.stem}.md"  # where the page would be
    md = render_text(res.executed, nb.stem)
    assert page_problems(md, page, figures=res.out_root / "figures") == []
    saved = {p.name for p in (res.out_root / "figures" / nb.stem).glob("*.png")}
    assert saved and {Path(t).name for t in relative_links(md) if f"figures/{nb.stem}/" in t and t.endswith(".png")} == saved


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_clean(nb):
    book = nbformat.read(nb, as_version=4)
    nbformat.validate(book)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip outputs before committing"
    assert "parameters" in code[0].metadata.get("tags", []), "first code cell must be tagged 'parameters'"
    assert "SMOKE" in code[0].source
    assert book.cells[0].cell_type == "markdown"
    assert book.metadata["kernelspec"] == KERNELSPEC, "notebooks run on the project kernel (dora-num)"
    assert "assert" in code[-1].source, "the last cell asserts the headline claim"


def _write_notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    first = nbformat.v4.new_code_cell("SMOKE: bool = False  # tiny sizes")
    first.metadata["tags"] = ["parameters"]
    nb.cells = [first] + [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)


def test_failing_notebook_names_cell_and_leaves_figures_untouched(tmp_path):
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    stem = "98_runner_selftest"
    _write_notebook(nbdir / f"{stem}.ipynb", [
        "import dora_num as dn, matplotlib.pyplot as plt\n"
        f"ctx = dn.setup({stem!r}, smoke=SMOKE)\n"
        "fig, ax = plt.subplots(); ax.plot([0, 1])\n"
        "ctx.save_figure(fig, 'written_before_failure')",
        "raise RuntimeError('deliberate failure')",
    ])
    with pytest.raises(NotebookFailed, match=rf"{stem}\.ipynb failed in cell 3 \[raise RuntimeError.*RuntimeError.*deliberate failure"):
        reproduce(notebooks_dir=nbdir, build_dir=tmp_path / "build")
    assert not (paths.COMMITTED_FIGURES_DIR / stem).exists(), "a failing notebook's figures were promoted"
    # The figure was written, but only to the staging area.
    staged = list((tmp_path / "build" / "staging").rglob("written_before_failure.png"))
    assert len(staged) == 1
    side = json.loads(Path(str(staged[0]) + ".provenance.json").read_text())
    assert side["sha256"] == hashlib.sha256(staged[0].read_bytes()).hexdigest()


def test_cli_reports_unknown_notebook():
    proc = subprocess.run([sys.executable, "-m", "dora_num", "reproduce", "--smoke", "--only", "97"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no notebook matches ['97']" in proc.stderr


def test_full_run_skips_notebook_whose_recorded_data_is_missing(tmp_path, capsys):
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    stem = "97_needs_gpu_data"
    _write_notebook(nbdir / f"{stem}.ipynb", ["raise RuntimeError('must not run without its data')"])
    nb = nbformat.read(nbdir / f"{stem}.ipynb", as_version=4)
    nb.metadata["dora_num"] = {"requires": ["data/gpu/no_such_run/history.csv.gz"]}
    nbformat.write(nb, nbdir / f"{stem}.ipynb")
    (res,) = reproduce(notebooks_dir=nbdir, build_dir=tmp_path / "build")
    assert res.skipped == "recorded data missing: data/gpu/no_such_run/history.csv.gz"
    assert f"{stem}: SKIPPED" in capsys.readouterr().out


def test_hung_cell_times_out_is_retried_and_named(tmp_path, capsys):
    """A cell that never returns (as a kernel stalled on a widget comm) is stopped at the cell limit,
    the notebook run again from a fresh kernel, then failed with one message naming the cell."""
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    stem = "96_hangs"
    _write_notebook(nbdir / f"{stem}.ipynb", ["x = 1", "import time\ntime.sleep(600)  # hangs", "y = 2"])
    with pytest.raises(NotebookTimedOut, match=rf"{stem}\.ipynb: the cell ran past its limit of 3 s \(--cell-timeout\) "
                                               r"in cell 3 \[import time\].*\(after 2 attempts\)"):
        reproduce(notebooks_dir=nbdir, build_dir=tmp_path / "build", limits=Limits(cell_s=3, retries=1))
    assert "running it again (2 of 2)" in capsys.readouterr().err


def test_notebook_limit_stops_a_run_of_slow_cells(tmp_path):
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    stem = "95_slow"
    _write_notebook(nbdir / f"{stem}.ipynb", ["import time\ntime.sleep(2)"] * 10)
    with pytest.raises(NotebookTimedOut, match=r"the notebook ran past its limit of 5 s \(--timeout\) in cell \d+ "
                                               r"\[import time\].*\(after 1 attempt\)"):
        reproduce(notebooks_dir=nbdir, build_dir=tmp_path / "build",
                  limits=Limits(cell_s=60, notebook_s=5, retries=0))


def test_limits_refuse_nonsense():
    with pytest.raises(ValueError, match="limits must be positive"):
        Limits(cell_s=0)
    proc = subprocess.run([sys.executable, "-m", "dora_num", "reproduce", "--smoke", "--timeout", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "limits must be positive" in proc.stderr


@pytest.mark.parametrize("names, stems", [
    (["overview"], ["00_overview"]), (["0", "03"], ["00_overview", "03_ground_truth_and_bounds"]),
    (["07_explore"], ["07_explore"]), (["notebooks/02_fma_and_sqrt.ipynb"], ["02_fma_and_sqrt"]),
])
def test_only_takes_numbers_stems_and_names(names, stems):
    assert [p.stem for p in list_notebooks(names)] == stems
