r"""``dora-num record model --out DIR [--smoke]`` (also ``dora-num gpu-suite --only model``): the model level
of notebook 05, PEFT's DoRA against the same adapter on this project's operator.

The decoder of :mod:`.model_variants` (8B layer shapes, 4 layers, 4096 tokens, bf16 weights and
autocast, DoRA on all 7 projections, ``r`` in {16, 64, 384}, ``alpha = 2r``, with and without
gradient checkpointing), each variant timed by CUDA events, ``REPS`` steps per round after a
warm-up, the variants interleaved within each round, ``ROUNDS`` rounds (each row: the median over
rounds of the per-round median, and every round), with its peak extra memory; modes ``train``,
``train_opt`` (+ AdamW), ``infer`` (the norm reused), ``infer_cold``.  Beside the timings: the
fidelity of :mod:`.model_agreement`, the public compose's probe and the predicted times
(:func:`.model_variants.predict`).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ...repro.recording import MACHINE_FILE, parser as recorder_parser
from .datasets import MODEL, MODEL_MATRIX
from .model_agreement import agreement, full_size_agreement
from .model_variants import (FULL, MODES, RANKS, SEED, SMOKE, SMOKE_RANKS, VARIANTS, Runner, Shape, _bump, _hf,
                             adapter_state, build_base, make_variant, predict, set_checkpointing)


ROUNDS, REPS = 5, 3
SMOKE_ROUNDS, SMOKE_REPS = 2, 2
# torch.compile of the PEFT-default variants (fp32 adapters): what a PEFT user who compiles runs (the matrix)
COMPILE_MODES = ("default", "reduce-overhead")
COMPILED_VARIANTS = ("lora_fp32", "peft_fp32", "dora_num_fp32")


def _log(msg: str) -> None:
    print(f"[model-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Steps and timing
# --------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def token_ids(shape: Shape, r: int, device: str) -> torch.Tensor:
    """The one sequence of ``shape.tokens`` token ids every variant at rank ``r`` runs on (seeded by ``r``)."""
    gen = torch.Generator(device="cpu").manual_seed(SEED + r)
    return torch.randint(0, shape.vocab, (1, shape.tokens), generator=gen).to(device)


def time_steps(fn, reps: int, device: str) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` (CUDA events; wall clock on the CPU)."""
    out = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def peak_extra(fn, device: str) -> float:
    """Allocator peak above what was allocated before ``fn()`` (bytes; NaN on the CPU, where
    ``fn`` is not run)."""
    if device != "cuda":  # no allocator statistics: not measured (and not run)
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - before)


def interleaved(runners: dict, modes, rounds: int, reps: int, device: str) -> dict:
    """``{(variant, mode): [per-round median ms]}``: ``rounds`` rounds, each every runner's every mode in
    turn (so a drift of the machine reaches every variant alike), ``reps`` timed calls each."""
    times = {(v, m): [] for v in runners for m in modes}
    for _ in range(rounds):
        for v, run in runners.items():
            for mode in modes:
                times[v, mode].append(statistics.median(time_steps(getattr(run, mode), reps, device)))
    return times


def timing_row(shape: Shape, variant: str, r: int, ckpt: bool, mode: str, per_round: list, reps: int,
               peak: float, device: str) -> dict:
    """One row of ``model_bench.csv``: the median over rounds, the spread and every round."""
    return {"variant": variant, "rank": r, "checkpointing": ckpt, "mode": mode, "ms": statistics.median(per_round),
            "ms_min_round": min(per_round), "ms_max_round": max(per_round),
            "rounds_ms": ";".join(f"{t:.4f}" for t in per_round), "reps_per_round": reps, "peak_extra_bytes": peak,
            "tokens": shape.tokens, "layers": shape.layers, "hidden": shape.hidden,
            "intermediate": shape.intermediate, "device": device}


def bench_rank(shape: Shape, r: int, device: str, *, rounds: int, reps: int, variants=VARIANTS,
               checkpointing=(False, True), base=None) -> tuple[list[dict], list[dict]]:
    """Every variant x checkpointing x mode at rank ``r``, interleaved rounds: ``(timing rows,
    full-size agreement rows)``."""
    base = build_base(shape, device) if base is None else base
    state = adapter_state(base, r)
    ids = token_ids(shape, r, device)
    runners = {v: Runner(make_variant(v, base, r, state), ids, device) for v in variants}
    rows = []
    for ckpt in checkpointing:
        for run in runners.values():
            set_checkpointing(run.model, ckpt)
        modes = MODES if not ckpt else ("train", "train_opt")  # inference does not checkpoint
        peaks = {}
        for v, run in runners.items():  # warm-up (Triton compiles, caches) and peaks
            for mode in modes:
                getattr(run, mode)()
                _sync(device)
                for p in run.params:  # the peak then counts this step's gradients in full
                    p.grad = None
                peaks[v, mode] = peak_extra(getattr(run, mode), device)
        times = interleaved(runners, modes, rounds, reps, device)
        for (v, mode), per_round in times.items():
            rows.append(timing_row(shape, v, r, ckpt, mode, per_round, reps, peaks[v, mode], device))
        _log(f"r={r} checkpointing={ckpt}: " + ", ".join(
            f"{v} {statistics.median(times[v, 'train']):.1f} ms" for v in runners))
    full_fid = full_size_agreement(runners, device, r)
    del runners, state
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows, full_fid


class CompiledRunner:
    """``train`` (forward + backward) and ``infer`` (no KV cache: a cache would be new state, and a
    recompile, in every layer) of ``torch.compile(model, mode=...)``, or with
    ``regional`` of the model with each decoder layer compiled (``layer.compile(mode=...)``), or with
    ``mode="eager"`` of the model itself (the same steps, uncompiled).  Under ``reduce-overhead`` every
    step starts with ``cudagraph_mark_step_begin`` (the previous step's outputs may be overwritten: a
    training loop's contract with CUDA graphs)."""

    def __init__(self, model, ids, device: str, mode: str, backend: str = "inductor", regional: bool = False):
        self.ids, self.device, self.mode = ids, device, mode
        self.params = [p for p in model.parameters() if p.requires_grad]
        cmode = None if mode == "default" else mode
        if mode == "eager":
            self.model = model
        elif regional:  # one graph for the stack of identical layers (dynamo reuses it for each)
            for layer in _hf(model).model.layers:
                layer.compile(mode=cmode, backend=backend)
            self.model = model
        else:
            self.model = torch.compile(model, mode=cmode, backend=backend)

    def _step_begin(self):
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()

    def train(self):
        self._step_begin()
        for p in self.params:
            p.grad = None
        with torch.autocast(self.device, dtype=torch.bfloat16):
            loss = self.model(input_ids=self.ids, labels=self.ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    def infer(self):
        self._step_begin()
        with torch.no_grad(), torch.autocast(self.device, dtype=torch.bfloat16):
            return self.model(input_ids=self.ids, use_cache=False).logits.clone()


def warm_up(run: "CompiledRunner", phase: str, device: str) -> tuple[float, float]:
    """``(seconds, peak)``: three calls of ``run``'s ``phase`` (trace, compile, record the CUDA graphs,
    replay), timed together, then the peak extra memory of one more call (:func:`peak_extra`)."""
    t = time.time()
    for _ in range(3):
        getattr(run, phase)()
    _sync(device)
    return time.time() - t, peak_extra(getattr(run, phase), device)


# --------------------------------------------------------------------------
# The matrix: every variant in every mode, one run per rank
# --------------------------------------------------------------------------

MATRIX_MODES = ("eager", *COMPILE_MODES)
# the matrix in two device calls (each under the device's 10-minute limit): the compiles dominate, and
# r = 384 takes about as long as 16 and 64 together (its products and steps are the largest)
MATRIX_PARTS = {1: (16, 64), 2: (384,)}
MATRIX_ROUNDS = 3


def bench_matrix(shape: Shape, r: int, device: str, *, rounds: int, reps: int, base, state,
                 modes=MATRIX_MODES, variants=COMPILED_VARIANTS, checkpointing=(False, True),
                 backend: str = "inductor", regional: bool = True, progress=_log) -> list[dict]:
    """Rows of :func:`bench_rank`'s schema (``compile``: the mode, ``"eager"`` included; ``regional``;
    ``compile_s``: the warm-up's three calls) for every variant in every mode at rank ``r``: ``train``
    and ``infer`` (a ``no_grad`` forward that forms the norm, as PEFT's does), and ``train`` with
    gradient checkpointing (not under ``reduce-overhead``: :func:`ckpt_graphs_probe`); within one
    checkpointing setting every (variant, mode) is interleaved in the same rounds, so the eager and the
    compiled step of one variant share the machine's drift.

    ``regional`` (default): each decoder layer compiled (:class:`CompiledRunner`), the embeddings, the
    final norm, the LM head and the loss eager in every variant alike (DoRA's cost over LoRA, a
    difference within one mode, does not see them); dynamo compiles the four identical layers once,
    where the whole model compiled took about 35 s per compile (45 compiled cells in the matrix)."""
    from ...ops.layer import check_flags
    from ..bench import lift_recompile_limits

    lift_recompile_limits()
    ids = token_ids(shape, r, device)
    rows = []
    for ckpt in checkpointing:
        phases = ("train",) if ckpt else ("train", "infer")
        runners, compile_s, peaks = {}, {}, {}
        for v in variants:
            for mode in (m for m in modes if not (ckpt and m == "reduce-overhead")):  # see ckpt_graphs_probe
                model = make_variant(v, base, r, state)
                set_checkpointing(model, ckpt)
                run = runners[v, mode] = CompiledRunner(model, ids, device, mode, backend, regional=regional)
                for ph in phases:
                    compile_s[v, mode, ph], peaks[v, mode, ph] = warm_up(run, ph, device)
                if v.startswith("dora_num"):
                    check_flags(model)  # every flag the warm-up raised: read once, here
                progress(f"r={r} checkpointing={ckpt} {v} {mode}: warm in "
                         f"{sum(compile_s[v, mode, ph] for ph in phases):.0f} s")
        times = interleaved(runners, phases, rounds, reps, device)  # keys ((variant, mode), phase)
        for (v, mode), run in runners.items():
            if v.startswith("dora_num"):
                check_flags(run.model)  # and every flag the timed steps raised
        for ((v, mode), ph), per_round in times.items():
            rows.append(dict(timing_row(shape, v, r, ckpt, ph, per_round, reps, peaks[v, mode, ph], device),
                             compile=mode, compile_s=compile_s[v, mode, ph], regional=regional))
        progress(f"r={r} checkpointing={ckpt}: train ms " + ", ".join(
            f"{v}/{mode} {statistics.median(times[(v, mode), 'train']):.1f}" for v, mode in runners))
        del runners
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def ckpt_graphs_probe(shape: Shape, r: int, device: str, *, base, state, backend: str = "inductor",
                      regional: bool = True) -> dict:
    """Whether a checkpointed training step runs under ``reduce-overhead`` (CUDA graphs): plain LoRA's,
    three calls, last of all in the run (a failed capture can leave the process's CUDA-graph state
    unusable).  The matrix leaves this cell out: in its first run (an H100, the GPU image's torch 2.11) the capture of
    plain LoRA's checkpointed layers failed with "graph recording observed an input tensor deallocate
    during graph recording", before any DoRA variant ran.  The row says what happens now."""
    ids = token_ids(shape, r, device)
    model = make_variant("lora_fp32", base, r, state)
    set_checkpointing(model, True)
    row = {"variant": "lora_fp32", "rank": r, "checkpointing": True, "mode": "train", "compile": "reduce-overhead",
           "regional": regional, "device": device}
    try:
        run = CompiledRunner(model, ids, device, "reduce-overhead", backend, regional=regional)
        for _ in range(3):
            run.train()
        _sync(device)
        row["error"] = ""
    except Exception as e:  # noqa: BLE001  (the failure is the measurement)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    _log(f"checkpointing under reduce-overhead: {row['error'] or 'ran'}")
    return row


def run_matrix(out: Path, part: int, *, device: str | None = None, shape: Shape | None = None, ranks=None,
               rounds: int | None = None, reps: int | None = None, modes=MATRIX_MODES,
               backend: str = "inductor", regional: bool = True) -> dict:
    """Part ``part`` of the model matrix (:data:`MATRIX_PARTS`: its ranks; ``ranks``, ``shape``,
    ``rounds``, ``reps``, ``modes``, ``backend`` override for tests): :func:`bench_matrix` and the g
    error of each path (:func:`g_error_rows`) per rank, into ``matrix_bench.csv`` and
    ``matrix_g_error.csv`` under ``out`` (written after each rank: a call cut short keeps what it
    finished)."""
    import pandas as pd

    if part not in MATRIX_PARTS:
        raise SystemExit(f"dora-num record model: --matrix must be one of {sorted(MATRIX_PARTS)}, got {part}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    shape = shape or FULL
    ranks = tuple(ranks or MATRIX_PARTS[part])
    rounds, reps = rounds or MATRIX_ROUNDS, reps or REPS
    ds = MODEL_MATRIX[part - 1]
    t0 = time.time()
    base = build_base(shape, device)
    rows, g_rows = [], []
    for r in ranks:
        state = adapter_state(base, r)
        rows += bench_matrix(shape, r, device, rounds=rounds, reps=reps, base=base, state=state, modes=modes,
                             backend=backend, regional=regional)
        g_rows += g_error_rows(base, r, state, device, backend=backend)
        del state
        pd.DataFrame(rows).to_csv(ds.path("bench", out), index=False, lineterminator="\n")
        pd.DataFrame(g_rows).to_csv(ds.path("g_error", out), index=False, lineterminator="\n")
    if "reduce-overhead" in modes:
        state = adapter_state(base, ranks[0])
        rows.append(ckpt_graphs_probe(shape, ranks[0], device, base=base, state=state, backend=backend,
                                      regional=regional))
        pd.DataFrame(rows).to_csv(ds.path("bench", out), index=False, lineterminator="\n")
    summary = {"part": part, "shape": asdict(shape), "ranks": list(ranks), "rounds": rounds, "reps": reps,
               "device": device, "modes": list(modes), "regional": regional, "wall_s": time.time() - t0}
    _log(f"matrix part {part} done in {summary['wall_s']:.0f} s")
    return summary


# --------------------------------------------------------------------------
# Fidelity
# --------------------------------------------------------------------------


def g_error_rows(base, r: int, state: dict, device: str, *, backend: str = "inductor") -> list[dict]:
    """The error of ``g`` each path pays, per projection of the first layer: PEFT's DoRA layer
    (its own ``get_weight_norm`` on its ``W + s lora_B(lora_A(I))``, under bf16 autocast as in training)
    eager and compiled, and this operator's (``weight_den``) eager and compiled, against ``m / ||W +
    sBA||`` in float64 from the same fp32 adapter: ``max |g - g64| / |g64|`` and the same over
    ``max |g64 - 1|`` (the error against the signal ``g - 1`` the compose scales)."""
    from ...ops.weight_norm import magnitude_scale_and_flag
    from ...oracles import row_norm_ref64

    def layer_g(W, A, B, s, m):  # the layer's own g, eager or compiled (there: weight_den and its division op)
        return magnitude_scale_and_flag(W, A, B, s, m)[0]

    pm = make_variant("peft_fp32", base, r, state)
    rows = []
    layer0 = pm.get_base_model().model.layers[0]
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj"):
        mod = layer0.get_submodule(name)
        W = mod.get_base_layer().weight.detach()
        A, B = mod.lora_A["default"].weight.detach(), mod.lora_B["default"].weight.detach()
        dora, s = mod.lora_magnitude_vector["default"], mod.scaling["default"]
        m = dora.weight.detach()
        g64 = m.double() / row_norm_ref64(W, A, B, s)

        def peft_g():
            x_eye = torch.eye(A.shape[1], device=A.device, dtype=A.dtype)  # PEFT's DoRA forward, up to g
            lora_weight = mod.lora_B["default"](mod.lora_A["default"](x_eye)).T
            wn = dora.get_weight_norm(W.to(A.dtype), lora_weight.detach(), s).detach()
            return m / wn

        paths = {"peft_eager": peft_g, "peft_compiled": torch.compile(peft_g, backend=backend),
                 "dora_num_eager": lambda: layer_g(W, A, B, s, m),
                 "dora_num_compiled": torch.compile(lambda: layer_g(W, A, B, s, m), backend=backend)}
        for path, fn in paths.items():
            with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
                g = fn().double()
            err = (g - g64).abs().max() / g64.abs().max()
            rows.append({"probe": "g_error", "what": path, "shape": f"{name} {W.shape[1]}->{W.shape[0]} r={r}",
                         "value": float(err), "unit": "max rel",
                         "rel_to_gm1": float((g - g64).abs().max() / (g64 - 1).abs().max())})
    del pm
    return rows


# --------------------------------------------------------------------------
# Host cost and the public compose (probe)
# --------------------------------------------------------------------------

def probe(device: str, *, smoke: bool, copy_gbps: float | None) -> list[dict]:
    """Host cost of one ``DoRALinear`` forward+backward (4096->4096, r=384, 4096 tokens, bf16, fp32
    adapters), against a plain ``nn.Linear`` with LoRA (the floor of any adapter layer's host
    path), and the public ``dn.compose`` fused forward at 8192x8192 bf16 against its kernel and
    the copy bandwidth.  Host cost: CPU time of the Python call per step with the device kept
    busy ahead (no wait inside the timed loop), median of interleaved rounds."""
    import dora_num as dn

    from ...ops.finite import check_pending
    from ..bench import compose_bytes

    rows = []
    d, r, T = (256, 16, 256) if smoke else (4096, 384, 4096)
    torch.manual_seed(SEED + 3)
    lin = torch.nn.Linear(d, d, bias=False, device=device, dtype=torch.bfloat16)
    layer = dn.DoRALinear(copy.deepcopy(lin), r, 2.0 * r)
    layer.lora_A = torch.nn.Parameter(layer.lora_A.detach().float())
    layer.lora_B = torch.nn.Parameter(1e-3 * torch.randn(d, r, device=device))
    layer.magnitude = torch.nn.Parameter(layer.magnitude.detach().float())
    lora_A = torch.nn.Parameter(layer.lora_A.detach().clone())
    lora_B = torch.nn.Parameter(layer.lora_B.detach().clone())
    x = torch.randn(T, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    D = torch.randn(T, d, device=device, dtype=torch.bfloat16)
    params = [layer.lora_A, layer.lora_B, layer.magnitude]

    def dora_step():
        _bump(params)
        with torch.autocast(device, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(D)

    def lora_step():
        with torch.autocast(device, dtype=torch.bfloat16):
            y = lin(x) + 2.0 * torch.nn.functional.linear(torch.nn.functional.linear(x, lora_A), lora_B)
        y.backward(D)

    def host_us(fn, n):
        _sync(device)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n * 1e6
        _sync(device)
        return host

    for fn in (dora_step, lora_step):
        fn()
    _sync(device)
    n = 3 if smoke else 10
    res = {"dora_linear_fwd_bwd": [], "lora_linear_fwd_bwd": []}
    for _ in range(2 if smoke else 5):
        res["dora_linear_fwd_bwd"].append(host_us(dora_step, n))
        res["lora_linear_fwd_bwd"].append(host_us(lora_step, n))
    check_pending()
    for name, vals in res.items():
        rows.append({"probe": "host_us", "what": name, "shape": f"{d}x{d} r={r} T={T}", "value": statistics.median(vals),
                     "rounds": ";".join(f"{v:.1f}" for v in vals), "unit": "us"})
    if device == "cuda":
        from ..bench import time_ms
        from ...ops.kernels import compose as kc

        n_rows = n_cols = 1024 if smoke else 8192
        base = torch.randn(n_rows, n_cols, device=device).bfloat16()
        lora = torch.randn_like(base)
        g = 1 + 1e-3 * torch.randn(n_cols, device=device)
        nbytes = compose_bytes("fwd", base.numel(), 2, n_cols)
        for what, fn in (("public_compose_fused_fwd", lambda: dn.compose(base, lora, g, 0.5, path="fused")),
                         ("kernel_compose_fwd", lambda: kc.compose_fwd(base, lora, g, 0.5))):
            fn()
            t = time_ms(fn)
            rows.append({"probe": "compose_fwd", "what": what, "shape": f"{n_rows}x{n_cols} bf16", "value": t.ms,
                         "unit": "ms", "gbps": nbytes / (t.ms * 1e-3) / 1e9,
                         "pct_copy": (100 * nbytes / (t.ms * 1e-3) / 1e9 / copy_gbps) if copy_gbps else float("nan")})
        check_pending()
    return rows


# --------------------------------------------------------------------------
# Prediction (written down before the measurement; the run records it beside)
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

def run(out: Path, *, smoke: bool = False, device: str | None = None, copy_gbps: float | None = None,
        ranks=None, rounds: int | None = None, reps: int | None = None, shape: Shape | None = None,
        checkpointing=(False, True)) -> dict:
    """The whole section: timings, agreement, probe, predictions; CSVs under ``out``
    (``model_bench.csv``, ``model_agreement.csv``, ``model_probe.csv``, ``model_predictions.csv``).
    Full sizes on CUDA; tiny ones with ``smoke`` or on the CPU (the eager tier).  ``ranks``,
    ``rounds``, ``reps``, ``shape``, ``checkpointing`` override the defaults (tests).  The compiled
    steps and the g error of each path: the model matrix (:func:`run_matrix`)."""
    import pandas as pd

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    small = smoke or device != "cuda"
    shape = shape or (SMOKE if small else FULL)
    ranks = tuple(ranks or (SMOKE_RANKS if small else RANKS))
    rounds = rounds or (SMOKE_ROUNDS if smoke else ROUNDS)
    reps = reps or (SMOKE_REPS if smoke else REPS)
    t0 = time.time()
    rows, fid = [], []
    base = build_base(shape, device)
    for r in ranks:
        rr, ff = bench_rank(shape, r, device, rounds=rounds, reps=reps, base=base, checkpointing=checkpointing)
        rows += rr
        fid += ff
        pd.DataFrame(rows).to_csv(MODEL.path("bench", out), index=False, lineterminator="\n")
    del base
    fid += agreement(device, ranks=(ranks[0],) if small else (16, 64))
    pd.DataFrame(fid).to_csv(MODEL.path("agreement", out), index=False, lineterminator="\n")
    pd.DataFrame(probe(device, smoke=smoke, copy_gbps=copy_gbps)).to_csv(
        MODEL.path("probe", out), index=False, lineterminator="\n")
    preds = [{"rank": r, "checkpointing": c, "variant": v, "predicted_ms": t}
             for r in ranks for c in (False, True) for v, t in predict(shape, r, c, **(
                 {"copy_gbps": copy_gbps} if copy_gbps else {})).items()]
    pd.DataFrame(preds).to_csv(MODEL.path("predictions", out), index=False, lineterminator="\n")
    summary = {"shape": asdict(shape), "ranks": list(ranks), "rounds": rounds, "reps": reps, "device": device,
               "checkpointing": list(checkpointing),
               "wall_s": time.time() - t0, "smoke": smoke}
    _log(f"model section done in {summary['wall_s']:.0f} s")
    return summary


def ingest(src: Path, dest: Path | None = None, *, git_sha: str | None = None) -> list[Path]:
    """Copy the model section's files of a suite (or standalone) folder into ``data/gpu/`` with
    provenance (the device and git sha from the folder's ``device.json``), leaving the committed
    ``device.json`` of the other sections alone; a part of the model matrix (``--matrix K``) goes to
    its own data set (``data/gpu/matrix/partK/``)."""
    from ...repro.recording import ingest_folder, read_machine

    desc = read_machine(Path(src))
    run_ = desc.get("model") or {}
    if desc.get("smoke") or run_.get("smoke"):
        raise SystemExit(f"dora-num record model: {src} is a --smoke run; not recorded")
    matrix = desc.get("matrix")
    if matrix:  # a part of the matrix: its own data set
        ds = MODEL_MATRIX[int(matrix["part"]) - 1]
        if sorted(matrix.get("ranks") or []) != sorted(MATRIX_PARTS[int(matrix["part"])]) \
                or matrix.get("shape") != asdict(FULL) or list(matrix.get("modes") or []) != list(MATRIX_MODES):
            raise SystemExit(f"dora-num record model: {src} is part {matrix['part']} of the matrix at other ranks, "
                             f"shape or modes than the data set's ({MATRIX_PARTS[int(matrix['part'])]}, the full "
                             "shape, eager and both compile modes); not recorded")
        return ingest_folder(Path(src), dest or ds.dest(), producer=ds.producer, git_sha=git_sha,
                             names=tuple(p.name for p in ds.paths(src)))
    full = {"shape": asdict(FULL), "ranks": sorted(RANKS), "checkpointing": [False, True]}
    got = {"shape": run_.get("shape"), "ranks": sorted(run_.get("ranks") or []),
           "checkpointing": run_.get("checkpointing", [False, True])}
    if run_ and got != full:  # the data set holds the full table only
        raise SystemExit(f"dora-num record model: {src} is an eager run of {got}, not the suite's {full}; "
                         f"recording it would replace {', '.join(map(str, MODEL.files))} in data/ with a smaller table")
    return ingest_folder(Path(src), dest or MODEL.dest(), producer=MODEL.producer, git_sha=git_sha,
                         names=tuple(p.name for p in MODEL.paths(src)))


def describe(device: str, smoke: bool) -> dict:
    """The standalone run's ``device.json`` (the suite writes its own): device, versions, git sha,
    and on CUDA the copy bandwidth of this run."""
    from ...repro.recording import checkout_git_sha

    sha = checkout_git_sha()
    desc = {"standalone": True, "argv": sys.argv, "smoke": smoke, "sections": ["model"]}
    if device == "cuda":
        from ..bench import copy_bandwidth, gpu_description

        desc.update(gpu_description(sha))
        desc["copy"] = copy_bandwidth(256 * 2**20 if smoke else 2 * 2**30)
    else:
        from ...repro.provenance import device_info, versions

        desc.update(device=device_info(), versions=versions(), git_sha=sha)
    return desc


def build_parser(prog: str = "dora-num record model", name: str = "model"):
    p = recorder_parser(prog, __doc__, smoke="tiny sizes, two ranks, two rounds (tests the machinery)",
                        out=f"output folder ({', '.join(MODEL.filename(t) for t in MODEL.roles)}, {MACHINE_FILE})")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if available")
    p.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {ROUNDS}; smoke {SMOKE_ROUNDS})")
    p.add_argument("--ranks", type=int, nargs="+", default=None, help=f"ranks (default {' '.join(map(str, RANKS))})")
    p.add_argument("--no-checkpointing", action="store_true",
                   help="only the rows without gradient checkpointing (half the compiles)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"decoder layers of the model (default {Shape().layers}; fewer: shorter compiles)")
    p.add_argument("--matrix", type=int, choices=sorted(MATRIX_PARTS), default=None,
                   help="instead: part K of the model matrix (plain LoRA, PEFT's DoRA, this operator; eager, "
                        "compile, reduce-overhead; training with and without checkpointing, inference; ranks "
                        + "; ".join(f"part {k}: {' '.join(map(str, v))}" for k, v in MATRIX_PARTS.items())
                        + "), one device call each; --ingest takes each part's folder")
    return p


def ingest_args(a) -> list[Path]:
    return ingest(a.ingest, a.out, git_sha=a.git_sha)


def record(a) -> int:
    if a.rounds is not None and a.rounds < 1:
        raise SystemExit("dora-num record model: --rounds must be >= 1")
    if a.layers is not None and a.layers < 1:
        raise SystemExit("dora-num record model: --layers must be >= 1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    desc = describe(device, a.smoke)
    if a.git_sha:
        desc["git_sha"] = a.git_sha
    if a.matrix is not None:
        small = a.smoke or device != "cuda"  # the machinery at tiny sizes (the CPU compiles with aot_eager)
        desc["matrix"] = run_matrix(out, a.matrix, device=device, rounds=a.rounds or (1 if small else None),
                                    ranks=a.ranks or (SMOKE_RANKS[:1] if small else None),
                                    shape=SMOKE if small else None if a.layers is None else Shape(layers=a.layers),
                                    reps=1 if small else None, backend="inductor" if device == "cuda" else "aot_eager")
        desc["smoke"] = bool(a.smoke)
        (out / "device.json").write_text(json.dumps(desc, indent=2, default=str) + "\n")
        return 0
    desc["model"] = run(out, smoke=a.smoke, device=device, copy_gbps=desc.get("copy", {}).get("gbps"), rounds=a.rounds,
                        ranks=a.ranks,
                        shape=None if a.layers is None else Shape(layers=a.layers),
                        checkpointing=(False,) if a.no_checkpointing else (False, True))
    (out / "device.json").write_text(json.dumps(desc, indent=2, default=str) + "\n")
    return 0
