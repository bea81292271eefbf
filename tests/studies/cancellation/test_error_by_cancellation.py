"""Notebook 01's binning of compose errors by the naive form's cancellation ratio rho = |base| / |X|,
on inputs whose rho is known in closed form."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dora_num.numerics.formats import round_to
from dora_num.studies.cancellation import analysis as C


def test_lora_zero_puts_rho_at_one_over_gm1():
    """B = 0 (an adapter at init): X = (g - 1) base exactly, so rho = 1 / |g - 1| for every element; with
    g - 1 = +-2^-k the bin is k (2^-k is exact in fp32, so is g), and no other bin is filled."""
    rng = np.random.default_rng(0)
    base = round_to(rng.standard_normal((4, 97)), "bf16")  # odd width
    inputs = {"m": (base, np.zeros_like(base), 1.0)}
    ks = (3, 7, 12)
    g = [1 + 2.0**-k for k in ks] + [1 - 2.0**-k for k in ks]
    tab = C.error_by_cancellation(inputs, g, ("bf16",), min_n=1)
    nz = int(np.count_nonzero(base))
    for formula, sub in tab.groupby("formula"):
        assert sorted(sub["log2_rho"]) == sorted(ks), formula
        assert (sub["n"] == 2 * nz).all()  # both signs of g - 1 per k; base = 0 gives X = 0, left out
    # stable: (g - 1) base is exact in fp32 (a power of two times a bf16 value), so the result is correctly rounded
    assert (tab[tab["formula"] == "compose_stable"]["ulp_max"] == 0).all()


def test_naive_error_grows_with_rho_and_headline_reads_it():
    """lora chosen so that X = (g - 1) base + g s lora is about a 2^-j fraction of base (j = 1..20; bf16, so
    X stays normal): the naive form's mean error grows with rho (its fp32 roundings are of size |base| while
    the result shrinks), it is beyond 1 ulp only past the predicted rho = 2^(22-p) = 2^14, and the stable form
    stays within 1 ulp (its kappa_c here is about |g s lora| / |X|, and (g - 1) base, g s lora are each
    rounded once in fp32)."""
    rng = np.random.default_rng(1)
    n = 4096
    base = round_to(1 + rng.random(n), "bf16")  # [1, 2): no zeros
    g, s = float(np.float32(1 + 2.0**-10)), 1.0
    inputs = {}
    for j in range(1, 21):
        target = base * 2.0**-j * (1 + 0.5 * rng.random(n))  # X / base in [2^-j, 1.5 2^-j) before rounding
        lora = round_to(round_to((target - (g - 1) * base) / (g * s), "fp32"), "bf16")
        inputs[f"j{j}"] = (base, lora, s)
    tab = C.error_by_cancellation(inputs, [g], ("bf16",), min_n=50)
    naive = tab[(tab["formula"] == "compose_naive") & ~tab["sparse"]].sort_values("log2_rho")
    assert len(naive) >= 15
    h = C.cancellation_headline(tab)["bf16"]
    assert h["spearman_log2rho_vs_mean_ulp"] > 0.5
    assert h["naive_mean_ulp_largest_fifth"] > h["naive_mean_ulp_smallest_fifth"]
    assert h["predicted_log2rho"] == 14.0 and h["naive_ulp_max"] > 1
    assert h["naive_first_bin_beyond_1ulp_log2rho"] >= h["predicted_log2rho"]
    assert h["stable_ulp_max"] <= 1
    # the binned counts add up to every element with X != 0, once per formula
    per = tab.groupby("formula")["n"].sum()
    assert per["compose_naive"] == per["compose_stable"] > 0.99 * 20 * n


def test_sparse_bins_are_marked_and_left_out_of_the_statistics():
    tab = pd.DataFrame({"format": "bf16", "formula": ["compose_naive"] * 3 + ["compose_stable"] * 3,
                        "log2_rho": [0, 1, 2] * 2, "n": [500, 500, 3] * 2, "ulp_mean": [0.0, 0.1, 9.0, 0, 0, 0],
                        "ulp_max": [0, 1, 20, 0, 0, 1], "n_gt1": [0, 0, 3, 0, 0, 0]})
    tab["sparse"] = tab["n"] < 100
    h = C.cancellation_headline(tab)["bf16"]
    assert h["bins"] == 2 and h["naive_mean_ulp_largest_fifth"] == pytest.approx(0.1)
    assert h["naive_first_bin_beyond_1ulp_log2rho"] == 2 and h["naive_ulp_max"] == 20 and h["stable_ulp_max"] == 1
