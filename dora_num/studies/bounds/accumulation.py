r"""How the tensor-core products of the factored norm add up, as the cards recorded it: order, width, rounding.

The factored norm forms ``U = W A^T`` and ``G = A A^T`` from 16-bit ``W``, ``A`` on CUDA with
``torch.mm(a, b, out_dtype=torch.float32)`` (:func:`dora_num.ops.products._u_product` makes that
call, with ``b`` a transposed view), and its bound
(:func:`~dora_num.numerics.bounds.factored_norm_bound`, ``tensor_core_products=True``) charges
``2u`` per addition, ``d`` additions per product: ``gamma_{2d}``, valid whatever the order,
for an accumulator that truncates.  The probes, the blocked model and the analysis are card-independent
(:mod:`dora_num.numerics.accumulation`, re-exported here); this module reads what the cards recorded:
the H200's probe at two shapes (:func:`load_record`) and each card's probe at the operator's shapes
(:func:`load_operator_probe`), and tabulates the findings for notebook 03.

The method in full: docs/methods.md, studies/bounds/accumulation.py.
"""

from __future__ import annotations

import json
import lzma

from ...numerics.accumulation import (FORMATS, ORDER_SCALE, REDUCTIONS, SEGMENT_TILES, TensorCoreModel,  # noqa: F401
                                      analyze, arith_probes, bound_factor, card_name, charge_confirmed, fit_order,
                                      lca_sizes, model_lca_sizes, model_record, order_probes, pack_probe,
                                      probe_positions, run_probes, segments, subnormal_input_probe, unpack_probe)
from .datasets import ACCUMULATION

# --------------------------------------------------------------------------
# The H200's probe at two shapes (dora-num record exhaustive --only accumulation)
# --------------------------------------------------------------------------

SHAPES = (("U", 4096, 384), ("G", 384, 384))  # (product, M rows per call, N) as in the factored norm
K_VALUES = (384, 4096)
PROBE_FILE = ACCUMULATION.filename("probe")  # xz: the raw outputs are 2.3 MB of JSON, a few KB compressed


def load_record(folder=None) -> list[dict]:
    """The recorded probe (``data/gpu/exhaustive/``, or in ``folder``);
    :class:`~dora_num.repro.recording.RecordedDataMissing` saying how to record it."""
    path = ACCUMULATION.subset("probe").require(folder)[0]
    return json.loads(lzma.decompress(path.read_bytes()))


def findings_table(records: list[dict]):
    """One row per recorded (format, product, K): the findings of :func:`analyze` and
    :func:`bound_factor`, recomputed from the raw probe outputs."""
    import pandas as pd

    rows = []
    for rec in records:
        f = analyze(rec)
        b = bound_factor(f)
        rows.append({"format": f["format"], "product": f["shape"][0], "K": f["K"],
                     **{k: f.get(k) for k in ("explained", "block_k", "splits", "segment_tile", "reduction",
                                              "products_exact",
                                              "subnormal_products_kept", "unit_kept", "block_bits", "acc_bits",
                                              "rounding_block", "rounding_acc", "tie_block", "tie_acc",
                                              "columns_agree")},
                     "bound_valid": b["valid"], "charge_factor": b.get("factor")})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------
# Each card's probe at the operator's shapes (dora-num record products --only accumulation)
# --------------------------------------------------------------------------

def load_operator_probe(card: str, folder=None) -> tuple[dict, list[dict]]:
    """One card's recorded probe at the operator's shapes (``data/gpu/products/``), or
    :class:`~dora_num.repro.recording.RecordedDataMissing` saying how to record it."""
    from .datasets import operator_accumulation

    ds = operator_accumulation(card)
    ds.require(folder)
    return unpack_probe(ds.path("probe", folder))
