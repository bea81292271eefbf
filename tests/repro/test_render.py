"""Executed notebooks rendered to Markdown: figures linked to the committed files,
tables kept, run-dependent noise (stderr, progress widgets, colour codes) dropped."""

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (notebook tooling, absent on the GPU image)")

from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output  # noqa: E402

from dora_num.repro.render import FIGURE_META, UNSAVED, page_problems, relink, render_notebook, rendering_line


def test_render_links_saved_figures_and_drops_noise(tmp_path):
    nb = new_notebook()
    plot = new_code_cell("fig, ax = plt.subplots()\nctx.save_figure(plots.curve(df, cols=['a', 'b']), 'curve')")
    plot.outputs = [new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"},
                               metadata={FIGURE_META: "99_x/curve.png"})]
    table = new_code_cell("df")
    table.outputs = [new_output("execute_result", data={
        "text/html": "<div><style scoped>.x{}</style><table><tr><td>1</td></tr></table></div>",
        "text/plain": "   a\n0  1"}, execution_count=1)]
    noisy = new_code_cell("run()")
    noisy.outputs = [new_output("stream", name="stderr", text="Warning: \x1b[1mLOAD REPORT\x1b[0m\n"),
                     new_output("display_data", data={"application/vnd.jupyter.widget-view+json": {},
                                                     "text/plain": "layers: 10%"}),
                     new_output("stream", name="stdout", text="step 1\rstep 2\rdone\n")]
    loose = new_code_cell("plt.plot([1])")
    loose.outputs = [new_output("display_data", data={"image/png": "iVBORw0KGgo="})]
    nb.cells = [new_markdown_cell("# Title"), plot, table, noisy, loose]
    src = tmp_path / "99_x.ipynb"
    nbformat.write(nb, src)
    md = render_notebook(src, tmp_path / "out" / "99_x.md", "99_x").read_text()
    assert "# Title" in md
    assert "![curve](../../figures/99_x/curve.png)" in md
    assert "<table>" in md and "<style" not in md
    assert "LOAD REPORT" not in md and "\x1b" not in md and "layers: 10%" not in md
    assert "done" in md and "step 1" not in md
    assert md.count(UNSAVED) == 1  # the loose plot, not the saved one
    assert "iVBOR" not in md  # no inline image data


def test_paths_inside_the_checkout_are_shown_relative(tmp_path):
    nb = new_notebook()
    cell = new_code_cell("print(path)")
    cell.outputs = [new_output("stream", name="stdout", text=f"{tmp_path}/data/gpu/run | ok\n")]
    nb.cells = [cell]
    nbformat.write(nb, tmp_path / "98_p.ipynb")
    md = render_notebook(tmp_path / "98_p.ipynb", tmp_path / "98_p.md", "98_p", root=tmp_path).read_text()
    assert "data/gpu/run | ok" in md and str(tmp_path) not in md


def test_markdown_links_are_rewritten_for_the_rendered_folder(tmp_path):
    nb = new_notebook()
    nb.cells = [new_markdown_cell(f"# T\n\n{rendering_line('99_l')}\n\nSee [lemma 1](../docs/bounds.md#lemma-1), "
                                  "[a figure](../figures/99_l/a.png), <img src=\"../figures/99_l/b.png\">, "
                                  "[the paper](https://arxiv.org/abs/2603.22276) and [below](#headline).")]
    nbformat.write(nb, tmp_path / "99_l.ipynb")
    md = render_notebook(tmp_path / "99_l.ipynb", tmp_path / "99_l.md", "99_l").read_text()
    assert "[lemma 1](../../docs/bounds.md#lemma-1)" in md and "[a figure](../../figures/99_l/a.png)" in md
    assert 'src="../../figures/99_l/b.png"' in md and "(https://arxiv.org/abs/2603.22276)" in md
    assert "(#headline)" in md and "rendered/99_l.md" not in md  # the notebook's link to this page is dropped
    assert relink("[x](a.md) `[y](b.md)`") == "[x](../a.md) `[y](../b.md)`"


def test_page_problems_names_unsaved_figures_and_dead_links(tmp_path):
    from dora_num.repro.paths import REPO_ROOT

    page = REPO_ROOT / "notebooks" / "rendered" / "99_p.md"
    (tmp_path / "99_p").mkdir()
    (tmp_path / "99_p" / "ok.png").write_bytes(b"")
    md = (f"![ok](../../figures/99_p/ok.png) ![gone](../../figures/99_p/gone.png) [bounds](../../docs/bounds.md) "
          f"[nowhere](../../docs/nowhere.md)\n\n{UNSAVED}\n\n```\n[in code](not/a/link.md)\n```\n")
    assert page_problems(md, page, figures=tmp_path) == [
        "1 figure(s) shown but not saved through save_figure", "dead link: ../../figures/99_p/gone.png",
        "dead link: ../../docs/nowhere.md"]
