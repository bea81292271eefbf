"""collapse_table wiring, the accuracy of g_fp64 (a float64 evaluation), the CLI."""

import numpy as np
import pandas as pd
import pytest
import torch

from dora_num.__main__ import main
from dora_num.adapters.collapse import POOLED, collapse_table, g_fp64, g_from_states
from dora_num.adapters.peft_io import load_peft_dora
from dora_num.numerics.formulas import scale_constants

from ._tiny import D_IN, RANK

# bf16: eps = 2^-7; paper zone |g-1| < 2^-8; exact zone [1 - 2^-9, 1 + 2^-8] (ties go to 1)
G_CASES = {
    "one": (1.0, True, True),
    "above_in_both": (1 + 2**-9, True, True),
    "exact_zone_top_tie": (1 + 2**-8, False, True),  # the paper's open zone excludes it; RNE rounds it to 1
    "below_tie": (1 - 2**-9, True, True),
    "below_only_paper": (1 - 3 * 2**-10, True, False),  # asymmetry: inside |g-1| < eps/2, rounds to 1 - 2^-8
    "far": (1 + 2**-6, False, False),
}


def test_zone_fractions_on_crafted_g():
    g = np.array([v[0] for v in G_CASES.values()])
    df = collapse_table({"m": g}, ("bf16",), pooled=False)
    assert len(df) == 1
    row = df.iloc[0]
    assert row["frac_symmetric_zone"] == np.mean([v[1] for v in G_CASES.values()])
    assert row["frac_rounds_to_one"] == np.mean([v[2] for v in G_CASES.values()])
    assert row["abs_gm1_max"] == 2**-6 and row["n"] == len(g)


def test_absorption_on_crafted_activations():
    # x = 1 (bf16): fl(g*1) == 1 iff g in the exact zone; x = 0 always absorbed
    g = np.array([1 + 2**-9, 1 + 2**-6])
    x = np.array([[1.0, 1.0], [0.0, 0.0]])
    df = collapse_table({"m": g}, ("bf16",), activations={"m": x}, pooled=False)
    assert df["absorption"].iloc[0] == 3 / 4 and df["n_activations"].iloc[0] == 4


def test_table_shape_and_pooled_rows():
    rng = np.random.default_rng(0)
    gb = {"a": 1 + 1e-3 * rng.standard_normal(50), "b": 1 + 1e-2 * rng.standard_normal(30)}
    df = collapse_table(gb)
    assert len(df) == 3 * 4 and set(df["format"]) == {"bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2"}
    pooled = df[df["module"] == POOLED].set_index("format")
    per = df[df["module"] != POOLED]
    for fmt, sub in per.groupby("format"):  # pooled fraction = count-weighted mean of the modules'
        w = sub["n"].to_numpy()
        assert pooled.loc[fmt, "frac_symmetric_zone"] == pytest.approx((sub["frac_symmetric_zone"] * w).sum() / w.sum(), abs=0)
        assert pooled.loc[fmt, "n"] == 80


@pytest.mark.parametrize("bad, msg", [({}, "non-empty dict"), ({"a": np.ones((2, 2))}, "must be 1-D")])
def test_table_rejects_bad_input(bad, msg):
    with pytest.raises(ValueError, match=msg):
        collapse_table(bad)


def test_g_fp64_against_mpmath():
    """g_fp64's float64 norm is within its stated bound of the mpmath (two-precision) norm."""
    from dora_num.numerics.ground_truth import mp_dense_row_norm

    gen = torch.Generator().manual_seed(0)
    W = torch.randn(5, D_IN, generator=gen)
    A, B = torch.randn(RANK, D_IN, generator=gen), torch.randn(5, RANK, generator=gen) * 0.1
    s = 0.37
    m = torch.linalg.vector_norm(W, dim=1) * (1 + 1e-3)
    got = g_fp64(W, A, B, m, s)
    norm = mp_dense_row_norm(W, A, B, scale_constants(s)[0]).value
    want = m.double().numpy() / norm
    bound = (RANK + D_IN + 2) * 2.0**-53 * 2  # norm bound + the division
    assert np.all(np.abs(got - want) <= bound * np.abs(want))


def test_g_from_exported_adapter(tiny_export):
    base, model, adir, bdir = tiny_export
    g = g_from_states(load_peft_dora(adir, bdir))
    for name, mod in ((n, model.get_submodule(n)) for n in g):
        # the fp32 path: factored fp32 norm (a few u32 relative, norm bounds of numerics.bounds) + one division
        ours = mod.magnitude_scale().detach().double().numpy()
        assert np.allclose(g[name], ours, rtol=8 * 2.0**-24, atol=0)


def test_cli_collapse(tiny_export, tmp_path, capsys):
    base, model, adir, bdir = tiny_export
    out = tmp_path / "c.csv"
    assert main(["collapse", str(adir), "--base", str(bdir), "--out", str(out), "--no-activations"]) == 0
    df = pd.read_csv(out)
    assert len(df) == 3 * 4  # 2 modules + pooled, 4 formats
    printed = capsys.readouterr().out
    assert POOLED in printed and "frac_rounds_to_one" in printed and "wrote" in printed


def test_cli_collapse_bad_adapter(tmp_path, capsys):
    assert main(["collapse", str(tmp_path), "--base", str(tmp_path)]) == 2
    assert "adapter_config.json is missing" in capsys.readouterr().err


def test_cli_collapse_needs_base(tiny_export, capsys):
    base, model, adir, bdir = tiny_export
    assert main(["collapse", str(adir)]) == 2
    assert "pass --base MODEL_DIR" in capsys.readouterr().err
