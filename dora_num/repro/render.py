"""Executed notebooks rendered to Markdown: readable with their results on GitHub.

``make reproduce`` writes ``notebooks/rendered/NN_topic.md`` for every notebook it
ran: the markdown cells, the code, its printed output and tables, and every figure
as a link to the committed ``figures/NN_topic/<name>.png``.  A figure is linked by
what the run did, not by reading the code: :func:`dora_num.repro.plotting.save_figure`
shows the figure it saved once, its output tagged with the file (:data:`FIGURE_META`);
an image output without the tag is a figure the notebook made but did not save, shown
as :data:`UNSAVED` (and failed by ``tests/repro/test_rendered.py``).  Relative links of
the markdown (written for ``notebooks/``) are rewritten for ``notebooks/rendered/``.
Why Markdown and not an executed ``.ipynb`` beside the source: GitHub's notebook
viewer embeds only inline (base64) images, which would double ``figures/`` in the
repository, and it does not resolve relative image links in a notebook; a ``.md``
file shows linked images and HTML tables as they are.

Nothing that depends on the run is written: stderr (progress bars, library
warnings) is dropped, paths inside the checkout are written repo-relative, and
papermill's injected-parameters cell is shown as the parameters it set.
:func:`page_problems` lists what a page would show broken: unsaved figures, relative
links to nothing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FIGURE_META = "dora_num_figure"  # output metadata: the saved file, relative to figures/ ("NN_topic/name.png")
UNSAVED = "*(figure shown in the notebook, not saved to `figures/`)*"
_STYLE = re.compile(r"<style[^>]*>.*?</style>\s*", re.S)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# a Markdown link or image target, and an HTML src/href: (prefix, target)
_LINK = re.compile(r"(\]\()([^)\s]+)(?=[)\s])|((?:src|href)=\")([^\"]+)(?=\")")
SKIP_TAGS = {"papermill-error-cell-tag"}


def rendering_line(stem: str) -> str:
    """The paragraph under each notebook's title that links its rendering (dropped from the page itself)."""
    return (f"*Readable without running, with every table and figure of the last `make reproduce`: "
            f"[rendered/{stem}.md](rendered/{stem}.md).*")


def _clean_text(text: str, root: Path | None = None) -> str:
    from .paths import REPO_ROOT

    root = REPO_ROOT if root is None else root
    text = _ANSI.sub("", text).replace(f"{root}/", "")  # paths printed repo-relative: no clone's own folder
    lines = [ln.rsplit("\r", 1)[-1] for ln in text.split("\n")]  # a progress line keeps its last state
    return "\n".join(lines).rstrip("\n")


def _fence(body: str, lang: str = "") -> list[str]:
    ticks = "```" if "```" not in body else "````"
    return [f"{ticks}{lang}", body, ticks, ""]


def _html(html: str) -> str:
    html = _STYLE.sub("", html)
    return "\n".join(ln.rstrip() for ln in html.strip().splitlines() if ln.strip())


def _is_relative(target: str) -> bool:
    return not (re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")))


def relink(markdown: str, prefix: str = "..") -> str:
    """``markdown`` written for ``notebooks/`` with its relative links made relative to
    ``notebooks/<sub>/`` (``prefix`` the way back up)."""
    def fix(m: re.Match) -> str:
        head, target = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        if not _is_relative(target):
            return m.group(0)
        path, sep, anchor = target.partition("#")
        return head + os.path.normpath(f"{prefix}/{path}") + sep + anchor

    return _LINK.sub(fix, markdown)


def relative_links(markdown: str) -> list[str]:
    """Every relative link target of ``markdown`` (anchors dropped), outside code fences."""
    body = re.sub(r"^(```+).*?^\1", "", markdown, flags=re.S | re.M)
    out = []
    for m in _LINK.finditer(body):
        target = m.group(2) or m.group(4)
        if _is_relative(target) and target.partition("#")[0]:
            out.append(target.partition("#")[0])
    return out


def _markdown_cell(source: str, stem: str) -> str:
    return relink(source.replace(rendering_line(stem) + "\n\n", "").replace(rendering_line(stem), "")).rstrip()


def render_cells(nb, stem: str, figures_rel: str, root: Path | None = None) -> list[str]:
    out: list[str] = []
    for cell in nb.cells:
        tags = set(cell.metadata.get("tags", []))
        if tags & SKIP_TAGS:
            continue
        if cell.cell_type == "markdown":
            out += [_markdown_cell(cell.source, stem), ""]
            continue
        if cell.cell_type != "code":
            continue
        if "injected-parameters" in tags:
            out += ["*Parameters set by `make reproduce`:*", ""]
        out += _fence(cell.source.rstrip(), "python")
        for o in cell.get("outputs", []):
            kind = o.get("output_type")
            if kind == "stream":
                if o.get("name") == "stdout" and _clean_text(o.get("text", ""), root).strip():
                    out += _fence(_clean_text(o["text"], root))
            elif kind in ("execute_result", "display_data"):
                data = o.get("data", {})
                if "application/vnd.jupyter.widget-view+json" in data:  # a progress bar
                    continue
                if "image/png" in data or "image/svg+xml" in data:
                    saved = o.get("metadata", {}).get(FIGURE_META)
                    out += [f"![{Path(saved).stem}]({figures_rel}/{saved})" if saved else UNSAVED, ""]
                elif "text/html" in data:
                    out += [_html(data["text/html"]), ""]
                elif "text/markdown" in data:
                    out += [relink(data["text/markdown"]).rstrip(), ""]
                elif "text/plain" in data:
                    out += _fence(_clean_text(data["text/plain"], root))
            elif kind == "error":
                out += _fence(_clean_text("\n".join(o.get("traceback", []))))
    return out


def render_text(executed: str | Path, stem: str, root: str | Path | None = None) -> str:
    """The Markdown page of an executed notebook (see :func:`render_notebook`)."""
    import nbformat

    nb = nbformat.read(str(executed), as_version=4)
    lines = [f"<!-- Generated by `make reproduce` from notebooks/{stem}.ipynb; do not edit. -->",
             f"*Rendered from [`{stem}.ipynb`](../{stem}.ipynb) as `make reproduce` ran it; figures are the "
             f"committed files in [`figures/{stem}/`](../../figures/{stem}/).*", ""]
    lines += render_cells(nb, stem, "../../figures", None if root is None else Path(root))
    return "\n".join(lines).rstrip("\n") + "\n"


def render_notebook(executed: str | Path, dest: str | Path, stem: str, root: str | Path | None = None) -> Path:
    """Write the Markdown rendering of an executed notebook to ``dest`` (atomically); ``root``:
    the checkout the notebook ran in (default: this package's), whose paths are shown relative."""
    from .provenance import _atomic_write_bytes

    dest = Path(dest)
    _atomic_write_bytes(dest, render_text(executed, stem, root).encode())
    return dest


def page_problems(markdown: str, page: Path, figures: Path | None = None) -> list[str]:
    """What a rendered page at ``page`` would show broken: figures the notebook did not save, and
    relative links (images included) that resolve to nothing.  ``figures``: where the run's
    ``figures/`` folder is, when not the repository's (a SMOKE run's output root)."""
    from .paths import REPO_ROOT

    problems = [f"{markdown.count(UNSAVED)} figure(s) shown but not saved through save_figure"] \
        if UNSAVED in markdown else []
    committed = REPO_ROOT / "figures"
    for link in relative_links(markdown):
        target = Path(os.path.normpath(page.parent / link))
        if figures is not None and target.is_relative_to(committed):
            target = figures / target.relative_to(committed)
        if not target.exists():
            problems.append(f"dead link: {link}")
    return problems
