"""Host time of the pieces of ``DoRALinear``'s forward on the H200 (a device script).

``PYTHONPATH=. python3 .ci/gpu/layer_host_pieces.py``: tight loops (no sync inside), so each
number is host time per call where the GPU keeps up (small shapes: 512->512, r=16, 64 tokens).
"""
import statistics
import time

import torch
import torch.nn.functional as Fn

from dora_num.ops import layer as L
from dora_num.ops.compose import ComposeFunction, compose

torch.manual_seed(0)
d, r, T = 512, 16, 64
dt = torch.bfloat16
layer = L.DoRALinear(torch.nn.Linear(d, d, bias=False, device="cuda", dtype=dt), r, 32.0, compose_path="fused")
with torch.no_grad():
    layer.lora_B.normal_(0, 1e-2)
x = torch.randn(T, d, device="cuda", dtype=dt, requires_grad=True)
D = torch.randn(T, d, device="cuda", dtype=dt)
g = layer._g_fast()[0].detach()
base = Fn.linear(x.detach(), layer.base.weight)
lora = Fn.linear(Fn.linear(x.detach(), layer.lora_A.detach()), layer.lora_B.detach())
bl, ll, gl = (t.clone().requires_grad_(True) for t in (base, lora, g))
flag_dev = torch.zeros(1, dtype=torch.int32, device="cuda")


def us(fn, n=300, rounds=5):
    out = []
    for _ in range(rounds):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


class NoWait(L._FiniteCheck):
    __slots__ = ()

    def ok(self):
        return True


class NoCheck:
    def __init__(self, g, bad=None):
        pass

    def ok(self):
        return True


def fwd():
    return layer(x)


def fwd_bwd():
    layer(x).backward(D)


def with_check(cls, fn):
    def run():
        L._FiniteCheck = cls
        try:
            return fn()
        finally:
            L._FiniteCheck = SHIPPED
    return run


SHIPPED = L._FiniteCheck
pieces = {
    "empty kernel launch: torch.add(small)": lambda: torch.add(g, 1.0),
    "Fn.linear x W^T": lambda: Fn.linear(x, layer.base.weight),
    "x A^T B^T": lambda: Fn.linear(Fn.linear(x, layer.lora_A), layer.lora_B),
    "magnitude_scale_fast": lambda: layer._g_fast(),
    "  cached_base_row_norm_sq": lambda: L.cached_base_row_norm_sq(layer.base.weight),
    "  torch.zeros(1, int32)": lambda: torch.zeros(1, dtype=torch.int32, device="cuda"),
    "  torch.empty(d_out) x1": lambda: torch.empty(d, device="cuda"),
    "_FiniteCheck(g, flag) + ok()": lambda: SHIPPED(g, flag_dev).ok(),
    "  pinned empty": lambda: torch.empty((1,), dtype=torch.int32, pin_memory=True),
    "  cuda.Event() + record": lambda: torch.cuda.Event().record(),
    "compose() training fwd": lambda: compose(bl, ll, gl, layer.scale, _trusted=True),
    "ComposeFunction.apply fused": lambda: ComposeFunction.apply(bl, ll, gl, layer.scale, True),
    "compose fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(
        ComposeFunction.apply(bl, ll, gl, layer.scale, True), (bl, ll, gl), D),
    "layer forward (grad)": fwd,
    "layer forward, no wait": with_check(NoWait, fwd),
    "layer forward, no check": with_check(NoCheck, fwd),
    "layer fwd+bwd": fwd_bwd,
    "layer fwd+bwd, no wait": with_check(NoWait, fwd_bwd),
    "layer fwd+bwd, no check": with_check(NoCheck, fwd_bwd),
}
for name, fn in pieces.items():
    print(f"{name:42s} {us(fn):8.1f} us", flush=True)
    layer.zero_grad(set_to_none=True)
    x.grad = None
