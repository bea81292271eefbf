"""The reviewer's kit charges the tensor-core accumulator 2u per addition only where a probe of this card at
these GEMM shapes confirms it: a committed record that covers them, else a probe run now on the layer's
shapes; a probe that does not confirm leaves the rows resting on it without a finite bound, and the verdict
is not a PASS.  On the CPU the seam (``CardProbes``) takes the tensor-core route's accounting and an exact CPU
model of an accumulator (``TensorCoreModel``) stands in for the card; the expected shapes and factors are
written here by hand."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from conftest import SmallLayer
from dora_num.check import EXIT_INCOMPLETE, EXIT_PASS, BoundsCheckError, check_bounds
from dora_num.check_accumulation import CardProbes, accumulation_evidence
from dora_num.numerics.accumulation import TensorCoreModel, probe_positions, run_probes
from dora_num.ops.products import ProductModel, TensorCoreGemm

CARD = {"name": "Test Card 9000", "torch": "9.9.9", "cuda": "99.0"}
TC = ProductModel("tensor_core", None, "bf16")
# W [24, 40] bf16, A [4, 40] bf16 (SmallLayer.factors): U = W A^T and G = A A^T, one block each
LAYER = [TensorCoreGemm("U", "bf16", 24, 4, 40, 40), TensorCoreGemm("G", "bf16", 4, 4, 40, 40)]
LABELS = "bf16 U [24 x 40] @ [40 x 4], bf16 G [4 x 40] @ [40 x 4]"
# 16 products per fused block with 25 bits kept, truncated: at K = 40, 3 blocks of 16 * 2^-24 + 2^-23 each
# against 2 * 2^-24 * 40: 27/40 of the charge.  One product per addition truncated to 24 bits: 40 additions of
# 2^-23 + 2^-23 against the same: twice the charge.
FUSED, FUSED_FACTOR = TensorCoreModel(k=16, align_bits=25, rounding="rz"), Fraction(3 * (16 + 2), 2 * 40)
TRUNC = TensorCoreModel(k=1, align_bits=24, rounding="rz")


def _probe(model, calls):
    def probe(g):
        calls.append(g)
        return run_probes(model.mm, g.fmt, g.K, shape=(g.product, g.M, g.N), positions=probe_positions(g.K),
                          lead=g.lead)
    return probe


def _never(*_):
    raise AssertionError("called where it must not be")


def _none(card):
    return None


def _kept(g):
    return True


def _layer():
    return {**SmallLayer.factors(dtype=torch.bfloat16), "x": None}


def _line(rep) -> str:
    (line,) = [h for h in rep.header if h.startswith("accumulation: ")]
    return line


def test_an_uncovered_card_is_probed_at_the_layers_shapes_and_the_probe_decides():
    calls = []
    cards = CardProbes(device=CARD, records=_none, probe=_probe(FUSED, calls), subnormal_inputs=_kept, products=TC)
    rep = check_bounds(**_layer(), scale=0.37, accumulation=cards)
    assert calls == LAYER
    assert _line(rep) == (f"accumulation: 2u per addition, confirmed by a probe run now on Test Card 9000 at {LABELS} "
                          f"(measured charge at most {float(FUSED_FACTOR):.2g} of it)")
    assert rep.exit_code == EXIT_PASS, rep.to_string()
    bare = rep.table.set_index("check").loc["factored row norm, bare"]
    assert bare["within"] == 24 and "tensor cores" in bare["model"]


def test_a_committed_record_that_covers_the_shapes_is_used_and_named():
    asked = []

    def records(card):
        asked.append(card)
        return {"device": dict(CARD), "where": "data/test/probe_testcard.json.xz",
                "records": [run_probes(FUSED.mm, g.fmt, g.K, shape=(g.product, g.M, g.N)) for g in LAYER]}

    cards = CardProbes(device=CARD, records=records, probe=_never, subnormal_inputs=_kept, products=TC)
    rep = check_bounds(**_layer(), scale=0.37, accumulation=cards)
    assert asked == ["testcard9000"]
    assert _line(rep) == ("accumulation: 2u per addition, confirmed by the committed probe of Test Card 9000 "
                          f"(data/test/probe_testcard.json.xz; torch 9.9.9, CUDA 99.0) at {LABELS} (measured charge "
                          f"at most {float(FUSED_FACTOR):.2g} of it)")
    assert rep.exit_code == EXIT_PASS


@pytest.mark.parametrize("change", ["torch", "cuda", "name", "M", "lead"])
def test_a_record_of_another_setting_or_shape_does_not_cover(change):
    """A record covers a GEMM of the same card (device name), torch and CUDA (they pick the kernel), format,
    product, M, N, K and row stride; anything else is probed now."""
    rec_device = {**CARD, **({change: "other"} if change in CARD else {})}
    g = LAYER[0]
    recorded = g._replace(M=g.M + 8) if change == "M" else g._replace(lead=g.lead + 8) if change == "lead" else g
    rec = run_probes(FUSED.mm, "bf16", 40, shape=(recorded.product, recorded.M, recorded.N), lead=recorded.lead)
    calls = []
    cards = CardProbes(device=CARD, records=lambda c: {"device": rec_device, "records": [rec], "where": "x"},
                       probe=_probe(FUSED, calls), subnormal_inputs=_kept)
    ev = accumulation_evidence(TC, [g], "cpu", cards)
    assert calls == [g] and ev.confirmed and "a probe run now on Test Card 9000" in ev.line


def test_the_committed_h100_record_covers_its_own_shapes_only():
    """The H100's committed probe (read here through the study's reader): bf16 G at r = 16, K = 4096 and U at
    d_out = 8192 are covered on that card, torch and CUDA; U at d_out = 4096 is not recorded and is probed."""
    from dora_num.studies.bounds.accumulation import load_operator_probe

    device, _ = load_operator_probe("h100")
    covered = [TensorCoreGemm("G", "bf16", 16, 16, 4096, 4096), TensorCoreGemm("U", "bf16", 8192, 16, 4096, 4096)]
    other = TensorCoreGemm("U", "bf16", 4096, 16, 4096, 4096)
    small = run_probes(FUSED.mm, "bf16", 40, shape=("U", 24, 4))  # the CPU model at K = 4096 takes minutes
    calls = []

    def probe(g):
        calls.append(g)
        return small

    cards = CardProbes(device=device, probe=probe, subnormal_inputs=_kept)
    ev = accumulation_evidence(TC, covered, "cpu", cards)
    assert calls == [] and ev.confirmed
    assert ev.line.startswith(f"accumulation: 2u per addition, confirmed by the committed probe of {device['name']} "
                              f"(data/gpu/products/accumulation_probe_h100.json.xz; torch {device['torch']}")
    probed = accumulation_evidence(TC, [*covered, other], "cpu", cards)
    assert calls == [other] and probed.confirmed
    assert f"and by a probe run now on {device['name']} at bf16 U [4096 x 4096] @ [4096 x 16]" in probed.line


def test_a_probe_that_does_not_confirm_leaves_the_rows_without_a_bound():
    """An accumulator that truncates every addition to 24 bits (twice the charge): the bare norm, the rows the
    guard certified by lemma 4' and their g end to end have no finite bound, each listed with the reason;
    the rows recomputed in float64 (lemma 5'), the dense norm and the division keep theirs; INCOMPLETE."""
    cards = CardProbes(device=CARD, records=_none, probe=_probe(TRUNC, []), subnormal_inputs=_kept, products=TC)
    rep = check_bounds(**_layer(), scale=0.37, accumulation=cards)
    assert _line(rep).startswith("accumulation: 2u per addition NOT confirmed on Test Card 9000: bf16 U [24 x 40] @ "
                                 "[40 x 4] (probe run now): the measured accumulator implies 2 times the "
                                 "2u-per-addition charge (blocks of 1, 24 bits kept)")
    tab = rep.table.set_index("check")
    assert (tab.loc["factored row norm, bare", "within"], tab.loc["factored row norm, bare", "no_bound"]) == (0, 24)
    el = rep.elements.set_index(["check", "row"])
    recomputed = {j for j in range(24) if el.loc[("factored row norm, guarded", j), "lemma"] == "5'"}
    for check in ("factored row norm, guarded", "g end to end"):
        assert tab.loc[check, "within"] == len(recomputed) and tab.loc[check, "no_bound"] == 24 - len(recomputed)
    for check in ("dense row norm", "magnitude division"):
        assert tab.loc[check, "within"] == 24 and tab.loc[check, "no_bound"] == 0
    nb = rep.no_bound[rep.no_bound["check"].isin(["factored row norm, bare", "factored row norm, guarded",
                                                  "g end to end"])]
    assert len(nb) == 24 + 2 * (24 - len(recomputed))
    assert set(nb["reason"]) == {"accumulator not confirmed on Test Card 9000 (bf16 U [24 x 40] @ [40 x 4] (probe run "
                                 "now): the measured accumulator implies 2 times the 2u-per-addition charge (blocks "
                                 "of 1, 24 bits kept))"}
    assert rep.exit_code == EXIT_INCOMPLETE == 3
    assert rep.verdict.startswith("VERDICT: INCOMPLETE - no violation") and "factored row norm, bare" in rep.verdict


@pytest.mark.parametrize("case", ["subnormal inputs flushed", "probe raises"])
def test_what_cannot_be_confirmed_is_not_charged(case):
    def broken(g):
        raise RuntimeError("CUDA error: out of memory\nmore")

    probe, kept = (_probe(FUSED, []), lambda g: False) if case == "subnormal inputs flushed" else (broken, _kept)
    ev = accumulation_evidence(TC, LAYER, "cpu", CardProbes(device=CARD, records=_none, probe=probe,
                                                            subnormal_inputs=kept))
    assert not ev.confirmed and ev.reason.startswith("accumulator not confirmed on Test Card 9000 (bf16 U")
    assert ("16-bit subnormal inputs are flushed" if case == "subnormal inputs flushed" else
            "the probe did not run or could not be analysed (RuntimeError: CUDA error: out of memory)") in ev.reason


def test_a_shape_is_probed_once_per_check():
    calls, cache = [], {}
    cards = CardProbes(device=CARD, records=_none, probe=_probe(FUSED, calls), subnormal_inputs=_kept)
    for _ in range(2):
        assert accumulation_evidence(TC, LAYER, "cpu", cards, cache).confirmed
    assert calls == LAYER


def test_the_cpu_route_needs_no_probe():
    rep = check_bounds(**_layer(), scale=0.37, accumulation=CardProbes(records=_never, probe=_never))
    assert _line(rep) == ("accumulation: no tensor-core products (fp32 route on cpu): lemma 4 charges that route's "
                          "own model, no accumulation probe needed")
    assert rep.exit_code == EXIT_PASS


@pytest.mark.parametrize("products, A_dtype", [(ProductModel("tensor_core", None, "fp16"), torch.bfloat16),
                                               (TC, torch.float32), (ProductModel("split", 3, "bf16"), torch.float32)],
                         ids=["other format", "fp32 A", "split"])
def test_the_products_seam_charges_only_the_tensor_core_route(products, A_dtype):
    t = _layer()
    t["A"] = t["A"].to(A_dtype)
    with pytest.raises(BoundsCheckError, match="charges the tensor-core route only for W and A of its one 16-bit"):
        check_bounds(**t, scale=0.37, accumulation=CardProbes(device=CARD, products=products))


def test_the_charged_bound_is_the_tensor_core_models():
    """Confirmed: the bare norm's bound is lemma 4's tensor-core bound of these inputs, larger than the fp32
    route's on the same rows (gamma_{2d} against gamma_d)."""
    from dora_num.numerics.bounds import factored_norm_bound

    t = _layer()
    cards = CardProbes(device=CARD, records=_none, probe=_probe(FUSED, []), subnormal_inputs=_kept, products=TC)
    el = check_bounds(**t, scale=0.37, accumulation=cards).elements
    got = el[el["check"] == "factored row norm, bare"].sort_values("row")["bound"].to_numpy()
    W, A, B = (t[k].double().numpy() for k in "WAB")
    assert np.array_equal(got, factored_norm_bound(W, A, B, 0.37, products="tensor_core"))
    assert (got > factored_norm_bound(W, A, B, 0.37, products="fp32")).all()


@pytest.mark.gpu
def test_cuda_kit_names_its_evidence_and_probes_what_no_record_covers():
    """bf16 W and A on CUDA (the tensor-core route), 64 x 256 at r = 4: no committed record holds these GEMMs
    (they have U at d_out = 8192 and ranks 8 to 384), so the kit runs the probe now on this card at the
    layer's shapes; its verdict is the one the probe gives here (run_probes through the operator's product,
    analysed in the test), and the report follows it (PASS, or the rows without a bound and INCOMPLETE)."""
    from dora_num.numerics.accumulation import analyze, charge_confirmed
    from dora_num.ops.products import tensor_core_mm

    t = {k: v.cuda() for k, v in SmallLayer.factors(d_out=64, d_in=256, dtype=torch.bfloat16).items()}
    rep = check_bounds(**t, scale=0.37)
    name = torch.cuda.get_device_name()
    shapes = [("U", 64, 4), ("G", 4, 4)]
    live = [charge_confirmed(analyze(run_probes(tensor_core_mm, "bf16", 256, shape=s, device="cuda",
                                                positions=probe_positions(256)))) for s in shapes]
    labels = "bf16 U [64 x 256] @ [256 x 4], bf16 G [4 x 256] @ [256 x 4]"
    if all(w is None for w in live):
        assert _line(rep).startswith(f"accumulation: 2u per addition, confirmed by a probe run now on {name} at {labels}")
        assert rep.exit_code == EXIT_PASS, rep.to_string()
    else:
        assert _line(rep).startswith(f"accumulation: 2u per addition NOT confirmed on {name}: ")
        assert rep.exit_code == EXIT_INCOMPLETE


@pytest.mark.gpu
def test_cuda_kit_takes_the_committed_record_only_on_its_own_card_and_versions():
    """bf16 8192 x 4096 at r = 16: each recorded card's committed probe holds its U and G.  On a card with a
    record, under the record's torch and CUDA, the kit names the record (no probe) and the check passes;
    anywhere else it probes now, at the same GEMMs, and the report follows the probe."""
    from dora_num.numerics.accumulation import card_name
    from dora_num.studies.bounds.accumulation import load_operator_probe
    from dora_num.studies.bounds.datasets import OPERATOR_ACCUMULATION_CARDS

    g = torch.Generator().manual_seed(1)
    W = torch.randn(8192, 4096, generator=g).bfloat16().cuda()
    A = (torch.randn(16, 4096, generator=g) / 64).bfloat16().cuda()
    B = (torch.randn(8192, 16, generator=g) * 0.01).bfloat16().cuda()
    m = torch.linalg.vector_norm(W.float(), dim=1)
    rep = check_bounds(W, A, B, m, scale=2.0, max_rows=16)
    here = (torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)
    card = card_name(here[0])
    device = load_operator_probe(card)[0] if card in OPERATOR_ACCUMULATION_CARDS else {}
    labels = "bf16 U [8192 x 4096] @ [4096 x 16], bf16 G [16 x 4096] @ [4096 x 16]"
    if here == (device.get("name"), device.get("torch"), device.get("cuda")):
        assert _line(rep).startswith(f"accumulation: 2u per addition, confirmed by the committed probe of {here[0]} "
                                     f"(data/gpu/products/accumulation_probe_{card}.json.xz; torch {here[1]}, CUDA "
                                     f"{here[2]}) at {labels} (")
        assert rep.exit_code == EXIT_PASS, rep.to_string()
    else:
        assert f"a probe run now on {here[0]} at {labels}" in _line(rep)
        assert rep.exit_code == (EXIT_INCOMPLETE if " NOT confirmed " in _line(rep) else EXIT_PASS), rep.to_string()
