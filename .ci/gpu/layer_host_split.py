"""Where the host time of one ``DoRALinear`` training step goes (a device script).

``PYTHONPATH=. python3 .ci/gpu/layer_host_split.py OUT_DIR``: 4096->4096, r=64, 4096 tokens, bf16 W,
fp32 adapters, bf16 autocast.  Host microseconds (calls queued without a wait, median of rounds)
of the forward with autograd recording, of the backward alone (graphs built untimed), and of
forward+backward, for the layer (one autograd node and unfused) and for ``nn.Linear`` + LoRA; then
a torch.profiler table (every thread: the backward runs on the autograd engine's) of five steps,
by self CPU time; then cProfile of the forward (main thread) and of the one-node backward
(profiled inside the engine's thread).  Writes ``OUT_DIR/layer_host_split.log``.
"""
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as Fn
from torch.profiler import ProfilerActivity, profile

import dora_num as dn
from dora_num.ops import lora_compose
from dora_num.ops.config import override
from dora_num.ops.finite import check_pending

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
log = open(out / "layer_host_split.log", "w")


def emit(s):
    print(s, flush=True)
    log.write(s + "\n")


def host(fn, n=20, rounds=5, setup=None):
    vals = []
    for _ in range(rounds + 1):
        args = [setup() for _ in range(n)] if setup else [None] * n
        torch.cuda.synchronize()
        t = time.perf_counter()
        for a in args:
            fn(a)
        vals.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(vals[1:])


torch.manual_seed(0)
d, r, T = 4096, 64, 4096
lin = torch.nn.Linear(d, d, bias=False, device="cuda", dtype=torch.bfloat16)
layer = dn.DoRALinear(lin, r, 2.0 * r)
with torch.no_grad():
    layer.lora_B.normal_(0, 1e-3)
x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
D = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
lA = torch.nn.Parameter(layer.lora_A.detach().clone())
lB = torch.nn.Parameter(layer.lora_B.detach().clone())


def dora_fwd(_=None):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return layer(x)


def lora_fwd(_=None):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return lin(x) + 2.0 * Fn.linear(Fn.linear(x, lA), lB)


def bwd(y):
    y.backward(D)


for one in (True, False):
    with override(one_node=one):
        name = "one_node" if one else "unfused"
        emit(f"dora {name}: fwd (recording) {host(dora_fwd):.0f} us, bwd alone {host(bwd, setup=dora_fwd):.0f} us, "
             f"fwd+bwd {host(lambda _: bwd(dora_fwd())):.0f} us")
emit(f"lora: fwd (recording) {host(lora_fwd):.0f} us, bwd alone {host(bwd, setup=lora_fwd):.0f} us, "
     f"fwd+bwd {host(lambda _: bwd(lora_fwd())):.0f} us")
emit(f"linear: fwd+bwd {host(lambda _: bwd(lin(x))):.0f} us; torch.add {host(lambda _: torch.add(D, D)):.1f} us")
check_pending()

with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(5):
        bwd(dora_fwd())
    torch.cuda.synchronize()
emit(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45))

prof_fwd = cProfile.Profile()
prof_fwd.enable()
for _ in range(100):
    y = dora_fwd()
prof_fwd.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(prof_fwd, stream=s).sort_stats("tottime").print_stats(40)
emit("== cProfile: forward (recording), 100 calls ==\n" + s.getvalue())

prof_bwd = cProfile.Profile()
orig = lora_compose.LoraComposeFunction.backward


def profiled_backward(ctx, grad):
    prof_bwd.enable()
    try:
        return orig(ctx, grad)
    finally:
        prof_bwd.disable()


lora_compose.LoraComposeFunction.backward = staticmethod(profiled_backward)
for _ in range(100):
    bwd(dora_fwd())
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(prof_bwd, stream=s).sort_stats("tottime").print_stats(40)
emit("== cProfile: LoraComposeFunction.backward (engine thread), 100 calls ==\n" + s.getvalue())
check_pending()
log.close()
