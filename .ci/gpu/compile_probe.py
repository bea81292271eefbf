"""Device probe of the compile-native operator (H200): does each promise hold on the GPU image?

Sections (each independent; a failure is recorded and the next runs):
  kernels  the tail kernel with its constants as scalar arguments, the row_sumsq kernel
  layer    DoRALinear 4096->4096 r=64 (bf16 base, fp32 adapters, autocast): compiled vs eager bits,
           no sync under torch.cuda.set_sync_debug_mode("error"), reduce-overhead train + infer, flags
  peft     a tiny accelerated PEFT Llama: fullgraph, reduce-overhead train + infer, no sync
  host     host time of a compiled layer step at a tiny size, and its cProfile (host_cprofile.txt)
  bench    one 8B-shaped decoder layer, 4096 tokens: LoRA / PEFT / accelerate, eager and compiled
Usage: python .ci/gpu/compile_probe.py OUT_DIR [section ...]
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
import traceback

import torch

import dora_num as dn

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
ONLY = set(sys.argv[2:])
RESULTS: dict = {}


def log(*a):
    print(f"[probe {time.strftime('%H:%M:%S')}]", *a, flush=True)


def section(name):
    def deco(fn):
        if ONLY and name not in ONLY:
            return fn
        t = time.time()
        try:
            RESULTS[name] = fn()
        except Exception as e:  # record and go on
            RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            log(name, "FAILED", RESULTS[name]["error"])
            print(RESULTS[name]["trace"])
        RESULTS.setdefault(name, {})["seconds"] = round(time.time() - t, 1)
        log(name, "done", RESULTS[name].get("seconds"))
        return fn
    return deco


def bits_equal(a, b):
    return bool(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                          b.contiguous().view(torch.uint8)))


@section("kernels")
def _():
    from dora_num.ops.kernels.row_sumsq import row_sumsq
    from dora_num.ops.weight_norm import magnitude_scale_and_flag
    from dora_num.ops.config import override
    out = {}
    W = (torch.randn(4096, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    base, zero = row_sumsq(W)
    ref = (W.double() ** 2).sum(1)
    out["row_sumsq_max_rel"] = float(((base.double() - ref).abs() / ref).max())
    A = torch.randn(64, 4096, device="cuda") / 64
    B = torch.randn(4096, 64, device="cuda") * 1e-3
    m = torch.rand(4096, device="cuda") + 0.5
    g, bad = magnitude_scale_and_flag(W, A, B, 2.0, m)
    with override(norm_tail="torch"):
        g2, _ = magnitude_scale_and_flag(W, A, B, 2.0, m)
    out["tail_vs_torch_tail_max_rel"] = float(((g - g2).abs() / g2.abs()).max())
    out["flag"] = bad.tolist()
    return out


def no_sync(fn):
    """True if ``fn()`` runs under ``torch.cuda.set_sync_debug_mode("error")``, else the error's text."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError as e:
        return f"{e}"[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _layer(r=64, d=4096, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(d, d, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = dn.DoRALinear(lin, rank=r, alpha=2 * r)
    with torch.no_grad():
        layer.lora_B.normal_(0, 1e-3)
        layer.magnitude.mul_(1 + 1e-3 * torch.randn_like(layer.magnitude))
    return layer


def _step(layer, x):
    for p in (layer.magnitude, layer.lora_A, layer.lora_B):
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.float().square().mean().backward()
    return y.detach(), [p.grad.clone() for p in (layer.magnitude, layer.lora_A, layer.lora_B)]


@section("layer")
def _():
    out = {}
    layer = _layer()
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    y0, g0 = _step(layer, x)
    comp = torch.compile(layer, fullgraph=True)
    _step(comp, x)
    y1, g1 = _step(comp, x)
    out["default_bits_y"] = bits_equal(y0, y1)
    out["default_bits_grads"] = [bits_equal(a, b) for a, b in zip(g0, g1)]
    out["default_grad_max_rel"] = [float(((a.float() - b.float()).abs().max() / a.float().abs().max())) for a, b in zip(g0, g1)]
    out["default_no_sync"] = no_sync(lambda: _step(comp, x))
    ro = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    ys = []
    for _ in range(4):
        ys.append(_step(ro, x))
    torch.cuda.synchronize()
    out["ro_train_bits_y"] = bits_equal(ys[-1][0], y0)
    out["ro_train_bits_grads"] = [bits_equal(a, b) for a, b in zip(g0, ys[-1][1])]
    out["ro_no_sync"] = no_sync(lambda: _step(ro, x))
    roi = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        yi = [roi(x).clone() for _ in range(4)]
        ye = layer(x)
    out["ro_infer_bits"] = bits_equal(yi[-1], ye)
    out["flags_after"] = layer._flags.tolist()
    dn.check_flags(layer)
    with torch.no_grad():
        layer.magnitude[3] = float("nan")
    _step(comp, x)
    try:
        dn.check_flags(layer)
        out["nan_flag"] = "not raised"
    except ValueError as e:
        out["nan_flag"] = f"{type(e).__name__}: {e}"[:300]
    # timing of one layer fwd+bwd: eager, default compiled, reduce-overhead
    layer = _layer()
    comp = torch.compile(layer, fullgraph=True)
    ro = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    for name, f in (("eager", layer), ("compiled", comp), ("reduce_overhead", ro)):
        for _ in range(3):
            _step(f, x)
        torch.cuda.synchronize()
        ts = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); _step(f, x); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b))
        out[f"ms_{name}"] = statistics.median(ts)
    return out


@section("peft")
def _():
    from peft import LoraConfig, get_peft_model
    import dora_num.peft as dp
    from dora_num.oracles import tiny_hf_model, perturb_peft_dora
    out = {}
    torch.manual_seed(0)
    pm = get_peft_model(tiny_hf_model("llama", seed=0).cuda().to(torch.bfloat16),
                        LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    perturb_peft_dora(pm, seed=100)
    dp.accelerate(pm, verbose=False)
    ids = torch.randint(0, 64, (3, 8), device="cuda")

    def step(model):
        for p in pm.parameters():
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o = model(input_ids=ids, labels=ids)
        o.loss.backward()
        return o.logits.detach(), {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}
    pm.train()
    l0, g0 = step(pm)
    for mode in ("default", "reduce-overhead"):
        c = torch.compile(pm, fullgraph=True, mode=None if mode == "default" else mode)
        for _ in range(3):
            l1, g1 = step(c)
        ok = no_sync(lambda: step(c))
        out[mode] = {"logits_max_abs": float((l1.float() - l0.float()).abs().max()), "no_sync": ok,
                     "grads_equal": sum(bits_equal(g0[k], g1[k]) for k in g0), "grads": len(g0)}
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            pm.eval()
            ci = torch.compile(pm, fullgraph=True, mode=None if mode == "default" else mode)
            li = [ci(input_ids=ids).logits.clone() for _ in range(3)]
            le = pm(input_ids=ids).logits
            pm.train()
        out[mode]["infer_max_abs"] = float((li[-1].float() - le.float()).abs().max())
    out["check_flags_layers"] = dn.check_flags(pm)
    return out


@section("bench")
def _():
    sys.path.insert(0, ".")
    from dora_num.studies.speed.model_variants import Shape, adapter_state, build_base, make_variant
    out = {}
    from dora_num.studies.bench import lift_recompile_limits
    lift_recompile_limits()
    shape = Shape(layers=1)
    base = build_base(shape, "cuda")
    ids = torch.randint(0, shape.vocab, (1, shape.tokens), device="cuda")
    for r in (64, 384):
        state = adapter_state(base, r)
        for variant in ("lora_fp32", "peft_fp32", "dora_num_fp32"):
            model = make_variant(variant, base, r, state)
            params = [p for p in model.parameters() if p.requires_grad]

            def step(m=model):
                for p in params:
                    p.grad = None
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
            for mode in ("eager", "compiled", "reduce-overhead"):
                if mode == "reduce-overhead" and variant == "lora_fp32":
                    continue
                t0 = time.time()
                f = model if mode == "eager" else torch.compile(model, mode=None if mode == "compiled" else mode)
                try:
                    for _ in range(3):
                        (lambda: step(f))()
                    torch.cuda.synchronize()
                    compile_s = time.time() - t0
                    ts = []
                    for _ in range(10):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record(); step(f); b.record(); b.synchronize()
                        ts.append(a.elapsed_time(b))
                    out[f"r{r}_{variant}_{mode}"] = {"ms": round(statistics.median(ts), 3), "compile_s": round(compile_s, 1)}
                except Exception as e:
                    out[f"r{r}_{variant}_{mode}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                log(r, variant, mode, out[f"r{r}_{variant}_{mode}"])
            del model
            torch.cuda.empty_cache()
    return out


@section("host")
def _():
    """Host cost of a layer step at a size whose GPU work is microseconds (512->512, r=16, 64 tokens,
    the fused compose tier forced), so wall time is host time: eager, compiled (default mode) with the
    traced triton_ops (``OpConfig.traced_ops``, the default) with and without the tail launched by Inductor
    (``OpConfig.traced_tail``), and with the opaque custom ops (the A/B baseline), rounds interleaved; and a
    cProfile and a torch.profiler table of the step with the traced tail, written to host_cprofile.txt."""
    import cProfile
    import io
    import pstats

    from dora_num.ops.config import override

    layer = _layer(r=16, d=512)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    steps = {}
    variants = {"compiled_traced_tail": dict(traced_ops=True, traced_tail=True),  # the tail launched by Inductor
                "compiled_traced": dict(traced_ops=True, traced_tail=False),
                "compiled_opaque": dict(traced_ops=False, traced_tail=False)}
    with override(compose_path="fused"):
        steps["eager"] = layer
        for name, opts in variants.items():
            with override(**opts):
                comp = torch.compile(layer, fullgraph=True, dynamic=False)
                for _ in range(3):
                    _step(comp, x)
            steps[name] = (comp, opts)
        rounds = {k: [] for k in steps}
        for _ in range(5):
            for name, f in steps.items():
                comp, opts = (f, None) if name == "eager" else f
                with override(**opts) if opts is not None else override():
                    for _ in range(5):
                        _step(comp, x)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(100):
                        _step(comp, x)
                    torch.cuda.synchronize()
                rounds[name].append((time.perf_counter() - t) / 100 * 1e6)
        out = {f"{k}_us_per_step": round(statistics.median(v), 1) for k, v in rounds.items()}
        out["rounds_us"] = {k: [round(u, 1) for u in v] for k, v in rounds.items()}
        comp = steps["compiled_traced_tail"][0]
        prof = cProfile.Profile()
        with override(**variants["compiled_traced_tail"]):
            prof.enable()
            for _ in range(200):
                _step(comp, x)
            prof.disable()
            # the host time of each op of the compiled step as the dispatcher sees it (custom ops by name, the
            # kernels Inductor launches, the GEMMs), which a cProfile of Python frames does not separate
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tprof:
                for _ in range(20):
                    _step(comp, x)
                torch.cuda.synchronize()
    torch.cuda.synchronize()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
    text.write("\n--- torch.profiler, CPU, 20 compiled steps (traced ops and tail), by self CPU time\n")
    text.write(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80))
    with open(f"{OUT}/host_cprofile.txt", "w") as fh:
        fh.write(text.getvalue())
    return out


with open(f"{OUT}/compile_probe.json", "w") as fh:
    json.dump(RESULTS, fh, indent=1, default=str)
for k, v in RESULTS.items():
    print(k, json.dumps({a: b for a, b in v.items() if a != "trace"}, default=str)[:1500])
