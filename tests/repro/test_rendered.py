"""Every notebook readable on GitHub without running it: its rendered page
(``notebooks/rendered/NN_topic.md``) shows every figure the notebook saved and every link
resolves; each notebook opens with a link to its page; the README's notebook table links both.
The pages of a fresh run are checked the same way by ``test_runner.py::test_notebook_smoke``."""

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (notebook tooling, absent on the GPU image)")

from dora_num.repro.paths import REPO_ROOT  # noqa: E402
from dora_num.repro.render import page_problems, relative_links, rendering_line  # noqa: E402
from dora_num.repro.runner import list_notebooks  # noqa: E402

NOTEBOOKS = list_notebooks()
RENDERED = REPO_ROOT / "notebooks" / "rendered"


def linked_figures(markdown: str, page: Path, stem: str) -> set[str]:
    """The figures of ``figures/<stem>/`` that ``markdown`` (at ``page``) links, by file name."""
    folder = REPO_ROOT / "figures" / stem
    out = set()
    for link in relative_links(markdown):
        target = Path(os.path.normpath(page.parent / link))
        if target.parent == folder and target.suffix == ".png":
            out.add(target.name)
    return out


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_rendered_page_shows_every_saved_figure_and_its_links_resolve(nb):
    page = RENDERED / f"{nb.stem}.md"
    assert page.is_file(), f"{page} missing: make reproduce writes it"
    md = page.read_text()
    assert page_problems(md, page) == []
    committed = {p.name for p in (REPO_ROOT / "figures" / nb.stem).glob("*.png")}
    assert committed, f"{nb.stem} saves no figure: the page has no picture"
    assert linked_figures(md, page, nb.stem) == committed


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_opens_with_a_link_to_its_rendering(nb):
    first = nbformat.read(nb, as_version=4).cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert first.source.split("\n\n")[1] == rendering_line(nb.stem)
    assert (nb.parent / f"rendered/{nb.stem}.md").is_file()


def test_readme_notebook_table_links_each_notebook_and_its_rendering():
    readme = (REPO_ROOT / "README.md").read_text()
    rows = [ln for ln in readme.splitlines() if ln.startswith("| ")]
    for nb in NOTEBOOKS:
        row = next((r for r in rows if f"(notebooks/{nb.stem}.ipynb)" in r), None)
        assert row is not None, f"README's notebook table has no row linking notebooks/{nb.stem}.ipynb"
        assert f"(notebooks/rendered/{nb.stem}.md)" in row, row


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "docs").glob("*.md"))])
def test_relative_links_of_the_readme_and_docs_resolve(doc):
    path = REPO_ROOT / doc
    dead = [link for link in relative_links(path.read_text()) if not (path.parent / link).exists()]
    assert not dead, dead


def test_no_placeholder_ships_in_the_readme():
    readme = (REPO_ROOT / "README.md").read_text()
    for placeholder in ("no headline registered", "unavailable:", "TODO", "TBD", "XXX"):
        assert placeholder not in readme, placeholder
    assert not re.search(r"\{[a-z_]+\}", readme.split("```")[0]), "an unformatted template field"
