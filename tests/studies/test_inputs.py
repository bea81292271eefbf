"""The named input regimes hold the properties their names promise (docs/contract.md), and
each is a deterministic function of its seed."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from dora_num.numerics import formats as fm
from dora_num.numerics.formats import FORMATS, round_to
from dora_num.numerics.formulas import scale_constants
from dora_num.studies import inputs

FMTS = list(FORMATS)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("regime", inputs.REGIMES)
def test_compose_regimes(fmt, regime):
    d = inputs.compose(fmt, regime, 3000, seed=1)
    for k in ("base", "lora"):
        v = d[k][np.isfinite(d[k])]
        assert np.array_equal(round_to(v, fmt), v), k  # values of the format
    assert np.array_equal(round_to(d["g"], "fp32"), d["g"])
    gm1 = np.abs(d["g"] - 1)
    if regime == "realistic":
        assert ((gm1 >= 0.9e-5) & (gm1 <= 1.01e-2)).all()
        assert np.linalg.norm(d["s"] * d["lora"]) < 0.05 * np.linalg.norm(d["base"])  # ||s lora|| << ||base||
    if regime == "adversarial":  # a third at the spacing boundaries of g around 1
        assert np.isin(d["g"], inputs.boundary_g(fmt)).sum() >= 1000
        assert np.nanmax(np.abs(d["base"])) >= 0.5 * FORMATS[fmt].max  # values near the format's overflow
    for k, v in inputs.compose(fmt, regime, 3000, seed=1).items():  # deterministic in the seed
        assert np.array_equal(np.asarray(v), np.asarray(d[k]), equal_nan=True)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("regime", inputs.REGIMES)
def test_assembly_regimes_are_cauchy_schwarz_consistent(fmt, regime):
    d = inputs.assembly(fmt, regime, 3000, seed=2)
    b, c, a = d["base_sq"], d["cross"], d["ba"]
    assert (b >= 0).all() and (a >= 0).all()
    assert (np.abs(c) <= np.sqrt(b * a) * (1 + 1e-6) + 1e-300).all()  # some real W, A, B have these terms
    ratio = d["s"] ** 2 * a / np.where(b > 0, b, 1)
    if regime == "realistic":
        assert (ratio <= 1.01e-2).all()  # ||sBA|| <= 0.1 ||W||
    if regime == "adversarial":
        assert (b == 0).any()  # exact zero rows


def test_fma_sets_label_every_row_and_cancel_where_they_say():
    s = 48.0 / np.sqrt(24.0)
    d = inputs.fma_assembly(20_000, s, seed=0)
    assert set(d["category"]) == {"cancel", "large_update", "near_zero", "realistic"}
    _, two_s, s_sq = scale_constants(s)
    q = d["base_sq"] + two_s * d["cross"] + s_sq * d["ba"]
    cancel = d["category"] == "cancel"
    assert np.median(np.abs(q[cancel]) / d["base_sq"][cancel]) < 0.1
    real = d["category"] == "realistic"
    assert np.median(np.abs(two_s * d["cross"][real]) / d["base_sq"][real]) < 0.05
    c = inputs.fma_compose(20_000, s, seed=0)
    one = c["category"] == "g_one_ulp"
    assert (np.abs(c["g"][one] - 1) <= 8 * 2.0**-24).all()


def test_suite_streams_regenerate_their_prefix():
    """The GPU suite's inputs are seeded numpy streams: any machine regenerates them bit for bit,
    and the study cuts prefixes from a draw of the full size."""
    a1, a2 = inputs.suite_assembly(4096), inputs.suite_assembly(4096)
    assert all(x.dtype == np.float32 and np.array_equal(x, y) for x, y in zip(a1, a2))
    adv = np.abs(a1[0] + 2 * inputs.SUITE_FMA_SCALE * a1[1]) < 0.5 * a1[0]  # the cancelling eighth
    assert 0.08 < adv.mean() < 0.17
    base, lora, g = inputs.suite_compose(16, 32)
    assert base.shape == (16, 32) and g.shape == (32,) and np.abs(g - 1).max() < 1e-2


# ---------------------------------------------------------------- a seed per format, not per position

def _draws(name: str, n: int = 300, seed: int = 5) -> str:
    """sha256 (16 hex digits) of every regime's compose and assembly inputs of one format."""
    h = hashlib.sha256()
    for regime in inputs.REGIMES:
        for d in (inputs.compose(name, regime, n, seed=seed), inputs.assembly(name, regime, n, seed=seed)):
            for k in sorted(d):
                h.update(np.asarray(d[k], dtype=np.float64).tobytes())
    return h.hexdigest()[:16]


# The draws every recorded data set was made with: computed by the code before formats had a seed of
# their own (the seed was the format's position in FORMATS, then bf16, fp16, fp32, fp8_e4m3fn, fp8_e5m2).
RECORDED_DRAWS = {"bf16": "696f48ae7a30c548", "fp16": "2661c01a73c2e847", "fp32": "86041ffd0df30d70",
                  "fp8_e4m3fn": "1296ccd5f0d23cdb", "fp8_e5m2": "2ed586c013e8c566"}


def test_the_studied_formats_draw_what_the_recorded_data_was_drawn_with():
    assert {n: _draws(n) for n in RECORDED_DRAWS} == RECORDED_DRAWS


def test_inserting_a_format_anywhere_changes_no_other_formats_draws(monkeypatch):
    """A toy format registered before, between and after the others: every other format draws the
    same inputs (its seed is its own, not its position), the toy its name's."""
    before = {n: _draws(n) for n in FORMATS}
    toy = fm.make_format("toy_e3m3", 3, 3, specials="none")
    items = list(FORMATS.items())
    toy_draws = set()
    for i in range(len(items) + 1):
        registry = dict(items[:i] + [(toy.name, toy)] + items[i:])
        for module in (fm, inputs):  # the registry as every module that could enumerate it sees it
            monkeypatch.setattr(module, "FORMATS", registry)
        assert {n: _draws(n) for n in before} == before, f"toy inserted at position {i}"
        toy_draws.add(_draws(toy.name))
    assert len(toy_draws) == 1 and not toy_draws & set(before.values())
