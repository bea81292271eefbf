"""The README's results section is generated from the committed data, and says so."""

from dora_num.repro import results
from dora_num.repro.paths import REPO_ROOT


def test_readme_results_match_the_committed_data():
    readme = (REPO_ROOT / "README.md").read_text()
    assert results.BEGIN in readme and results.END in readme
    current = readme.split(results.BEGIN, 1)[1].split(results.END, 1)[0].strip("\n")
    assert current == results.section(), "README results are stale: run `python -m dora_num.repro.results`"


def test_every_notebook_has_a_readable_headline():
    text = results.section()
    assert "unavailable" not in text, text
    for stem in results.NOTEBOOKS:
        assert stem in text
        assert (REPO_ROOT / "notebooks" / f"{stem}.ipynb").is_file(), stem


def test_readme_figures_exist():
    import re

    for link in re.findall(r"\]\((figures/[^)]+)\)", results.section()):
        assert (REPO_ROOT / link).is_file(), link


def test_splice_replaces_only_between_markers():
    body = "X"
    once = results.splice("head\n", body)
    assert once.startswith("head\n") and once.count(results.BEGIN) == 1
    twice = results.splice(once.replace("X", "old"), body)
    assert twice == once
