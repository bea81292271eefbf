"""Readable figures: no text overlaps another or leaves the saved picture
(:func:`dora_num.repro.layout.text_problems`), on constructed figures (the check can fail), on
the figures the issue named rebuilt from committed data, and on every committed figure (the
check's result that ``save_figure`` recorded in its sidecar)."""

import json

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dora_num.repro.layout import text_problems  # noqa: E402
from dora_num.repro.paths import REPO_ROOT  # noqa: E402
from dora_num.repro.plotting import set_theme  # noqa: E402

DATA = REPO_ROOT / "data"


@pytest.fixture(autouse=True)
def _theme():
    set_theme()
    yield
    plt.close("all")


def test_a_clean_figure_has_no_problem():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="line")
    ax.set(title="title", xlabel="x", ylabel="y")
    ax.legend()
    assert text_problems(fig) == []


def test_overlapping_labels_of_stacked_panels_are_flagged():
    fig, axes = plt.subplots(2, 1, figsize=(4, 2.2))
    for ax in axes:
        ax.set_ylabel("a long label for a short panel (units)")
    assert any(p.startswith("overlap: axes 0 ylabel") and "axes 1 ylabel" in p for p in text_problems(fig))


def test_a_suptitle_on_the_panel_titles_is_flagged():
    fig, axes = plt.subplots(1, 2, figsize=(6, 3))
    for ax, t in zip(axes, ("left", "right")):
        ax.set_title(t)
    fig.suptitle("a title placed on the panels", y=0.93)
    assert any(p.startswith("overlap: figure text 'a title placed") and "title 'left'" in p
               for p in text_problems(fig))


def test_crowded_tick_labels_are_flagged():
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.set_xticks(range(20), [f"label{i}" for i in range(20)])
    assert any(p.startswith("overlap: axes 0 x tick") for p in text_problems(fig))


def test_text_outside_the_saved_area_is_flagged():
    fig, ax = plt.subplots(figsize=(3, 2))
    t = fig.text(1.5, 0.5, "far right")
    t.set_in_layout(False)  # not part of the tight box, so cut from the file
    assert text_problems(fig) == ["clipped: figure text 'far right'"]


# The figures named as unreadable, rebuilt by their plot functions from the committed data.
def _gm1():
    from dora_num.studies.cancellation import analysis as C
    from dora_num.studies.cancellation import plots

    return plots.compose_ulp_error_vs_gm1(C.error_by_gm1(pd.read_csv(DATA / "01_cancellation_at_g1/compose_error_sweep.csv.gz")))


def _rho():
    from dora_num.studies.cancellation import plots

    return plots.compose_ulp_error_vs_rho(pd.read_csv(DATA / "01_cancellation_at_g1/compose_error_by_cancellation.csv"))


def _assembly():
    from dora_num.studies.fma import plots

    hist = pd.read_csv(DATA / "02_fma_and_sqrt/assembly_hist.csv")
    return plots.assembly_ulp_hist(hist, list(dict.fromkeys(hist["set"])))


def _explore():
    from dora_num.studies import explore as X

    return X.arithmetics_figure(pd.read_csv(DATA / "07_explore/arithmetics.csv.gz"))


@pytest.mark.parametrize("make", [_gm1, _rho, _assembly, _explore], ids=["01_gm1", "01_rho", "02_assembly", "07_sweeps"])
def test_named_figures_rebuilt_from_committed_data_are_readable(make):
    assert text_problems(make()) == []


FIGURES = sorted((REPO_ROOT / "figures").rglob("*.png"))


@pytest.mark.parametrize("png", FIGURES, ids=[str(p.relative_to(REPO_ROOT / "figures")) for p in FIGURES])
def test_every_committed_figure_was_checked_and_is_readable(png):
    side = json.loads((png.parent / (png.name + ".provenance.json")).read_text())
    layout = side.get("extra", {}).get("text_layout")
    assert layout is not None, "saved before the layout check: regenerate it (make reproduce)"
    assert layout["problems"] == [], layout["problems"]
