r"""The tensor-core accumulator of 16-bit GEMMs with fp32 output, probed and analysed (card-independent).

Lemma 4 (docs/bounds.md, section 0, assumption 3) charges the fp32 accumulator of
``torch.mm(a, b, out_dtype=float32)`` on 16-bit inputs ``2u`` per addition in any order.  That is an
assumption about the card and the GEMM kernel it picks for a shape.  Here: the probes that measure an
accumulator through any ``mm`` (:func:`run_probes`: the order of the sum, by swamping, and its
arithmetic, by exact-by-construction short dot products), their analysis (:func:`analyze`, the blocked
model :class:`TensorCoreModel` that :func:`fit_order` fits to the order), what the findings imply for
the charge (:func:`bound_factor`, :func:`charge_confirmed`) and the packed form of a card's record
(:func:`pack_probe`, :func:`unpack_probe`).  The reviewer's kit (:mod:`dora_num.check`) runs them on the
layer's own shapes; notebook 03's study (:mod:`dora_num.studies.bounds.accumulation`) reads the
recorded ones.  The method in full: docs/methods.md.
"""

from __future__ import annotations

import json
import lzma
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMATS = ("bf16", "fp16")
# (M, unit) of the order probe: M / unit >= 2^39 so that up to 2^14 units (< ulp(M)/2 of a
# 24-bit accumulator, also after an alignment of up to 2^14 more bits) are swamped.
ORDER_SCALE = {"bf16": (2.0**40, 1.0), "fp16": (2.0**15, 2.0**-24)}


# --------------------------------------------------------------------------
# An exact model of a blocked tensor-core accumulator (for the tests and the fit)
# --------------------------------------------------------------------------

SEGMENT_TILES = (0, 16, 32, 64, 128, 256)  # 0: equal segments (np.array_split); else lengths rounded up to this
REDUCTIONS = ("pairwise", "serial")


def segments(K: int, splits: int, tile: int = 0) -> list[np.ndarray]:
    """The index ranges of ``splits`` segments of ``K`` (split-K): equal up to one (``tile = 0``), or each
    ``ceil(ceil(K / splits) / tile) * tile`` long but the last (what cuBLAS's split-K kernels were measured
    to do on an H100: 4096 = 1408 + 1408 + 1280). Empty when that tiling leaves a segment empty."""
    if tile == 0:
        return np.array_split(np.arange(K), splits)
    length = -(-(-(-K // splits)) // tile) * tile
    starts = range(0, K, length)
    return [np.arange(a, min(a + length, K)) for a in starts] if len(starts) == splits else []


@dataclass(frozen=True)
class TensorCoreModel:
    """``k`` products per fused block (with the running sum), ``align_bits`` bits kept when a
    term is aligned to the block's largest exponent (truncated toward zero), the block's sum
    rounded to fp32 by ``rounding`` (``"rn"`` or ``"rz"``); ``splits`` segments of ``K``
    (:func:`segments`, ``seg_tile``) accumulated independently and added at the end in fp32
    (round to nearest), ``reduction`` ``"pairwise"`` (a tree) or ``"serial"`` (segment 0, then 1, ...)."""

    k: int = 16
    align_bits: int = 25
    rounding: str = "rz"
    splits: int = 1
    subnormal_products: bool = True
    seg_tile: int = 0
    reduction: str = "pairwise"

    def dot(self, p: np.ndarray) -> np.ndarray:
        """Rows of exact products ``p [rows, K]`` (float64) -> fp32 results (float64 storage)."""
        p = np.asarray(p, dtype=np.float64)
        if not self.subnormal_products:
            p = np.where(np.abs(p) < 2.0**-126, 0.0, p)
        segs = segments(p.shape[1], self.splits, self.seg_tile)
        if not segs:
            raise ValueError(f"{self.splits} segments of {self.seg_tile}-aligned length do not tile K = {p.shape[1]}")
        parts = []
        for seg in segs:
            acc = np.zeros(p.shape[0])
            for s0 in range(0, seg.size, self.k):
                terms = np.concatenate([acc[:, None], p[:, seg[s0:s0 + self.k]]], axis=1)
                mx = np.max(np.abs(terms), axis=1)
                e = np.floor(np.log2(np.where(mx > 0, mx, 1.0)))
                q = 2.0 ** (e - self.align_bits + 1)
                aligned = np.trunc(terms / q[:, None]) * q[:, None]
                acc = _round32(aligned.sum(axis=1), self.rounding)  # exact: <= align_bits + 5 bits
            parts.append(acc)
        if self.reduction == "serial":
            out = parts[0]
            for part in parts[1:]:
                out = _round32(out + part, "rn")
            return out
        out = parts[0]
        while len(parts) > 1:  # pairwise, round to nearest
            parts = [_round32(parts[i] + parts[i + 1], "rn") if i + 1 < len(parts) else parts[i]
                     for i in range(0, len(parts), 2)]
            out = parts[0]
        return out

    def mm(self, a, b):
        """``a @ b`` for torch or numpy 16-bit matrices, through :meth:`dot` (slow; tests only)."""
        import torch

        A = a.double().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64)
        B = b.double().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float64)
        out = np.stack([self.dot(A * B[:, c][None, :]) for c in range(B.shape[1])], axis=1)
        return torch.from_numpy(out.astype(np.float32))


def _round32(x: np.ndarray, mode: str) -> np.ndarray:
    r = x.astype(np.float32).astype(np.float64)
    if mode == "rn":
        return r
    if mode == "rz":
        over = np.abs(r) > np.abs(x)
        return np.where(over, np.nextafter(r.astype(np.float32), np.float32(0)).astype(np.float64), r)
    raise ValueError(f"rounding must be rn or rz, got {mode!r}")


def model_lca_sizes(K: int, i: int, k: int, splits: int, tile: int = 0, reduction: str = "pairwise") -> np.ndarray:
    """``S(i, j)`` for every ``j`` under the blocked model (``S(i, i) = 1``): the number of products
    under the lowest node of the summation tree that holds both ``i`` and ``j``."""
    segs = segments(K, splits, tile)
    lens = np.array([len(g) for g in segs])
    seg_of = np.repeat(np.arange(len(segs)), lens)
    start = np.repeat(np.cumsum(lens) - lens, lens)
    blk = (np.arange(K) - start) // k  # block index inside its segment
    si = seg_of[i]
    # within a segment: the running sum after block t holds blocks 0..t: lca(i, j) is the
    # block node of max(blk_i, blk_j), whose subtree is blocks 0..max of that segment
    inside = np.minimum((np.maximum(blk, blk[i]) + 1) * k, lens[si])
    if reduction == "serial":  # segment 0 + 1, then + 2, ...: the node adding the later segment
        across = np.cumsum(lens)[np.maximum(seg_of, si)]
    elif reduction == "pairwise":  # the smallest aligned group of 2^L segments holding both
        x = seg_of ^ si
        level = np.where(x > 0, np.floor(np.log2(np.maximum(x, 1))).astype(np.int64) + 1, 0)  # bit lengths
        group_start = (si >> level) << level
        cum = np.concatenate([[0], np.cumsum(lens)])
        across = cum[np.minimum(group_start + (1 << level), len(segs))] - cum[group_start]
    else:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    out = np.where(seg_of == si, inside, across)
    out[i] = 1
    return out


# --------------------------------------------------------------------------
# Probes
# --------------------------------------------------------------------------

def _as_pair(values: np.ndarray, fmt: str):
    """``(a, b)`` 16-bit numpy arrays with ``a * b == values`` exactly, ``b`` in {1} (values
    representable in ``fmt``) or split for products beyond the format's range."""
    import ml_dtypes

    dt = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}[fmt]
    a = np.asarray(values, dtype=np.float64).astype(dt)
    if not np.array_equal(a.astype(np.float64), np.asarray(values, dtype=np.float64)):
        raise ValueError(f"probe values not representable in {fmt}")
    return a


def order_probes(K: int, fmt: str, positions=None) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Rows of ``a`` (values in ``fmt``, b = ones) for the order probe: ``(rows, [(i, j), ...])``."""
    M, unit = ORDER_SCALE[fmt]
    positions = sorted(set(positions if positions is not None else probe_positions(K)))
    rows, ij = [], []
    for i in positions:
        for j in range(K):
            if j == i:
                continue
            r = np.full(K, unit)
            r[i], r[j] = M, -M
            rows.append(r)
            ij.append((i, j))
    return np.array(rows), ij


def _split(v: float) -> tuple[float, float]:
    """``v = a * b`` with ``a``, ``b`` normal in both formats (|v| >= 2^-28; powers of two times
    small integers): the exponent shared between the two factors."""
    m, e = math.frexp(abs(v))
    ea = (e - 1) // 2
    return math.copysign(m * 2.0 ** (e - ea), v), 2.0**ea


def arith_probes(K: int, fmt: str) -> list[dict]:
    """Short dot products (``name``, ``pos``, ``a``, ``b``, ``exact``) at chosen positions, zeros
    elsewhere: product exactness, subnormal products, bits kept in a fused block
    (``[1, 2^-t, -1]`` in one block: ``2^-t`` survives iff the block keeps it), bits kept by the
    running sum (``[1, 2^-t]`` in the first block, ``-1`` in the last), and the rounding of a
    block sum and of the running-sum update (``1 + 0.75 ulp``, ties)."""
    P = []
    one_p = 1 + 2.0**-7  # bf16 and fp16 both hold 1 + 2^-7
    P.append({"name": "product_exact", "pos": [0], "a": [one_p], "b": [one_p], "exact": one_p * one_p})
    if fmt == "bf16":
        P.append({"name": "subnormal_product", "pos": [0], "a": [2.0**-70], "b": [2.0**-70], "exact": 2.0**-140})
    for t in range(1, 29):
        for sign in (1, -1):
            sa, sb = _split(sign * 2.0**-t)
            tag = f"{'+' if sign > 0 else '-'}{t}"
            P.append({"name": f"block_bits_{tag}", "pos": [0, 1, 2], "a": [1.0, sa, -1.0], "b": [1.0, sb, 1.0],
                      "exact": sign * 2.0**-t})
            P.append({"name": f"acc_bits_{tag}", "pos": [0, 1, K - 1], "a": [1.0, sa, -1.0], "b": [1.0, sb, 1.0],
                      "exact": sign * 2.0**-t})
    for where, pos in (("block", (0, 1)), ("acc", (0, K - 1))):
        for name, small in (("quarter3", 1.5 * 2.0**-24), ("tie", 2.0**-24), ("tie_odd", 1.5 * 2.0**-23)):
            for sign in (1, -1):
                sa, sb = _split(sign * small)
                P.append({"name": f"round_{where}_{name}_{'+' if sign > 0 else '-'}", "pos": list(pos),
                          "a": [sign * 1.0, sa], "b": [1.0, sb], "exact": sign * (1.0 + small)})
    return P


def run_probes(mm, fmt: str, K: int, *, shape=("U", 256, 64), device="cpu", positions=None,
               lead: int | None = None) -> dict:
    """Run every probe through ``mm(a, b)`` with ``a [rows, K]``, ``b [K, N]`` (16-bit, ``b`` a
    transposed view as in the factored norm).  Rows are padded to ``shape``'s M rows per call
    and every one of the ``N`` columns must give the same output (recorded: ``columns_agree``).
    ``lead``: the row stride of ``a`` and of ``b``'s transpose (default ``K``): the operator's ``d_in``
    where it multiplies one column block of ``K`` of them (``numerics.standard_model.tc_blocks``), so
    that the GEMM sees the strides the operator's does."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    _, m_rows, n_cols = shape
    lead = K if lead is None else int(lead)
    if lead < K:
        raise ValueError(f"lead = {lead} is below K = {K}: a row stride holds at least a row")

    def run(rows_a: np.ndarray, bvec: np.ndarray) -> tuple[np.ndarray, bool]:
        ra = torch.from_numpy(rows_a).to(dt)
        bv = torch.from_numpy(bvec).to(dt)
        if not (torch.equal(ra.double(), torch.from_numpy(rows_a)) and torch.equal(bv.double(), torch.from_numpy(bvec))):
            raise ValueError("probe values are not representable in the input format")
        bt = torch.zeros((n_cols, lead), dtype=dt, device=device)[:, :K]
        bt.copy_(bv.to(device)[None, :].expand(n_cols, K))
        outs, agree = [], True
        for s0 in range(0, rows_a.shape[0], m_rows):
            blk = ra[s0:s0 + m_rows]
            a = torch.zeros((m_rows, lead), dtype=dt, device=device)[:, :K]
            a[:blk.shape[0]] = blk.to(device)
            y = mm(a, bt.T)[:blk.shape[0]].double().cpu().numpy()
            agree &= bool((y == y[:, :1]).all())
            outs.append(y[:, 0])
        return np.concatenate(outs), agree

    rows, ij = order_probes(K, fmt, positions)
    M, unit = ORDER_SCALE[fmt]
    out, agree = run(rows, np.ones(K))
    single = np.zeros((1, K))
    single[0, 3 % K] = unit
    unit_out, _ = run(single, np.ones(K))
    arith = []
    for pr in arith_probes(K, fmt):
        a = np.zeros((1, K))
        b = np.ones(K)
        for pos, av, bv in zip(pr["pos"], pr["a"], pr["b"]):
            a[0, pos], b[pos] = av, bv
        y, ag = run(a, b)
        arith.append({**pr, "output": float(y[0]), "columns_agree": ag})
    return {"format": fmt, "K": K, "shape": list(shape), "M": M, "unit": unit, "unit_alone": float(unit_out[0]),
            **({"lead": lead} if lead != K else {}), "order_ij": ij, "order_out": out.tolist(),
            "columns_agree": agree, "arith": arith}


# --------------------------------------------------------------------------
# Analysis (from a recorded probe file; no GPU)
# --------------------------------------------------------------------------

def lca_sizes(rec: dict) -> dict[int, np.ndarray]:
    """Measured ``S(i, j)`` per probed ``i`` (``S(i, i) = 1``)."""
    K, unit = rec["K"], rec["unit"]
    ij = np.asarray(rec["order_ij"], dtype=np.int64).reshape(-1, 2)
    sizes = K - np.rint(np.asarray(rec["order_out"], dtype=np.float64) / unit).astype(np.int64)
    out: dict[int, np.ndarray] = {}
    for i in np.unique(ij[:, 0]):
        row = np.ones(K, dtype=np.int64)
        sel = ij[:, 0] == i
        row[ij[sel, 1]] = sizes[sel]
        out[int(i)] = row
    return out


def fit_order(rec: dict) -> dict:
    """The blocked model that reproduces every order probe, if one does: block size ``k``, the number
    of split-K segments, their alignment and the order they are added in (the fewest segments first)."""
    S = lca_sizes(rec)
    K = rec["K"]
    first = S.get(0)
    for splits in range(1, 65):
        for tile in SEGMENT_TILES if splits > 1 else (0,):
            segs = segments(K, splits, tile)
            if not segs:
                continue
            for reduction in REDUCTIONS if splits > 2 else ("pairwise",):
                for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
                    if first is not None and K > 1 and len(segs[0]) > 1 and \
                            first[1] != (2 if k == 1 else min(k, len(segs[0]))):
                        continue  # S(0, 1) rules this block size out before the full rows are built
                    if all(np.array_equal(model_lca_sizes(K, i, k, splits, tile, reduction), s) for i, s in S.items()):
                        return {"explained": True, "block_k": k, "splits": splits, "segment_tile": tile,
                                "reduction": reduction,
                                "segment_max": int(max(len(g) for g in segments(K, splits, tile))),
                                "n_probes": len(rec["order_out"])}
    s0 = S.get(0)
    return {"explained": False, "n_probes": len(rec["order_out"]),
            "ancestor_sizes_of_leaf_0": sorted(set(s0.tolist())) if s0 is not None else []}


def _probe(rec, name):
    for p in rec["arith"]:
        if p["name"] == name:
            return p
    raise KeyError(name)


def analyze(rec: dict) -> dict:
    """Findings of one probe record: order, product exactness, subnormals, alignment width and
    rounding of the fused block and of the running-sum update."""
    order = fit_order(rec)
    res = {"format": rec["format"], "K": rec["K"], "shape": rec["shape"], **order,
           "columns_agree": rec["columns_agree"] and all(p["columns_agree"] for p in rec["arith"]),
           "unit_kept": rec["unit_alone"] == rec["unit"]}
    res["products_exact"] = _probe(rec, "product_exact")["output"] == _probe(rec, "product_exact")["exact"]
    if rec["format"] == "bf16":
        res["subnormal_products_kept"] = _probe(rec, "subnormal_product")["output"] == 2.0**-140
    for where in ("block", "acc"):
        t_max = 0
        for t in range(1, 29):
            if all(_probe(rec, f"{where}_bits_{sg}{t}")["output"] == _probe(rec, f"{where}_bits_{sg}{t}")["exact"]
                   for sg in "+-"):
                t_max = t
            else:
                break
        res[f"{where}_bits"] = t_max + 1  # bits of a term kept below and including the leading 2^0
        q3 = _probe(rec, f"round_{where}_quarter3_+")["output"]
        q3n = _probe(rec, f"round_{where}_quarter3_-")["output"]
        up = 1 + 2.0**-23
        mode = ("rn" if (q3, q3n) == (up, -up) else "rz" if (q3, q3n) == (1.0, -1.0) else
                "rd" if (q3, q3n) == (1.0, -up) else "ru" if (q3, q3n) == (up, -1.0) else "unexplained")
        if where == "block" and res["block_bits"] < 26 and mode == "rz":
            mode = "rz_or_cut_by_alignment"  # 1.5 * 2^-24 needs 26 bits to reach the rounding intact
        tie = _probe(rec, f"round_{where}_tie_odd_+")["output"]
        res[f"rounding_{where}"] = mode
        res[f"tie_{where}"] = ("even" if tie == 1 + 2.0**-22 else "down" if tie == 1 + 2.0**-23 else "unexplained")
    return res


def bound_factor(findings: dict) -> dict:
    """What the findings imply for the ``tensor_core_products`` charge of ``factored_norm_bound``.

    The bound charges ``2u`` (``u = 2^-24``) per addition, ``d`` additions per product.  Under
    the blocked model with ``w`` bits kept in a block (every term but the largest truncated at
    ``2^(1-w)`` of the largest) and a rounding ``r`` of each block sum (``RZ``: ``2u``, ``RN``:
    ``u``), a block of ``k`` products and the running sum errs by at most
    ``k 2^(1-w) max|term| + r |result|``; summed over the ``ceil(d/k)`` blocks (plus the
    final additions of the segments), with every running sum at most the sum of the
    magnitudes before it, a product is charged ``nb (k 2^(1-w) + r)`` relative to the
    magnitudes summed (the split-K segments' additions charged like blocks: ``ceil(log2 splits)`` of them
    for a pairwise reduction, ``splits - 1`` for a serial one).  ``factor`` is that over ``2u d``: at most 1 confirms the present charge
    for this accumulator (and below 1 says by how much it could be tightened); above 1 this
    analysis does not confirm it (the per-block charge is loose, charging every truncated term
    against the largest; a truncating adder without guard bits, ``k = 1, w = 24``, gives 2):
    then the charge needs a sharper argument or must grow.  A model-based statement: valid only
    if products are exact and the model explained every order probe."""
    ok = findings.get("explained") and findings.get("products_exact") and findings.get("columns_agree")
    if not ok:
        return {"valid": False, "reason": "order not explained by the blocked model, or products not exact, "
                                          "or columns disagree: keep the order-free charge and inspect the record"}
    k, d, n = findings["block_k"], findings["K"], findings["splits"]
    w = findings["block_bits"]
    r = 2.0**-24 if all(findings[f"rounding_{x}"] == "rn" for x in ("block", "acc")) else 2.0**-23
    seg = findings.get("segment_max", math.ceil(d / n))
    # the roundings on a product's way to the result: its segment's blocks, then the additions of the segments
    # (a tree: ceil(log2 n) of them; in order: n - 1, for a product of segment 0 or 1)
    adds = n - 1 if findings.get("reduction") == "serial" else math.ceil(math.log2(n))
    nb = math.ceil(seg / k) + adds
    per = nb * (k * 2.0 ** (1 - w) + r)
    return {"valid": True, "block_k": k, "align_bits": w, "block_rounding_u": r, "blocks_per_product": nb,
            "charge_per_product": per, "present_charge": 2 * 2.0**-24 * d, "factor": per / (2 * 2.0**-24 * d),
            "subnormal_products_kept": findings.get("subnormal_products_kept", True)}




def probe_positions(K: int) -> tuple[int, ...]:
    """The leaves ``i`` of the order probe at inner dimension ``K``: the first two, one past the first
    block of 16, the middle and the last (those inside ``[0, K)``)."""
    return tuple(sorted({p for p in (0, 1, 17, K // 2, K - 1) if 0 <= p < K}))


def charge_confirmed(findings: dict) -> str | None:
    """None where the findings of one probe (:func:`analyze`) confirm the ``2u``-per-addition charge of
    lemma 4 for that GEMM, else why not: the blocked model must explain every order probe with exact
    products and agreeing columns (:func:`bound_factor` valid), its charge be at most the present one
    (``factor <= 1``), and subnormal products be kept (bf16: the lemma charges each product ``eta``, not a
    flush to zero)."""
    b = bound_factor(findings)
    if not b["valid"]:
        return ("the blocked model does not explain the probe (order unexplained, products not exact or "
                "columns disagreeing)")
    if not b["factor"] <= 1:
        return (f"the measured accumulator implies {b['factor']:.3g} times the 2u-per-addition charge "
                f"(blocks of {b['block_k']}, {b['align_bits']} bits kept)")
    if findings.get("subnormal_products_kept") is False:
        return "subnormal products are flushed to zero (lemma 4 charges each product eta, not 2^-126)"
    return None


def subnormal_input_probe(mm, fmt: str, K: int = 16, shape=("U", 16, 16), device="cpu") -> dict:
    """Are 16-bit subnormal inputs kept by ``mm(a, b)`` (``a [M, K]``, ``b [K, N]`` a transposed view, the
    shape of one of the operator's GEMMs)?  ``a[0, 0]`` = three steps of the format's subnormal spacing,
    ``b[0, 0] = 2^8``, zeros elsewhere: the output is that exact (normal fp32) product if the input is kept,
    0 if it is flushed.  Assumption 3 of docs/bounds.md: lemma 4 has no term for a flushed input."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    _, m_rows, n_cols = shape
    tiny = torch.finfo(dt).smallest_normal / 2 ** (7 if fmt == "bf16" else 10) * 3  # 3 subnormal steps
    a = torch.zeros(m_rows, K, dtype=dt, device=device)
    bt = torch.zeros(n_cols, K, dtype=dt, device=device)
    a[0, 0], bt[0, 0] = tiny, 2.0**8
    out = float(mm(a, bt.T)[0, 0])
    exact = float(a[0, 0]) * 2.0**8
    return {"format": fmt, "input": float(a[0, 0]), "times": 2.0**8, "output": out, "exact": exact,
            "subnormal_inputs_kept": out == exact}


def model_record(model: TensorCoreModel, fmt: str, K: int, positions=None) -> dict:
    """A probe record of the CPU model (what the tests analyse)."""
    return run_probes(model.mm, fmt, K, shape=("U", 512, 2), positions=positions)


# --------------------------------------------------------------------------
# A card's probe records, packed: xz-compressed JSON
# --------------------------------------------------------------------------

def card_name(device_name: str) -> str:
    """``"h100"``, ``"h200"``, ... from a CUDA device name (the files of each card's own record)."""
    for card in ("h100", "h200", "b200", "a100"):
        if card in device_name.lower():
            return card
    return "".join(c for c in device_name.lower() if c.isalnum())[:16] or "gpu"


def pack_probe(records: list[dict], device: dict) -> bytes:
    """One card's probe records as xz-compressed JSON: each record's fields but the raw order outputs, and
    its ``S(i, .)`` rows stored as differences along ``j`` (they step by a block or a segment: a few KB)."""
    rows, meta = {}, []
    for rec in records:
        key = "|".join(str(x) for x in (rec["format"], *rec["shape"], rec["K"]))
        for i, row in lca_sizes(rec).items():
            rows[f"{key}|{i}"] = np.diff(row, prepend=0).tolist()
        meta.append({"key": key, **{k: v for k, v in rec.items() if k not in ("order_ij", "order_out")}})
    text = json.dumps({"device": device, "records": meta, "rows_diff": rows}, default=str, sort_keys=True)
    return lzma.compress(text.encode(), preset=9)


def unpack_probe(path) -> tuple[dict, list[dict]]:
    """``(device, records)`` from :func:`pack_probe`'s file, each record as :func:`run_probes` returned it
    (``order_ij``/``order_out`` rebuilt from the rows), ready for :func:`analyze`."""
    data = json.loads(lzma.decompress(Path(path).read_bytes()))
    by_key: dict[str, list[int]] = {}
    for name in data["rows_diff"]:
        key, i = name.rsplit("|", 1)
        by_key.setdefault(key, []).append(int(i))
    out = []
    for m in data["records"]:
        K, unit = m["K"], m["unit"]
        ij, y = [], []
        for i in sorted(by_key[m["key"]]):
            row = np.cumsum(np.asarray(data["rows_diff"][f"{m['key']}|{i}"], dtype=np.int64))
            j = np.delete(np.arange(K), i)
            ij.append(np.stack([np.full(K - 1, i), j], axis=1))
            y.append((K - row[j]) * unit)
        out.append({**m, "order_ij": np.concatenate(ij).tolist(), "order_out": np.concatenate(y).tolist()})
    return data["device"], out


__all__ = ["FORMATS", "ORDER_SCALE", "REDUCTIONS", "SEGMENT_TILES", "TensorCoreModel", "analyze", "arith_probes",
           "bound_factor", "card_name", "charge_confirmed", "fit_order", "lca_sizes", "model_lca_sizes", "model_record",
           "order_probes", "pack_probe", "probe_positions", "run_probes", "segments", "subnormal_input_probe",
           "unpack_probe"]
