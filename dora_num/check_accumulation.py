r"""The reviewer's kit's evidence for the tensor-core accumulator: is lemma 4's charge confirmed here?

Lemma 4 charges the fp32 accumulator of the factored norm's tensor-core products ``2u`` per addition in
any order (docs/bounds.md, section 0, assumption 3).  That is an assumption about the card and about the
GEMM kernel cuBLAS picks for a shape (its blocks, its split-K segments), so the kit (:mod:`dora_num.check`)
takes it as confirmed only for the GEMMs it has evidence for: a committed probe record of this card
(:func:`committed_records`: the same device name, torch and CUDA, the same format, product, ``M``,
``N``, ``K`` and row stride; cuBLAS chooses its kernel from all of them), else the probe run now, on the
card, at the layer's own GEMM shapes (:func:`dora_num.numerics.accumulation.run_probes`: a few hundred
small GEMMs of exact-by-construction inputs).  The charge is confirmed where every probe is explained by
the blocked model with a charge at most the present one and 16-bit subnormal inputs are kept
(:func:`~dora_num.numerics.accumulation.charge_confirmed`); elsewhere the rows that rest on it have no
finite bound, with the reason.  The CPU and the fp32 and float64 product routes run no tensor-core
product and need no probe.

:class:`CardProbes` is the seam: where the device description, the committed records, the probe and the
subnormal-input check come from (the tests inject a CPU model of an accumulator there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .numerics.accumulation import analyze, bound_factor, card_name, charge_confirmed, probe_positions, run_probes
from .numerics.accumulation import subnormal_input_probe as _subnormal_input_probe
from .ops.products import ProductModel, TensorCoreGemm, tensor_core_mm


def device_description(device) -> dict:
    """``{"name", "torch", "cuda"}`` of a CUDA ``device``: what a probe record's ``device`` holds (the card and
    the library versions that pick the GEMM kernels)."""
    return {"name": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda}


def committed_records(card: str) -> dict | None:
    """The committed probe of ``card`` (``"h100"``, ...) at the operator's shapes, as
    ``{"device", "records", "where"}``, or None where there is none.  The kit's one read of the recorded
    data: the per-card data set is declared with notebook 03's (``studies/bounds/datasets.py``) and looked up
    here when the kit runs.  The H200's two-shape probe of notebook 03 (``ACCUMULATION``) is not read (a
    record of two study shapes, its device described apart in that run's ``device.json``): on an H200 the
    kit probes."""
    from .numerics.accumulation import unpack_probe
    from .studies.bounds.datasets import operator_accumulation

    ds = operator_accumulation(card)
    path = ds.path("probe")
    if not path.is_file():
        return None
    device, records = unpack_probe(path)
    return {"device": device, "records": records, "where": f"data/{ds.file('probe')}"}


@dataclass(frozen=True)
class CardProbes:
    """Where the kit's evidence about the tensor-core accumulator comes from (each None: the default).

    ``device``: ``{"name", "torch", "cuda"}`` of the card (default :func:`device_description` of the
    operators' device); ``records(card)``: the committed probe of a card key (:func:`committed_records`),
    None where there is none; ``probe(gemm)``: a :func:`~dora_num.numerics.accumulation.run_probes` record
    of one :class:`~dora_num.ops.products.TensorCoreGemm` run now (default: through
    :func:`~dora_num.ops.products.tensor_core_mm` on the operators' device, at the GEMM's shape and
    strides); ``subnormal_inputs(gemm)``: whether that GEMM keeps 16-bit subnormal inputs (default: one
    product run now); ``products``: the product route the bounds charge in place of the operator's own
    (only ``ProductModel("tensor_core", None, fmt)``, for W and A of that one format: it charges at least
    what the CPU's and the fp32 route's GEMMs are charged, so the tests take the tensor-core route's
    accounting on a CPU)."""

    device: dict | None = None
    records: Callable[[str], dict | None] | None = None
    probe: Callable[[TensorCoreGemm], dict] | None = None
    subnormal_inputs: Callable[[TensorCoreGemm], bool] | None = None
    products: ProductModel | None = None


@dataclass(frozen=True)
class Evidence:
    """What the kit knows about the accumulator of one layer's products: ``confirmed`` (the ``2u`` charge
    holds for every tensor-core GEMM, or there is none), the header ``line``, and ``reason``: why the rows
    resting on it have no finite bound (None where confirmed)."""

    confirmed: bool
    line: str
    reason: str | None = None


def _probe_now(device) -> Callable[[TensorCoreGemm], dict]:
    def probe(g: TensorCoreGemm) -> dict:
        return run_probes(tensor_core_mm, g.fmt, g.K, shape=(g.product, g.M, g.N), device=device,
                          positions=probe_positions(g.K), lead=g.lead)
    return probe


def _subnormals_now(device) -> Callable[[TensorCoreGemm], bool]:
    def kept(g: TensorCoreGemm) -> bool:
        return _subnormal_input_probe(tensor_core_mm, g.fmt, g.K, shape=(g.product, g.M, g.N),
                                      device=device)["subnormal_inputs_kept"]
    return kept


def _same_gemm(rec: dict, g: TensorCoreGemm) -> bool:
    return (rec["format"] == g.fmt and list(rec["shape"]) == [g.product, g.M, g.N] and rec["K"] == g.K
            and rec.get("lead", rec["K"]) == g.lead)


def _same_device(recorded: dict, here: dict) -> bool:
    return all(str(recorded.get(k)) == str(here.get(k)) for k in ("name", "torch", "cuda"))


def accumulation_evidence(model: ProductModel, gemms: list[TensorCoreGemm], device, source: CardProbes | None = None,
                          cache: dict | None = None) -> Evidence:
    """The :class:`Evidence` for the tensor-core ``gemms`` of one layer (:func:`~dora_num.ops.products.
    tensor_core_gemms`) on ``device`` under product route ``model``; ``cache``: GEMM -> its verdict, shared
    by the layers of one check (a probe runs once per shape)."""
    if model.u not in ("tensor_core", "split"):
        return Evidence(True, f"accumulation: no tensor-core products ({model.u} route on "
                              f"{torch.device(device).type}): lemma 4 charges that route's own model, no accumulation "
                              "probe needed")
    source = source or CardProbes()
    here = source.device or device_description(device)
    card = here["name"]
    cache = {} if cache is None else cache
    if ("records", card) not in cache:  # read once per check
        cache[("records", card)] = (source.records or committed_records)(card_name(card))
    records = cache[("records", card)]
    if records is not None and not _same_device(records["device"], here):
        records = None  # another card, torch or CUDA: its kernels may differ
    probe = source.probe or _probe_now(device)
    subnormals = source.subnormal_inputs or _subnormals_now(device)
    by_record, by_probe, bad, factors = [], [], [], []
    for g in gemms:
        key = (card, g)
        if key not in cache:
            rec = next((r for r in (records or {}).get("records", []) if _same_gemm(r, g)), None)
            how = "record" if rec is not None else "probe"
            try:
                rec = rec if rec is not None else probe(g)
                findings = analyze(rec)
                why = charge_confirmed(findings)
                if why is None and not subnormals(g):
                    why = "16-bit subnormal inputs are flushed (lemma 4 has no term for a flushed input)"
            except (RuntimeError, ValueError, KeyError) as e:  # a probe that cannot run or be read confirms nothing
                msg = (str(e).splitlines() or [""])[0][:120]
                findings, why = {}, f"the probe did not run or could not be analysed ({type(e).__name__}: {msg})"
            factor = bound_factor(findings).get("factor") if findings else None
            cache[key] = (how, why, factor)
        how, why, factor = cache[key]
        (by_record if how == "record" else by_probe).append(g)
        if why is not None:
            bad.append(f"{g.label} ({'committed probe' if how == 'record' else 'probe run now'}): {why}")
        elif factor is not None:
            factors.append(factor)
    sources = []
    if by_record:
        sources.append(f"the committed probe of {card} ({records['where']}; torch {here['torch']}, CUDA "
                       f"{here['cuda']}) at {', '.join(g.label for g in by_record)}")
    if by_probe:
        sources.append(f"a probe run now on {card} at {', '.join(g.label for g in by_probe)}")
    if bad:
        return Evidence(False, f"accumulation: 2u per addition NOT confirmed on {card}: {'; '.join(bad)}; the rows "
                               "that rest on it (lemmas 4 and 4') have no finite bound",
                        f"accumulator not confirmed on {card} ({bad[0]})")
    return Evidence(True, f"accumulation: 2u per addition, confirmed by {' and by '.join(sources)} (measured charge "
                          f"at most {max(factors):.2g} of it)")


def charged_route(own: ProductModel, source: CardProbes | None, W: torch.Tensor, A: torch.Tensor) -> ProductModel:
    """The product route the kit's bounds charge: the operator's own, or ``source.products`` where the seam
    gives one (the tensor-core route, for W and A of its one 16-bit format, over a route it bounds)."""
    forced = source.products if source is not None else None
    if forced is None:
        return own
    fmt = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(W.dtype)
    if forced.u != "tensor_core" or forced.split_format != fmt or A.dtype != W.dtype or own.u not in ("fp32",
                                                                                                      "tensor_core"):
        raise ValueError(f"products={forced} charges the tensor-core route only for W and A of its one 16-bit format "
                         f"over the fp32 or tensor-core route (here W {W.dtype}, A {A.dtype}, route {own.u})")
    return forced


__all__ = ["CardProbes", "Evidence", "accumulation_evidence", "charged_route", "committed_records",
           "device_description"]
