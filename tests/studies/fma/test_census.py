"""The exhaustive fp32 sqrt census: its integer reference, its classification, the GPU kernel
(under the interpreter) against the numpy twin, and the recorded CPU census (SMOKE slice)."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from dora_num.studies.fma import census as C
from dora_num.studies.fma.models import sqrt_is_correctly_rounded

EDGES = np.array([0x00000001, 0x00000002, 0x00000003, 0x007FFFFF, 0x00800000, 0x00800001, 0x3F7FFFFF, 0x3F800000,
                  0x3F800001, 0x40000000, 0x407FFFFF, 0x40800000, 0x7F7FFFFF, 0x7F7FFFFE], dtype=np.uint32)


def _f(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32).astype(np.float64)


def _pos_finite(n, seed):
    rng = np.random.Generator(np.random.PCG64(seed))
    return np.concatenate([rng.integers(1, 0x7F800000, n, dtype=np.int64).astype(np.uint32), EDGES])


def test_reference_is_the_correctly_rounded_root():
    bits = _pos_finite(200_000, 0)
    ref = C.reference(bits)
    assert set(np.unique(ref["cls"])) <= {2, 3}
    r = _f(ref["ref"])
    # certificate 1 (float64, exact: midpoints have 25 bits, their squares 50): lo^2 < x < hi^2
    assert sqrt_is_correctly_rounded(_f(bits), r).all()
    # certificate 2 (rational arithmetic) on a subset, edges included
    for b, rb in zip(np.concatenate([bits[:300], EDGES]), np.concatenate([ref["ref"][:300], C.reference(EDGES)["ref"]])):
        x, rr = Fraction(float(_f(b))), np.float32(_f(rb))
        lo = (Fraction(float(rr)) + Fraction(float(np.nextafter(rr, np.float32(0))))) / 2
        hi = (Fraction(float(rr)) + Fraction(float(np.nextafter(rr, np.float32(np.inf))))) / 2
        assert lo * lo < x < hi * hi


@pytest.mark.parametrize("bits, cls, ref", [
    (0x00000000, "zero", 0x00000000), (0x80000000, "zero", 0x80000000), (0x7F800000, "infinite", 0x7F800000),
    (0xFF800000, "infinite", 0x7FC00000), (0xBF800000, "negative", 0x7FC00000), (0x80000001, "negative", 0x7FC00000),
    (0x7FC00000, "not_a_number", 0x7FC00000), (0xFFFF0000, "not_a_number", 0x7FC00000), (0x3F800000, "normal", 0x3F800000),
    (0x40800000, "normal", 0x40000000), (0x00000001, "subnormal", None)], ids=lambda v: hex(v) if isinstance(v, int) else str(v))
def test_reference_classes_and_specials(bits, cls, ref):
    r = C.reference(np.array([bits], dtype=np.uint32))
    assert C.INPUT_CLASSES[r["cls"][0]] == cls
    if ref is not None:
        assert r["ref"][0] == ref
    else:  # sqrt(2^-149) = 2^-74.5: correctly rounded, checked exactly
        assert sqrt_is_correctly_rounded(_f([bits]), _f(r["ref"]))[0]


def _decode(v):
    code = v & 2047
    return (C.INPUT_CLASSES[code // 192], C.RESULTS[(code // 64) % 3], int(v >> 11))


@pytest.mark.parametrize("x_bits, out_bits, want", [
    (0x40800000, 0x40000000, ("normal", "correct", 0)),       # sqrt(4) = 2
    (0x40800000, 0x40000001, ("normal", "1ulp", 1)),
    (0x40800000, 0x3FFFFFFF, ("normal", "1ulp", 1)),
    (0x40800000, 0x40000003, ("normal", "other", 3)),
    (0x00000001, 0x00000000, ("subnormal", "other", C.DIST_CAP)),  # a flush to zero
    (0x80000000, 0x00000000, ("zero", "other", C.DIST_CAP)),       # sqrt(-0) must be -0
    (0xBF800000, 0x7FC00000, ("negative", "correct", 0)),
    (0xBF800000, 0x00000000, ("negative", "other", C.DIST_CAP)),
    (0xFF800000, 0xFFC00000, ("infinite", "correct", 0)),             # any NaN for sqrt(-inf)
], ids=lambda v: hex(v) if isinstance(v, int) else "-".join(map(str, v)))
def test_classify_cases(x_bits, out_bits, want):
    ref = C.reference(np.array([x_bits], dtype=np.uint32))
    assert _decode(int(C.classify(ref, np.array([out_bits], dtype=np.uint32))[0])) == want


SLICES = (0x00000000, 0x00700000, 0x3F800000, 0x40000000, 0x7F7F0000, 0x7F800000, 0x80000000, 0xFF800000)


@pytest.mark.parametrize("start", SLICES, ids=hex)
def test_kernel_matches_numpy_census(start):
    """The Triton census kernel (interpreter) classifies exactly as the numpy census does."""
    from dora_num.studies.fma import census_kernels as CK

    n = 1 << 16
    bits = np.arange(start, start + n, dtype=np.uint64).astype(np.uint32)
    ref = C.reference(bits)
    for impl, out in C.cpu_results(bits).items():
        got = CK.census_values(start, n, "external", torch.from_numpy(out.view(np.float32).copy()), device="cpu")
        assert np.array_equal(got.numpy().astype(np.int64), C.classify(ref, out)), impl
    got = CK.census_values(start, n, "tl.sqrt_rn", device="cpu").numpy().astype(np.int64)  # numpy's sqrt here
    assert np.array_equal(got, C.classify(ref, C.cpu_results(bits)[C.CPU_IMPLS[0]]))


def test_kernel_tables_match_numpy_tables():
    from dora_num.studies.fma import census_kernels as CK

    start, n = 0x3F000000, 1 << 17
    bits = np.arange(start, start + n, dtype=np.uint64).astype(np.uint32)
    out = C.cpu_results(bits)[C.CPU_IMPLS[1]]
    v = CK.census_values(start, n, "external", torch.from_numpy(out.view(np.float32).copy()), device="cpu")
    c_k, p_k = CK.tables(v, 7, "x")
    c_n, p_n = C.chunk_tables(7, {"x": C.classify(C.reference(bits), out)})
    assert c_k.reset_index(drop=True).equals(c_n.reset_index(drop=True))
    assert p_k.reset_index(drop=True).equals(p_n.reset_index(drop=True))


def test_census_refuses_ptx_under_the_interpreter():
    from dora_num.studies.fma import census_kernels as CK

    if not CK.INTERPRET:
        pytest.skip("runs the kernels natively")
    with pytest.raises(NotImplementedError, match="inline PTX"):
        CK.census_values(0, 1 << 16, "ptx sqrt.rn.f32", device="cpu")


def test_recorded_cpu_census_agrees_on_the_smoke_chunks():
    """The committed full CPU census: recompute its SMOKE chunks here.  numpy's and the float64
    route's rows (correctly rounded) must agree on any machine; torch's own fp32 row is the recording
    CPU's kernel: where this CPU's kernel differs, its results must still be faithful (at most 1 ulp
    from the correct root) and exact on zeros, negatives, infinities and NaN."""
    try:
        counts, per, prov = C.load_record()
    except FileNotFoundError:
        pytest.fail("data/exhaustive/sqrt_census_cpu_*.csv.gz missing: dora-num record sqrt-census")
    assert counts["count"].sum() == 3 * 2**32  # every pattern, each implementation
    _, fresh = C.census(C.SMOKE_CHUNKS, workers=1)
    res = C.check_against_record(per, C.SMOKE_CHUNKS, C.CPU_IMPLS, fresh=fresh)
    assert len(res) == len(C.SMOKE_CHUNKS) * len(C.CPU_IMPLS), res
    own = res["implementation"] == "torch.sqrt (CPU, float32)"
    assert res.loc[~own, "agrees"].all(), res
    if not res.loc[own, "agrees"].all():  # another kernel than the recording CPU's
        mine = fresh[fresh["implementation"] == "torch.sqrt (CPU, float32)"]
        assert set(mine["result"]) <= {"correct", "1ulp"}, mine
        special = mine["input_class"].isin(["negative", "zero", "infinite", "not_a_number"])
        assert (mine.loc[special, "result"] == "correct").all(), mine[special]


@pytest.mark.gpu
def test_gpu_census_slice_matches_numpy():
    from dora_num.studies.fma import census_kernels as CK

    start, n = 0x3F000000, 1 << 20
    bits = np.arange(start, start + n, dtype=np.uint64).astype(np.uint32)
    ref = C.reference(bits)
    with np.errstate(invalid="ignore"):
        want_rn = C.classify(ref, np.sqrt(bits.view(np.float32)).view(np.uint32))  # numpy: correctly rounded
    for mode in ("tl.sqrt_rn", "ptx sqrt.rn.f32"):
        got = CK.census_values(start, n, mode, device="cuda").cpu().numpy().astype(np.int64)
        assert np.array_equal(got, want_rn), mode
    r = torch.sqrt(CK.input_patterns(start, n, "cuda"))
    got = CK.census_values(start, n, "external", r, device="cuda").cpu().numpy().astype(np.int64)
    assert np.array_equal(got, C.classify(ref, r.cpu().numpy().view(np.uint32)))


def test_missing_gpu_census_is_named_with_its_recorder(tmp_path):
    from dora_num.repro.paths import RecordedDataMissing

    with pytest.raises(RecordedDataMissing, match="dora-num record exhaustive --out DIR --only census"):
        C.load_gpu(tmp_path)
