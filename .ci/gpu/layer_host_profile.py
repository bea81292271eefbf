"""Where the host time of ``DoRALinear``'s forward+backward goes (H200; a device script).

``PYTHONPATH=. python3 .ci/gpu/layer_host_profile.py``: at 4096->4096, r=384, 4096 tokens,
bf16, the wall time per call of the pieces of one step issued back to back without a
sync (so, where the host is the bottleneck, host time), and a cProfile of 30 steps.
"""
import cProfile
import io
import math
import pstats
import time

import torch
import torch.nn.functional as Fn

from dora_num.ops.compose import ComposeFunction, compose
from dora_num.ops.layer import DoRALinear

torch.manual_seed(0)
d, r, T = 4096, 384, 4096
dt = torch.bfloat16
layer = DoRALinear(torch.nn.Linear(d, d, bias=False, device="cuda", dtype=dt), r, 192.0, use_rslora=True)
with torch.no_grad():
    layer.lora_B.normal_(0, 1e-2)
x = torch.randn(T, d, device="cuda", dtype=dt, requires_grad=True)
D = torch.randn(T, d, device="cuda", dtype=dt)


def per_call(fn, n=100):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n * 1e6
    return host, wall


base = Fn.linear(x.detach(), layer.base.weight)
lora = Fn.linear(Fn.linear(x.detach(), layer.lora_A.detach()), layer.lora_B.detach())
g = layer._g_fast()[0].detach()
bl, ll, gl = (t.clone().requires_grad_(True) for t in (base, lora, g))


def step():
    layer(x).backward(D)


pieces = {
    "linear x W^T (no grad)": lambda: Fn.linear(x.detach(), layer.base.weight),
    "magnitude_scale_fast (g, flag)": lambda: layer._g_fast(),
    "compose fused training fwd+bwd (ComposeFunction)": lambda: torch.autograd.grad(
        ComposeFunction.apply(bl, ll, gl, layer.scale, True), (bl, ll, gl), D),
    "compose() public, fwd only (training)": lambda: compose(bl, ll, gl, layer.scale, _trusted=True),
    "layer forward (no grad)": lambda: layer(x.detach()),
    "layer forward (grad)": lambda: layer(x),
    "layer forward+backward": step,
}
with torch.no_grad():
    pass
for name, fn in pieces.items():
    if name == "layer forward (no grad)":
        with torch.no_grad():
            h, w = per_call(fn)
    else:
        h, w = per_call(fn)
    print(f"{name:52s} host {h:8.1f} us/call   wall {w:8.1f} us/call", flush=True)
    layer.zero_grad(set_to_none=True)
    x.grad = None

prof = cProfile.Profile()
prof.enable()
for _ in range(30):
    step()
prof.disable()
torch.cuda.synchronize()
for key in ("tottime", "cumtime"):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(45)
    print(s.getvalue())
