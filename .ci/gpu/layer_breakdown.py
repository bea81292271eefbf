"""Where a ``DoRALinear`` training step spends GPU time and host time (a device script).

``PYTHONPATH=. python3 .ci/gpu/layer_breakdown.py OUT_DIR``: at the model suite's projection
shapes (4096->4096, 4096->1024, 4096->14336, 14336->4096), r in {64, 384}, bf16 W, fp32 and
bf16 adapters, 4096 tokens under bf16 autocast: the GPU time (``triton.testing.do_bench``) and
the host time per call (perf_counter over calls queued without a wait) of each piece of the
factored norm (the split of A, ``U``, ``G``, the tail), the whole ``g``, the compose, the layer's
forward and forward+backward, and the same for ``nn.Linear`` + LoRA (the floor); then a
torch.profiler table of one layer step.  Writes ``OUT_DIR/layer_breakdown.csv`` and
``OUT_DIR/layer_breakdown.log``.
"""
import csv
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as Fn

import dora_num as dn
from dora_num.ops import products as P
from dora_num.ops.config import get_config, override
from dora_num.ops.finite import check_pending
from dora_num.ops.kernels.norm_tail import norm_tail
from dora_num.ops.weight_norm import _magnitude_scale_and_flag, cached_base_row_norm_sq
from dora_num.studies.bench import time_ms

out = Path(sys.argv[1])
QUICK = "--quick" in sys.argv  # two shapes, fp32 adapters, the layer-level pieces only
out.mkdir(parents=True, exist_ok=True)
log = open(out / "layer_breakdown.log", "w")


def emit(s):
    print(s, flush=True)
    log.write(s + "\n")


def host_us(fn, n=30, rounds=5):
    fn()
    torch.cuda.synchronize()
    vals = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        vals.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(vals)


rows = []
shapes = [(4096, 4096), (4096, 14336)] if QUICK else [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]
T = 4096
for (d_in, d_out) in shapes:
    for r in (64, 384):
        for adt in (torch.float32,) if QUICK else (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            lin = torch.nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=torch.bfloat16)
            layer = dn.DoRALinear(lin, r, 2.0 * r, adapter_dtype=adt)
            with torch.no_grad():
                layer.lora_B.normal_(0, 1e-3)
            W, A, B, m = lin.weight, layer.lora_A, layer.lora_B, layer.magnitude
            cfg = get_config()
            x = torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            D = torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16)
            Ad, Bd = A.detach(), B.detach()
            A16 = Ad.bfloat16()
            pieces = {
                "mm_bf16out_r": lambda: W @ A16.T,
                "mm_fp32out_r": lambda: torch.mm(W, A16.T, out_dtype=torch.float32),
            }
            if adt == torch.float32:
                S = P.split_pieces(Ad, torch.bfloat16, 3)
                S3 = S[0].view(3 * r, d_in)
                pieces.update({
                    "mm_bf16out_3r": lambda: W @ S3.T,
                    "mm_fp32out_3r": lambda: torch.mm(W, S3.T, out_dtype=torch.float32),
                    "split_pieces": lambda: P.split_pieces(Ad, torch.bfloat16, 3),
                    "split_mm": lambda: P.split_mm(W, Ad, 3, split=S),
                    "split_gram": lambda: P.split_gram(Ad, torch.bfloat16, 3, split=S),
                })
            prod = P._products(W, Ad, d_in, cfg)
            bsq = cached_base_row_norm_sq(W)
            pieces.update({
                "products": lambda: P._products(W, Ad, d_in, cfg),
                "norm_tail": lambda: norm_tail(prod.U, Bd, prod.G, bsq, 2.0, 4.0, m=m.detach(), eps=1e-12),
                "g_and_flag": lambda: _magnitude_scale_and_flag(W, A, B, layer.scale, m, None, cfg, trusted=True),
            })
            with torch.autocast("cuda", dtype=torch.bfloat16):
                base = Fn.linear(x.detach(), W)
                lora = Fn.linear(Fn.linear(x.detach(), A), B)
            g = layer.magnitude_scale().detach()
            pieces["compose_fused_fwd"] = lambda: dn.compose(base, lora, g, 2.0, path="fused")
            pieces["calib_torch_add"] = lambda: torch.add(g, g)

            def fwd():
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    layer(x)

            def fwd_bwd():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = layer(x)
                y.backward(D)

            lA = torch.nn.Parameter(Ad.clone())
            lB = torch.nn.Parameter(Bd.clone())

            def lora_fwd_bwd():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = lin(x) + 2.0 * Fn.linear(Fn.linear(x, lA), lB)
                y.backward(D)

            def linear_fwd_bwd():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = lin(x)
                y.backward(D)

            def fwd_cached():
                with override(norm_cache="always"):
                    fwd()

            if QUICK:
                pieces = {k: pieces[k] for k in ("g_and_flag", "compose_fused_fwd", "calib_torch_add")}
            pieces.update({"layer_fwd": fwd, "layer_fwd_norm_cached": fwd_cached, "layer_fwd_bwd": fwd_bwd,
                           "lora_fwd_bwd": lora_fwd_bwd,
                           "linear_fwd_bwd": linear_fwd_bwd})
            for name, fn in pieces.items():
                try:
                    gpu = time_ms(fn, warmup=5, rep=40).ms
                    h = host_us(fn, n=10 if "bwd" in name else 30)
                except Exception as e:  # noqa: BLE001 - a diagnostic: say what failed and go on
                    emit(f"{name} failed: {type(e).__name__}: {e}")
                    continue
                check_pending()
                row = dict(d_in=d_in, d_out=d_out, r=r, adapter=str(adt).removeprefix("torch."), piece=name,
                           gpu_ms=gpu, host_us=h)
                rows.append(row)
                emit(",".join(str(v) for v in row.values()))
            del layer, lin, x, D
            torch.cuda.empty_cache()

with open(out / "layer_breakdown.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)

if QUICK:
    log.close()
    sys.exit(0)
# one step under the profiler, at the gate/up shape with fp32 adapters
from torch.profiler import ProfilerActivity, profile  # noqa: E402

torch.manual_seed(0)
lin = torch.nn.Linear(4096, 14336, bias=False, device="cuda", dtype=torch.bfloat16)
layer = dn.DoRALinear(lin, 384, 768.0)
x = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
D = torch.randn(T, 14336, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(D)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(D)
    torch.cuda.synchronize()
emit(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
emit(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
check_pending()
log.close()
