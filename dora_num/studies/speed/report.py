"""Tables for notebook 05 (memory and speed) from the recorded GPU suite (``data/gpu/``).

Everything here reads measurements; nothing is re-measured.  Ratios are taken
within the one recorded run.  Memory theory for the row norms (bytes of the
temporaries each method allocates; verified against the allocator's peak):

The method in full: docs/methods.md, studies/speed/report.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ...ops.norm import ROW_CHUNK_BYTES, chunk_columns
from ...repro.paths import committed_data
from . import datasets as D
from .released import round_ratios

PAPER_TABLE1 = pd.DataFrame(  # docs/paper.md: H200, fp32, allocator peak, MB
    [(4096, 4096, 384, 192, 71), (8192, 8192, 384, 768, 245), (8192, 8192, 512, 768, 241),
     (8192, 28672, 384, 2688, 245)],
    columns=["d_out", "d_in", "rank", "paper_dense_MB", "paper_factored_MB"])

TARGET_SHAPES = ((8192, 8192), (16384, 8192))


# The data sets load_recorded reads: the suite's device.json and its sections, and the CUDA-graph timing
RECORDED = (D.SUITE, D.COMPOSE, D.NORM, D.LAYER, D.TRAIN_GRAPHS)


def load_recorded(folder: str | Path | None = None) -> dict:
    """The recorded suite (:data:`RECORDED`; a live run's ``folder`` may lack some sections):
    DataFrames ``compose``, ``norm``, ``layer``, ``train_graphs`` (empty where not recorded) and ``device``."""
    root = Path(folder) if folder is not None else committed_data(D.SUITE.folder)
    D.SUITE.subset("device").require(folder)
    out = {"device": json.loads(D.SUITE.path("device", root).read_text())}
    for key, p in (("compose", D.COMPOSE.path("bench", root)), ("norm", D.NORM.path("bench", root)),
                   ("layer", D.LAYER.path("bench", root)), ("train_graphs", D.TRAIN_GRAPHS.path("timing", root))):
        out[key] = pd.read_csv(p) if p.is_file() else pd.DataFrame()
    out["copy_gbps"] = float(out["device"]["copy"]["gbps"])
    return out


# --------------------------------------------------------------------------
# compose
# --------------------------------------------------------------------------

def bandwidth_table(compose: pd.DataFrame) -> pd.DataFrame:
    """Timed rows with their %-of-copy bandwidth (tidy: one row per op x impl x shape)."""
    cols = ["dtype", "tokens", "d_out", "op", "impl", "ms", "ms_p20", "ms_p80", "bytes", "gbps", "pct_copy",
            "check_ok", "bitwise", "err", "dg_rel_err"]
    t = compose[compose["ms"].notna()]
    return t[[c for c in cols if c in t.columns]].reset_index(drop=True)


def speedups(compose: pd.DataFrame) -> pd.DataFrame:
    """Per dtype x shape x op: fused time and its speedup over eager and torch.compile."""
    t = compose[compose["ms"].notna()]
    piv = t.pivot_table(index=["dtype", "tokens", "d_out", "op"], columns="impl", values="ms")
    rows = []
    for (dtype, tokens, d_out, op), r in piv.iterrows():
        fused = r.get("fused")
        if pd.isna(fused):
            continue
        eager = r.get("eager_autograd") if op in ("train", "bwd_autograd") else r.get("eager", r.get("eager_ref"))
        if op == "bwd":
            eager = r.get("eager_ref")
        rows.append({"dtype": dtype, "tokens": tokens, "d_out": d_out, "op": op, "fused_ms": fused,
                     "speedup_vs_eager": eager / fused if eager is not None and pd.notna(eager) else float("nan"),
                     "speedup_vs_compile": r.get("compile", float("nan")) / fused})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------
# norms
# --------------------------------------------------------------------------

def norm_memory_theory(method: str, d_out: int, d_in: int, r: int, w_bytes: int,
                       chunk_bytes: int | None = None, row_chunk_bytes: int = ROW_CHUNK_BYTES) -> int:
    """Bytes of the temporaries of one row-norm method (docs/methods.md)."""
    copy = 1 if w_bytes < 4 else 0
    if method == "peft_dense_wdtype":
        return 2 * d_out * d_in * w_bytes
    if method == "dense_fp32":
        return (2 + copy) * d_out * d_in * 4
    if method == "factored":  # the base_sq chunks, then the phase of the cached variant
        cols = chunk_columns(d_out, d_in, chunk_bytes)  # the operator's own rule (None: its default budget)
        return max((1 + copy) * d_out * cols * 4,
                   norm_memory_theory("factored_cached", d_out, d_in, r, w_bytes, chunk_bytes, row_chunk_bytes))
    if method == "factored_cached":
        return d_out * r * 4 + r * r * 4
    if method == "factored_cached_torch_tail":
        rows = min(d_out, max(1, row_chunk_bytes // (12 * r)))
        return d_out * r * 4 + r * r * 4 + (2 + copy) * rows * r * 4
    raise ValueError(f"unknown norm method {method!r}")


def norm_table(norm: pd.DataFrame) -> pd.DataFrame:
    """Measured peak and time per method, the theory, and ratios against the dense fp32 norm."""
    t = norm.copy()
    t["w_bytes"] = t["w_dtype"].map({"bfloat16": 2, "float16": 2, "float32": 4})
    t["theory_bytes"] = [norm_memory_theory(m, a, b, r, w) for m, a, b, r, w in
                         zip(t["method"], t["d_out"], t["d_in"], t["rank"], t["w_bytes"])]
    t["measured_MB"] = t["peak_extra_bytes"] / 1e6
    t["theory_MB"] = t["theory_bytes"] / 1e6
    dense = t[t["method"] == "dense_fp32"].set_index(["d_out", "d_in", "rank", "w_dtype"])
    key = list(zip(t["d_out"], t["d_in"], t["rank"], t["w_dtype"]))
    t["mem_vs_dense_fp32"] = [p / dense.loc[k, "peak_extra_bytes"] for p, k in zip(t["peak_extra_bytes"], key)]
    t["time_vs_dense_fp32"] = [m / dense.loc[k, "ms"] for m, k in zip(t["ms"], key)]
    return t.merge(PAPER_TABLE1, on=["d_out", "d_in", "rank"], how="left")


# --------------------------------------------------------------------------
# layer
# --------------------------------------------------------------------------

def layer_table(layer: pd.DataFrame) -> pd.DataFrame:
    """Time and peak memory of each implementation, and dora_num's ratios against each PEFT setting."""
    t = layer.copy()
    ours = t[t["impl"] == "dora_num"].set_index(["d_in", "d_out", "rank", "tokens", "mode"])
    key = list(zip(t["d_in"], t["d_out"], t["rank"], t["tokens"], t["mode"]))
    t["dora_num_speedup"] = [m / ours.loc[k, "ms"] for m, k in zip(t["ms"], key)]
    t["dora_num_mem_ratio"] = [ours.loc[k, "peak_extra_bytes"] / p for p, k in zip(t["peak_extra_bytes"], key)]
    return t


# --------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------

def _row(compose, dtype, tokens, d_out, op, impl):
    t = compose[(compose["dtype"] == dtype) & (compose["tokens"] == tokens) & (compose["d_out"] == d_out)
                & (compose["op"] == op) & (compose["impl"] == impl)]
    if len(t) != 1:
        raise KeyError(f"no single recorded row for {dtype} {tokens}x{d_out} {op}/{impl}")
    return t.iloc[0]


def target_row(target: str, shape: str, measured, threshold: float, floor, note: str = "", *,
               recorded: bool = True, per_round=None) -> dict:
    """One row of a targets table (notebook 05's, this module's and
    :func:`~dora_num.studies.speed.model_report.model_targets`): the verdict is ``met`` when
    ``measured >= threshold``, else ``out_of_reach`` where the floor (``best_possible``, the
    best value the same run allows; None: no floor) lies below the threshold, else ``missed``;
    ``not_recorded`` when ``recorded`` is false (``measured`` is then not compared).  ``per_round``:
    the measured ratio in each interleaved round where the record has them (``round_lo``, ``round_hi``:
    their range, NaN without), so a verdict from the median is read beside its spread."""
    lo = hi = float("nan")
    if per_round is not None and len(per_round):
        lo, hi = float(min(per_round)), float(max(per_round))
    if not recorded:
        verdict = "not_recorded"
    elif measured >= threshold:
        verdict = "met"
    elif floor is not None and floor < threshold:
        verdict = "out_of_reach"
    else:
        verdict = "missed"
    return {"target": target, "shape": shape, "measured": measured, "threshold": threshold,
            "best_possible": floor, "verdict": verdict, "note": note, "round_lo": lo, "round_hi": hi}


def target_status(data: dict) -> pd.DataFrame:
    """One row per (target, shape): measured value, threshold, the floor, verdict."""
    c = data["compose"]
    # The ceiling: the copy kernel's bandwidth, or the highest any measured path reached in the same run where
    # one passed it (torch.compile's forward reaches 100.5% of copy): no floor below rests on a ceiling that
    # a measured path exceeds.
    top = max(100.0, float(c["pct_copy"].max()))
    ceiling = data["copy_gbps"] * top / 100
    on = f"the ceiling {top:.4g}% of copy ({'a measured path' if top > 100 else 'the copy kernel'})"
    rows = []

    def add(target, shape, measured, threshold, floor, note="", per_round=None):
        rows.append(target_row(target, shape, measured, threshold, floor, note, per_round=per_round))

    for tokens, d_out in TARGET_SHAPES:
        shape = f"{tokens}x{d_out} bf16"
        fwd = _row(c, "bfloat16", tokens, d_out, "fwd", "fused")
        cmp_ = _row(c, "bfloat16", tokens, d_out, "fwd", "compile")
        add("fwd_pct_copy", shape, fwd["pct_copy"], 90.0, top)
        add("fwd_speedup_vs_compile", shape, cmp_["ms"] / fwd["ms"], 1.6, top / cmp_["pct_copy"],
            f"torch.compile already moves its bytes at {cmp_['pct_copy']:.1f}% of the copy bandwidth; floor at {on}")
        bwd = _row(c, "bfloat16", tokens, d_out, "bwd", "fused")
        add("bwd_pct_copy", shape, bwd["pct_copy"], 80.0, top, "dlora, dbase, dg; saved fp32 inner")
        eag = _row(c, "bfloat16", tokens, d_out, "bwd_autograd", "eager_autograd")
        add("bwd_speedup_vs_eager_autograd", shape, eag["ms"] / bwd["ms"], 6.0,
            eag["ms"] / (bwd["bytes"] / (ceiling * 1e9) * 1e3),
            f"eager autograd's backward alone (retain_graph); floor at {on}")
        tr = _row(c, "bfloat16", tokens, d_out, "train", "fused")
        trc = _row(c, "bfloat16", tokens, d_out, "train", "compile")
        floor_ms = tr["bytes"] / (ceiling * 1e9) * 1e3
        dev = train_device_times(data.get("train_graphs"), tokens, d_out)
        if dev is not None:
            # the target on the device: both steps replayed from CUDA graphs (no host in the timing)
            add("train_speedup_vs_compile", shape, dev["compile_ms"] / dev["fused_ms"], 1.5,
                dev["compile_ms"] / dev["floor_ms"],
                f"device time (CUDA graphs): fused {dev['fused_ms']:.4f} ms, compile {dev['compile_ms']:.4f} ms, "
                f"floor {dev['floor_ms']:.4f} ms = 8b per element (16 B in bf16) at the copy bandwidth: compile runs at "
                f"{100 * dev['floor_ms'] / dev['compile_ms']:.0f}% of it")
        add("train_step_speedup_vs_compile" if dev is not None else "train_speedup_vs_compile", shape,
            trc["ms"] / tr["ms"], 1.5, trc["ms"] / floor_ms,
            f"one step at a time through autograd (do_bench); floor {floor_ms:.3f} ms at {on}; fused at "
            f"{100 * floor_ms / tr['ms']:.0f}% of it" + ("; host-bound below ~16384x8192: the ratio compares the two "
                                               "host paths" if dev is not None else ""))
    n = data["norm"]
    sel = n[(n["d_out"] == 8192) & (n["d_in"] == 8192) & (n["rank"] == 384) & (n["w_dtype"] == "bfloat16")]
    cached = sel[sel["method"] == "factored_cached"].iloc[0]
    dense = sel[sel["method"] == "dense_fp32"].iloc[0]
    add("norm_mem_fraction_inverse", "8192x8192 r=384 bf16", dense["peak_extra_bytes"] / cached["peak_extra_bytes"],
        15.0, None, "dense fp32 peak / factored-cached peak")
    add("norm_time_ratio_inverse", "8192x8192 r=384 bf16", dense["ms"] / cached["ms"], 1.0, None,
        "dense fp32 time / factored-cached time")
    lay = layer_table(data["layer"])
    ours = data["layer"][(data["layer"]["impl"] == "dora_num") & (data["layer"]["mode"] == "fwd_bwd")]
    ours = ours.set_index(["d_in", "d_out", "rank", "tokens"])["rounds_ms"]
    for _, r in lay[(lay["impl"] == "peft_default") & (lay["mode"] == "fwd_bwd")].iterrows():
        shape = f"{r['d_in']}->{r['d_out']} r={r['rank']} T={r['tokens']}"
        key = (r["d_in"], r["d_out"], r["rank"], r["tokens"])
        add("layer_fwd_bwd_speedup_vs_peft", shape, r["dora_num_speedup"], 2.0, None,
            per_round=round_ratios(r["rounds_ms"], ours.loc[key]))
        add("layer_peak_memory_lower_than_peft", shape, 1.0 / r["dora_num_mem_ratio"], 1.0 + 1e-12, None,
            "PEFT peak / dora_num peak (forward+backward)")
    return pd.DataFrame(rows)


def load_session(ds=D.SPEED_REPEAT, folder: str | Path | None = None) -> dict:
    """One more session's record (a :func:`~.datasets.suite_session`: the suite's timed sections compose, norm
    and layer, run again in another machine session; by default :data:`~.datasets.SPEED_REPEAT`) in
    :func:`load_recorded`'s form."""
    ds.require(folder)
    return load_recorded(ds.paths(folder)[0].parent)


def targets_over_sessions(first: dict, repeat: dict) -> pd.DataFrame:
    """Per target and shape, :func:`target_status` in each session (``_1``: ``first``, ``_2``: ``repeat``),
    the range of the measured values over both, and ``over_sessions``: the verdict where both sessions give
    the same one, else ``"split"``.  The CUDA-graph timing (``train_graphs``) belongs to the first session
    only, so both sides compare the training step as :func:`target_status` times it without graphs."""
    a = target_status({**first, "train_graphs": pd.DataFrame()})
    b = target_status({**repeat, "train_graphs": pd.DataFrame()})
    m = a.merge(b, on=["target", "shape", "threshold"], suffixes=("_1", "_2"), how="outer", validate="1:1")
    if m[["verdict_1", "verdict_2"]].isna().any().any():
        raise ValueError("the two sessions do not hold the same targets: "
                         f"{m[m.verdict_1.isna() | m.verdict_2.isna()][['target', 'shape']].values.tolist()}")
    m["lo"] = m[["measured_1", "measured_2"]].min(axis=1)
    m["hi"] = m[["measured_1", "measured_2"]].max(axis=1)
    m["over_sessions"] = m.verdict_1.where(m.verdict_1 == m.verdict_2, "split")
    return m[["target", "shape", "threshold", "measured_1", "measured_2", "lo", "hi", "verdict_1", "verdict_2",
              "over_sessions", "best_possible_1", "best_possible_2"]]


def layer_over_sessions(first: dict, repeat: dict) -> pd.DataFrame:
    """The layer against PEFT (forward+backward), one row per session, shape and PEFT setting: the median
    ratio (PEFT's time over ours) and its range over that session's rounds (round i of PEFT over round i of
    ours: the rounds interleave them)."""
    out = []
    for k, data in ((1, first), (2, repeat)):
        t = layer_table(data["layer"])
        t = t[(t["mode"] == "fwd_bwd") & (t["impl"] != "dora_num")]
        ours = data["layer"][(data["layer"]["impl"] == "dora_num") & (data["layer"]["mode"] == "fwd_bwd")]
        ours = ours.set_index(["d_in", "d_out", "rank", "tokens"])["rounds_ms"]
        for _, r in t.iterrows():
            key = (r["d_in"], r["d_out"], r["rank"], r["tokens"])
            ratios = round_ratios(r["rounds_ms"], ours.loc[key])
            out.append({"session": k, "impl": r["impl"], "d_in": key[0], "d_out": key[1], "rank": key[2],
                        "tokens": key[3], "ratio": r["dora_num_speedup"], "round_lo": min(ratios),
                        "round_hi": max(ratios), "rounds": len(ratios)})
    return pd.DataFrame(out)


def train_device_times(tg: pd.DataFrame | None, tokens: int, d_out: int) -> dict | None:
    """Median CUDA-graph replay time of the fused and the compiled training step at
    one shape (over the interleaved rounds of ``train_graphs.csv``), and the floor;
    None when not recorded or when a graph failed its check."""
    if tg is None or not len(tg):
        return None
    sel = tg[(tg["tokens"] == tokens) & (tg["d_out"] == d_out) & (tg["mode"] == "cuda_graph")]
    if set(sel["impl"]) != {"fused", "compile"} or not (sel["check_ok"] & sel["graph_bitwise_eager"]).all():
        return None
    med = sel.groupby("impl")["ms"].median()
    return {"fused_ms": float(med["fused"]), "compile_ms": float(med["compile"]),
            "floor_ms": float(sel["floor_ms"].iloc[0])}


def train_timing_table(tg: pd.DataFrame) -> pd.DataFrame:
    """``train_graphs.csv`` per shape, implementation and timing mode: median ms over the
    rounds, its spread, and % of the bandwidth floor."""
    g = tg.groupby(["tokens", "d_out", "mode", "impl"])
    t = g["ms"].agg(["median", "min", "max"]).join(g["floor_ms"].first())
    t["pct_floor"] = 100 * t["floor_ms"] / t["median"]
    return t.reset_index()
