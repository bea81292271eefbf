r"""Exhaustive fp32 square-root census: every one of the 2^32 bit patterns (notebook 02).

Each implementation's result for each input is classified by the input's class
(:data:`INPUT_CLASSES`) and by the result (:data:`RESULTS`): ``correct`` (the correctly
rounded root, or the IEEE 754 special value: ``sqrt(-0) = -0``, ``sqrt(+inf) = +inf``, NaN
for NaN and for every ``x < 0``), ``1ulp`` (a positive float one step from the correct
root), ``other`` (anything else, a wrong special value included).  Positive finite inputs
also carry the parity of their exponent and the position of the exact root between its two
neighbouring floats (below), so that *where* an implementation fails can be plotted.

The method in full: docs/methods.md, studies/fma/census.py.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .datasets import SQRT_CENSUS_CPU, SQRT_CENSUS_GPU

INPUT_CLASSES = ("negative", "zero", "subnormal", "normal", "infinite", "not_a_number")  # CSV-safe names
RESULTS = ("correct", "1ulp", "other")
N_POS_BINS = 32
N_CODES = len(INPUT_CLASSES) * len(RESULTS) * 2 * N_POS_BINS  # 1152 < 2^11
DIST_CAP = (1 << 20) - 1  # ULP distance stored for results that are no positive float
CHUNK = 1 << 22  # census granularity of the record (1024 chunks)
CPU_IMPLS = ("numpy np.sqrt (float32)", "torch.sqrt (CPU, float32)", "torch.sqrt (CPU, via float64)")
SMOKE_CHUNKS = (0, 254, 256, 510, 1023)  # +0, subnormals; [1, 1.5) and [2, 3) (both exponent parities); +inf, NaN; -NaN


def _bit_length(m: np.ndarray) -> np.ndarray:
    """``floor(log2 m) + 1`` for positive int64 ``m < 2^53`` (exact: frexp of an exact integer)."""
    return np.frexp(m.astype(np.float64))[1].astype(np.int64)


def reference(bits) -> dict[str, np.ndarray]:
    """Integer reference for fp32 patterns ``bits`` (uint32): ``cls`` (index into
    :data:`INPUT_CLASSES`), ``ref`` (the correct result's pattern, uint32), ``parity`` and
    ``pos`` (0 for non-positive-finite inputs), ``corrections`` (how many inputs the integer
    test moved off the float64 guess; any number is fine, the certificate is the inequality)."""
    b = np.asarray(bits, dtype=np.uint32)
    ef = (b >> 23) & 0xFF
    fr = b & 0x7FFFFF
    neg = b >= 0x80000000
    cls = np.full(b.shape, 3, dtype=np.int64)
    cls[ef == 0] = 2
    cls[neg] = 0
    cls[(b & 0x7FFFFFFF) == 0] = 1
    cls[ef == 0xFF] = 4
    cls[(ef == 0xFF) & (fr != 0)] = 5
    ref = np.full(b.shape, 0x7FC00000, dtype=np.uint32)
    keep = (cls == 1) | ((cls == 4) & ~neg)
    ref[keep] = b[keep]
    parity = np.zeros(b.shape, dtype=np.int64)
    pos = np.zeros(b.shape, dtype=np.int64)
    pf = (cls == 2) | (cls == 3)
    sel = None if pf.all() else np.flatnonzero(pf)
    r, par, ps, n_corr = _isqrt_round((b if sel is None else b[sel]).astype(np.int64))
    if sel is None:
        ref, parity, pos = r.astype(np.uint32), par, ps
    else:
        ref[sel], parity[sel], pos[sel] = r, par, ps
    return {"cls": cls, "ref": ref, "parity": parity, "pos": pos, "corrections": n_corr}


def _isqrt_round(b: np.ndarray):
    """Positive finite fp32 patterns (int64) -> (correct root pattern, exponent parity,
    position bin, corrections) by the integer method of the docs/methods.md."""
    if b.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, 0
    ef = b >> 23
    M = b & 0x7FFFFF
    E = ef - 150
    normal = ef != 0
    M[normal] |= 0x800000
    if not normal.all():  # subnormals: normalise M to 24 bits
        sub = ~normal
        E[sub] = -149
        lz = 24 - np.frexp(M[sub].astype(np.float64))[1].astype(np.int64)
        M[sub] <<= lz
        E[sub] -= lz
    odd = E & 1
    N = M << (24 - odd)
    q = np.sqrt(N.astype(np.float64)).astype(np.int64)  # floor (positive): a starting guess only
    q2 = q * q
    fix = (q2 > N).astype(np.int64)
    fix -= (q2 + 2 * q + 1 <= N)
    n_corr = int(np.count_nonzero(fix))
    if n_corr:
        q -= fix
        q2 = q * q
    rem = N - q2
    if ((rem < 0) | (rem > 2 * q)).any():  # i.e. not q^2 <= N < (q+1)^2
        raise ArithmeticError("integer square root not certified after one correction")
    r = q + (rem > q)
    h = (E - 24 + odd) >> 1
    ref = ((h + 150) << 23) + r - (1 << 23)
    parity = (E + 23) & 1
    pos = (rem * N_POS_BINS) // (2 * q + 1)
    return ref, parity, pos, n_corr


def classify(ref: dict, out_bits) -> np.ndarray:
    """Per input ``(dist << 11) | code`` (int64), ``code = ((cls*3 + result)*2 + parity)*32 + pos``."""
    o = np.asarray(out_bits, dtype=np.uint32).astype(np.int64)
    r = ref["ref"].astype(np.int64)
    cls = ref["cls"]
    pos_fin = (cls == 2) | (cls == 3)
    o_nan = ((o >> 23) & 0xFF == 0xFF) & ((o & 0x7FFFFF) != 0)
    o_posf = (o > 0) & (o < 0x7F800000)
    dist = np.where(pos_fin & o_posf, np.abs(o - r), np.where(pos_fin, DIST_CAP, 0))
    ok_special = np.where(np.isin(cls, (0, 5)) | ((cls == 4) & (r == 0x7FC00000)), o_nan, o == r)
    res = np.where(pos_fin, np.where(dist == 0, 0, np.where(dist == 1, 1, 2)), np.where(ok_special, 0, 2))
    dist = np.where(pos_fin, dist, np.where(ok_special, 0, DIST_CAP))
    code = ((cls * 3 + res) * 2 + ref["parity"]) * N_POS_BINS + ref["pos"]
    return (np.minimum(dist, DIST_CAP) << 11) | code


def cpu_results(bits) -> dict[str, np.ndarray]:
    """The CPU implementations' result patterns (uint32) for fp32 patterns ``bits``."""
    import torch

    from ...numerics.arithmetic import TorchFP32CorrectSqrt

    x = np.asarray(bits, dtype=np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        out_np = np.sqrt(x)
    t = torch.from_numpy(x.copy())
    return {CPU_IMPLS[0]: out_np.view(np.uint32),
            CPU_IMPLS[1]: torch.sqrt(t).numpy().view(np.uint32),
            CPU_IMPLS[2]: TorchFP32CorrectSqrt.sqrt(t).numpy().view(np.uint32)}


def chunk_tables(chunk: int, values: dict[str, np.ndarray], size: int = CHUNK) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(counts, per_chunk)`` for one chunk from classified values ``{impl: (dist<<11)|code}``:
    ``counts`` by impl x code (nonzero only), ``per_chunk`` by impl x class x result with the
    largest ULP distance."""
    counts, per = [], []
    for impl, v in values.items():
        code = v & 2047
        dist = v >> 11
        c = np.bincount(code, minlength=N_CODES)
        nz = np.flatnonzero(c)
        counts.append(pd.DataFrame({"implementation": impl, "code": nz, "count": c[nz]}))
        cr = code // (2 * N_POS_BINS)  # cls * 3 + result
        mx = np.zeros(len(INPUT_CLASSES) * 3, dtype=np.int64)
        np.maximum.at(mx, cr, dist)
        cc = np.bincount(cr, minlength=mx.size)
        for k in np.flatnonzero(cc):
            per.append({"chunk": chunk, "implementation": impl, "input_class": INPUT_CLASSES[k // 3],
                        "result": RESULTS[k % 3], "count": int(cc[k]), "max_ulp": int(mx[k])})
    return pd.concat(counts, ignore_index=True), pd.DataFrame(per)


def decode_codes(df: pd.DataFrame) -> pd.DataFrame:
    """Expand the ``code`` column into input_class, result, exp_parity, position_bin."""
    c = df["code"].to_numpy()
    out = df.drop(columns="code").copy()
    out["input_class"] = np.array(INPUT_CLASSES)[c // (3 * 2 * N_POS_BINS)]
    out["result"] = np.array(RESULTS)[(c // (2 * N_POS_BINS)) % 3]
    out["exp_parity"] = np.where((c // N_POS_BINS) % 2 == 0, "even", "odd")
    out["position_bin"] = c % N_POS_BINS
    return out


SUB_BLOCK = 1 << 20  # numpy working size: 2^20 was 3x faster than 2^22 per input on the 2-core machine


def _cpu_chunk(chunk: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    import torch

    torch.set_num_threads(1)
    vals: dict[str, list] = {k: [] for k in CPU_IMPLS}
    for s0 in range(chunk * CHUNK, (chunk + 1) * CHUNK, SUB_BLOCK):
        bits = np.arange(s0, s0 + SUB_BLOCK, dtype=np.uint64).astype(np.uint32)
        ref = reference(bits)
        for k, v in cpu_results(bits).items():
            vals[k].append(classify(ref, v))
    return chunk_tables(chunk, {k: np.concatenate(v) for k, v in vals.items()})


def census(chunks=None, *, workers: int = 2, progress: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The CPU census over ``chunks`` (default: all 1024 of 2^22 inputs) in ``workers``
    processes: ``(counts, per_chunk)``, counts summed over the chunks and decoded."""
    import concurrent.futures as cf

    chunks = list(range((1 << 32) // CHUNK)) if chunks is None else list(chunks)
    parts = []
    if workers <= 1:
        parts = [_cpu_chunk(c) for c in chunks]
    else:
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            for i, p in enumerate(ex.map(_cpu_chunk, chunks, chunksize=4)):
                parts.append(p)
                if progress and i % 64 == 0:
                    print(f"[census] chunk {i + 1}/{len(chunks)}", flush=True)
    counts = pd.concat([p[0] for p in parts]).groupby(["implementation", "code"], as_index=False)["count"].sum()
    return decode_codes(counts), pd.concat([p[1] for p in parts], ignore_index=True)


def summary(counts: pd.DataFrame, per_chunk: pd.DataFrame) -> pd.DataFrame:
    """One row per implementation x input class: counts of each result and the largest ULP
    distance (``DIST_CAP`` marks a result that is no positive float at all)."""
    t = counts.pivot_table(index=["implementation", "input_class"], columns="result", values="count",
                           aggfunc="sum", fill_value=0).reindex(columns=list(RESULTS), fill_value=0)
    t["n"] = t.sum(axis=1)
    mx = per_chunk.groupby(["implementation", "input_class"])["max_ulp"].max()
    t["max_ulp"] = mx.reindex(t.index).fillna(0).astype(int)
    t = t.reset_index()
    order = {c: i for i, c in enumerate(INPUT_CLASSES)}
    return t.sort_values(["implementation", "input_class"], key=lambda s: s.map(order) if s.name == "input_class"
                         else s).reset_index(drop=True)


def check_against_record(record_chunks: pd.DataFrame, chunks=SMOKE_CHUNKS, impls=CPU_IMPLS,
                         fresh: pd.DataFrame | None = None) -> pd.DataFrame:
    """Recompute ``chunks`` here (or take ``fresh``, the per-chunk census of them on the CPU it runs on) and compare
    with the recorded per-chunk counts: a row per (chunk, implementation) with ``agrees``.  numpy's and
    the float64 route's rows are correctly rounded and agree on any machine; torch's own fp32 row
    depends on the CPU kernel torch runs, which the capability alone does not name (two AVX512 machines
    differed on chunks 0, 254 and 256)."""
    if fresh is None:
        _, fresh = census(chunks, workers=1)
    rec = record_chunks[record_chunks["chunk"].isin(chunks)]
    rows = []
    key = ["chunk", "implementation", "input_class", "result"]
    for (ch, impl), f in fresh.groupby(["chunk", "implementation"]):
        if impl not in impls:
            continue
        r = rec[(rec["chunk"] == ch) & (rec["implementation"] == impl)]
        a = f.set_index(key)[["count", "max_ulp"]].sort_index()
        b = r.set_index(key)[["count", "max_ulp"]].sort_index()
        rows.append({"chunk": ch, "implementation": impl, "agrees": a.equals(b), "n": int(a["count"].sum())})
    return pd.DataFrame(rows)


def cpu_capability() -> str:
    """torch's CPU kernel dispatch level (``AVX512``, ``AVX2``, ...): the torch CPU rows depend on it."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


# --------------------------------------------------------------------------
# Tables and the figure of notebook 02
# --------------------------------------------------------------------------


def load_gpu(folder=None):
    """``(counts, per_chunk, timing)`` of the recorded GPU census (``data/gpu/exhaustive/`` or
    ``folder``); :class:`~dora_num.repro.recording.RecordedDataMissing` saying how to record it."""
    paths = SQRT_CENSUS_GPU.require(folder)
    return tuple(pd.read_csv(p) for p in paths)


def failure_profile(counts: pd.DataFrame, input_class: str = "normal") -> pd.DataFrame:
    """Per implementation, exponent parity and position bin of the exact root between its two
    neighbouring floats: inputs and the fraction not correctly rounded."""
    c = counts[counts["input_class"] == input_class]
    g = c.groupby(["implementation", "exp_parity", "position_bin"])
    out = g["count"].sum().rename("n").to_frame()
    out["not_correct"] = c[c["result"] != "correct"].groupby(["implementation", "exp_parity", "position_bin"])[
        "count"].sum().reindex(out.index).fillna(0).astype(np.int64)
    out["frac_not_correct"] = out["not_correct"] / out["n"]
    out = out.reset_index()
    out["position"] = (out["position_bin"] + 0.5) / N_POS_BINS
    return out


def load_record(folder=None) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """``(counts, per_chunk, provenance)`` of the recorded CPU census (``data/exhaustive/`` or
    ``folder``); :class:`~dora_num.repro.recording.RecordedDataMissing` saying how to record it."""
    from ...repro.provenance import read_provenance

    paths = SQRT_CENSUS_CPU.require(folder)
    counts, per = (pd.read_csv(p) for p in paths)
    return counts, per, read_provenance(paths[0])

