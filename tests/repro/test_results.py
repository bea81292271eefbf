"""The README's numbers are generated from the committed data, and say so: the five takeaways and the
results by notebook are current, every notebook has a headline, every takeaway a number and a figure,
and the hand-written prose holds no number of its own."""

import re

import pytest

from dora_num.repro import results
from dora_num.repro.paths import REPO_ROOT
from dora_num.repro.runner import list_notebooks

README = REPO_ROOT / "README.md"
KIT_BEGIN, KIT_END = "<!-- kit-example:start -->", "<!-- kit-example:end -->"


def _block(text: str, begin: str, end: str) -> str:
    assert begin in text and end in text
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def test_readme_results_and_takeaways_match_the_committed_data():
    readme = README.read_text()
    assert _block(readme, results.BEGIN, results.END) == results.section(), \
        "README results are stale: run `python -m dora_num.repro.results`"
    assert _block(readme, results.TAKEAWAYS_BEGIN, results.TAKEAWAYS_END) == results.takeaways(), \
        "README takeaways are stale: run `python -m dora_num.repro.results`"
    from dora_num.repro import durations

    assert _block(readme, durations.BEGIN, durations.END) == durations.table(), \
        "README durations are stale: run `python -m dora_num.repro.results`"
    assert "failed (exit" not in durations.table(), durations.table()  # a failed command is never a duration
    assert readme.index(results.TAKEAWAYS_BEGIN) < readme.index("## Reproduce") < readme.index(results.BEGIN)


def test_every_notebook_has_a_readable_headline():
    text = results.section()
    assert "unavailable" not in text, text
    for nb in list_notebooks():
        assert nb.stem in results.NOTEBOOKS, f"{nb.stem} has no headline.py in its study folder"
        assert f"**[{nb.stem}](notebooks/rendered/{nb.stem}.md)**" in text


def test_a_notebook_without_a_headline_function_is_reported_not_papered_over(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "98_new.ipynb").write_text("{}")
    assert "- unavailable: LookupError: this notebook has no headline (a headline.py in its study folder)" in results.section(root=tmp_path)


def test_five_takeaways_each_with_a_number_and_an_existing_figure():
    text = results.takeaways()
    assert "unavailable" not in text, text
    items = re.findall(r"^(\d)\. (.*)$", text, flags=re.M)
    assert [int(i) for i, _ in items] == [1, 2, 3, 4, 5]
    for _, item in items:
        assert re.search(r"\d", re.sub(r"\[notebook \d\d\]\([^)]*\)", "", item)), item
    figures = re.findall(r'<img src="(figures/[^"]+)"', text)
    assert len(figures) == 5 and all((REPO_ROOT / f).is_file() for f in figures), figures


def test_readme_figures_exist():
    for link in re.findall(r"\]\((figures/[^)]+)\)", results.section()):
        assert (REPO_ROOT / link).is_file(), link


# Tokens with digits the hand-written prose may hold: names (formats, the GPU, the ISA, hashes), the
# paper's identifier, the Python version, a notebook's number, and g's value at the collapse point.
NAMES = re.compile(r"^(bf16|fp16|fp32|fp64|fp8|float64|bf16-rounded|H100|H200|H200-trained|AVX2|x86-64|sha256|3\.11|"
                   r"\d\d's|1|bf16/fp16|bf16/fp16/fp8|\[arXiv:2603\.22276\])$")


def test_the_hand_written_prose_holds_no_number_of_its_own():
    text = README.read_text()
    # generated blocks: the takeaways and results (from data/, checked above) and the kit's output (re-run
    # and compared by tests/test_check.py::test_readme_kit_example_is_current)
    from dora_num.repro import durations

    for begin, end in ((results.TAKEAWAYS_BEGIN, results.TAKEAWAYS_END), (results.BEGIN, results.END),
                       (KIT_BEGIN, KIT_END), (durations.BEGIN, durations.END)):
        head, rest = text.split(begin, 1)
        text = head + rest.split(end, 1)[1]
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # commands
    text = re.sub(r"`[^`]*`", "", text)  # code: names, paths, options
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    tokens = [t.strip(".,;:()*") for t in re.findall(r"[^\s|]*\d[^\s|]*", text)]
    assert [t for t in tokens if not NAMES.match(t)] == []


def test_splice_replaces_only_between_markers():
    body = "X"
    once = results.splice("head\n", body)
    assert once.startswith("head\n") and once.count(results.BEGIN) == 1
    twice = results.splice(once.replace("X", "old"), body)
    assert twice == once


# The wording the takeaways and headlines had before they stated their counter-evidence, checked against the
# statistics today's functions state: each must be rejected.
OLD_WORDING = {
    "_t_collapse": "**g = 1 is common, and bf16 cannot tell it from g.** In 13 DoRA training runs of one small model "
                   "(MiniLM, 22.7M parameters), each run until validation stopped improving, the magnitude scale g "
                   "rounds to exactly 1 in bf16 for 0.704% to 65% of its values: there the (g-1) part of DoRA's "
                   "update is invisible unless g is kept in fp32.",
    "_t_compose": "**The stable compose with fp32 intermediates is as exact as bf16 allows.** On real activations of "
                  "a trained adapter it is within 1 ulp of the correctly rounded result on 1,953,792 of 1,953,792 "
                  "elements (where the final sum does not cancel, a theorem guarantees this).",
    "_t_fma": "**FMA contraction and an approximate square root barely move anything.** Contracting the norm's "
              "additions into FMAs changes at most 0.154% of real row norms, by at most 1 ulp; the model's sentence "
              "embeddings stay within 1 - cosine = 2.1e-05 of the production kernel's.",
    "_t_bounds": "**The error bounds hold, and are tight.** 0 violations in 6,630,000 comparisons against certified "
                 "exact results (every format and arithmetic); on adversarial inputs the error attains them "
                 "(measured / bound up to 1).",
    "_t_training": "**The fused kernels train like the eager code, and run near memory speed.** Fused vs eager "
                   "training differ by a mean |delta loss| of 0.00096, against 0.1 between two seeds: equivalent in "
                   "6 of 6 tests; the fused compose's forward reaches 96.3% of the GPU's copy bandwidth (H200).",
    "01_cancellation_at_g1": "13 MiniLM DoRA runs on the H200 until validation MRR@10 stopped improving (600 to 1800 "
                             "steps; MRR@10 0.605 at the base, 0.738 to 0.785 at the best)",
    "02_fma_and_sqrt": "an FMA-contracted norm assembly changes at most 0.154% of real MiniLM row norms, by at most "
                       "1 ulp",
    "04_convergence": "fused vs eager training (2000 steps x 3 seeds): equivalent in 6 of 6 tests, against a "
                      "seed-to-seed noise floor of 0.1 (mean |delta loss| between runs of different seeds; the "
                      "equivalence margin, the largest mean difference the test accepts, 0.0251)",
    "05_memory_and_speed": "H200 targets: 17 met, 6 out of reach (floor below the target), 7 missed; fused compose "
                           "forward at 96.3% of copy bandwidth",
}


def test_no_takeaway_or_headline_claims_more_than_its_statistics():
    for name, text, stats in results.stated():
        assert results.overclaims(text, stats) == [], name


@pytest.mark.parametrize("name", sorted(OLD_WORDING))
def test_the_overclaim_check_rejects_the_old_wording(name):
    stats = {n: s for n, _, s in results.stated()}[name]
    assert results.overclaims(OLD_WORDING[name], stats), name


# The wording of the round after: counter-evidence stated, but a referee still found it short of its data
# (the compose's fp32 outputs and fp32-formed inputs left out; the low end called "past its best" although
# its validation score fell below every seed's best; the scaling model's one-sided miss unstated).
LATER_WORDING = {
    "_t_collapse": "44 DoRA runs of one model (MiniLM, 22.7M parameters): 11 configurations x 4 seeds. The low end "
                   "is the r = 384, lr 0.001 configuration past its best (77.9% at the best checkpoint, 0.544% at the "
                   "end). A scaling model of |g-1| fitted on these runs misses held-out learning rates by a factor "
                   "2.7 (rms).",
    "_t_compose": "**The stable compose with fp32 intermediates is within 1 ulp of the correctly rounded result on "
                  "every real element measured.** On real activations of a trained MiniLM adapter it is within 1 ulp "
                  "on 1,953,792 of 1,953,792 elements; it is not always correctly rounded.",
}


@pytest.mark.parametrize("name", sorted(LATER_WORDING))
def test_the_overclaim_check_rejects_the_later_wording(name):
    stats = {n: s for n, _, s in results.stated()}[name]
    assert results.overclaims(LATER_WORDING[name], stats), name


# Takeaway 5 and notebook 04's headline before they said what the ratio test cannot detect: its power stated
# with nothing beside it about the steps before the runs decorrelate (the only steps where R can depart from 1).
BEFORE_THE_EARLY_WINDOW = (
    "**Fused training moves the loss about as much as a 1-ulp change of m does: within 1.25 times that distance on "
    "3 of 3 seeds.** Over 2000 MiniLM steps (rank 16, lr 0.0001) the mean |delta loss| of fused vs eager is 0.958, "
    "1, 0.972 times that of eager vs eager with m moved by 1 ulp (same seed and batches) for seeds 0 to 2; a ratio "
    "test on block means puts the 95% upper bounds at 1, 1.06, 1.04, below the pre-set 1.25 on 3 of 3 seeds (power "
    "at a true ratio of 1: at least 1.00), and the same test rejects eager runs of another seed, on different "
    "batches (3 of 3, ratios from 98.4).")
EARLY_WINDOW_STATS = ("fused_first_diff_min", "floor_saturation_step_max", "window_end_max", "early_ratio_max",
                      "late_ratio_max")


@pytest.mark.parametrize("name", ["_t_training", "04_convergence"])
def test_the_ratio_tests_power_needs_the_early_window_beside_it(name):
    texts = {n: (t, s) for n, t, s in results.stated()}
    text, stats = texts[name]
    assert "power" in text  # what this test is about: today's text states the power, with the early window
    assert any("cannot fail a kernel" in f for f in results.overclaims(BEFORE_THE_EARLY_WINDOW, stats))
    without = {k: v for k, v in stats.items() if k not in EARLY_WINDOW_STATS}
    rejected = results.overclaims(text, without)
    assert any("power" in f.split(" needs ")[0] for f in rejected), rejected


def test_a_statistic_the_text_does_not_state_licenses_nothing():
    for text in ("as exact as bf16 allows", "the bounds are tight", "equivalent in 6 of 6 tests",
                 "barely moves anything", "13 small models", "power at a true ratio of 1: at least 1.00"):
        assert results.overclaims(text, {}), text
