"""The GPU suite's ``layer`` section (notebook 05): ``DoRALinear`` against PEFT's DoRA
layer (default settings, fp32 adapters; and bf16 adapters), forward and
forward+backward time and peak memory, with the output's error against an fp64
evaluation of the same layer (:func:`dora_num.oracles.dora_linear_ref64`)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ...ops.layer import DoRALinear
from ...oracles import dora_linear_ref64, peft_dora_linear, set_dora_state
from .. import inputs
from ..bench import host_path, log, max_rel_err, peak_extra_bytes, time_ms

LAYER_SHAPES = ((4096, 4096, 384, 4096), (8192, 8192, 384, 2048), (8192, 8192, 512, 2048))
SEED = inputs.SUITE_SEED + 2


def _PreviousHostPath(layer):
    """``layer`` on its previous host path: the norm's torch tail, the output add separate."""
    class PreviousHostPath(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with host_path("torch", fold=False):
                return self.inner(x)

    return PreviousHostPath(layer)


# Rounds of the layer timings (interleaved across implementations).  DoRALinear's
# forward+backward is bound by the host at these shapes (1.8 ms per step against 0.71 ms
# of GPU work at 4096->4096 on the H200: data/gpu/layer_bench.csv, data/gpu/layer_profile.txt),
# and the host's speed varies between machine sessions: hence rounds, each reporting its
# median, and the previous host path timed in every round.
LAYER_ROUNDS = 5


def bench_layers(shapes, profile_to: Path | None = None) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    rows = []
    dt = torch.bfloat16
    for d_in, d_out, r, tokens in shapes:
        alpha = 192.0
        lin = torch.nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=dt)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(d_out, d_in, device="cuda", generator=gen) / math.sqrt(d_in))
        # adapter_dtype=None: bf16 A, B and fp32 m, the configuration of the recorded layer benchmark
        # (fp32 adapters, PEFT's default, are the model-level suite's subject)
        ours = DoRALinear(copy.deepcopy(lin), r, alpha, use_rslora=True, adapter_dtype=None)
        with torch.no_grad():
            # ||sBA|| ~ 5% of ||W|| per row (realistic); N(0, 1e-2) gave 1.1 ||W||, where the factored
            # norm's cancellation guard cannot certify rank 384 and recomputes every row (ops/guard.py)
            ours.lora_B.copy_((5e-4 * torch.randn(d_out, r, device="cuda", generator=gen)).to(dt))
            ours.magnitude.copy_(ours.weight_norm() * (1 + 1e-3 * torch.randn(d_out, device="cuda", generator=gen)))
        x = torch.randn(tokens, d_in, device="cuda", generator=gen).to(dt)
        D = torch.randn(tokens, d_out, device="cuda", generator=gen).to(dt)
        with torch.no_grad():  # the fp64 reference of the layer output
            y_ref = dora_linear_ref64(x.double(), lin.weight.double(), None, ours.lora_A.double(),
                                      ours.lora_B.double(), ours.magnitude.double(), ours.scale)
        # the same layer on its previous host path (the norm's torch tail, the output add as a
        # separate op), timed in the same rounds: the A/B of this path's two changes
        layers = {"dora_num": ours, "dora_num_prev_host_path": _PreviousHostPath(copy.deepcopy(ours))}
        for name, autocast in (("peft_default", True), ("peft_bf16_adapters", False)):
            pm = peft_dora_linear(lin, r, alpha, use_rslora=True, autocast_adapter_dtype=autocast)
            set_dora_state(pm, ours.lora_A, ours.lora_B, ours.magnitude)
            layers[name] = pm
        prepared = {}
        for name, layer in layers.items():
            xr = x.detach().requires_grad_(True)

            def fwd_inf(layer=layer):
                with torch.no_grad():
                    return layer(x)

            def fwd_bwd(layer=layer, xr=xr):
                y = layer(xr)
                y.backward(D)
                return y

            peak_f, y = peak_extra_bytes(fwd_inf)
            err = max_rel_err(y.double(), y_ref)
            del y
            layer.zero_grad(set_to_none=True)
            peak_fb, y = peak_extra_bytes(fwd_bwd)
            del y
            layer.zero_grad(set_to_none=True)
            xr.grad = None
            prepared[name] = (fwd_inf, fwd_bwd, layer, xr, err, peak_f, peak_fb)
            if profile_to is not None and (d_in, d_out, r, tokens) == tuple(shapes[0]):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        fwd_bwd()
                    torch.cuda.synchronize()
                with open(profile_to, "a") as fh:
                    fh.write(f"== {name} {d_in}->{d_out} r={r} T={tokens}: 3 x forward+backward ==\n")
                    fh.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n")
                layer.zero_grad(set_to_none=True)
                xr.grad = None
        # Timing: LAYER_ROUNDS rounds, the implementations interleaved in each, so a
        # drift of the host's speed within the run hits all of them alike; each
        # configuration reports its median round (and every round's median).
        rounds = {name: {"fwd": [], "fwd_bwd": []} for name in prepared}
        for _ in range(LAYER_ROUNDS):
            for name, (fwd_inf, fwd_bwd, layer, xr, *_) in prepared.items():
                rounds[name]["fwd"].append(time_ms(fwd_inf))
                rounds[name]["fwd_bwd"].append(time_ms(fwd_bwd))
                layer.zero_grad(set_to_none=True)
                xr.grad = None
        for name, (*_, err, peak_f, peak_fb) in prepared.items():
            base = {"impl": name, "d_in": d_in, "d_out": d_out, "rank": r, "tokens": tokens,
                    "rel_err_fp64": err}
            for mode, peak in (("fwd", peak_f), ("fwd_bwd", peak_fb)):
                ts = sorted(rounds[name][mode], key=lambda t: t.ms)
                rows.append({**base, "mode": mode, "peak_extra_bytes": peak, **ts[len(ts) // 2].as_dict(),
                             "rounds_ms": ";".join(f"{t.ms:.4f}" for t in rounds[name][mode])})
        del layers, ours, lin, x, D, y_ref, prepared
        torch.cuda.empty_cache()
        log(f"layer {d_in}->{d_out} r={r} T={tokens} done")
    return rows
