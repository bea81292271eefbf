"""Is the host of a ``DoRALinear`` training step busy or waiting? (a device script)

``PYTHONPATH=. python3 .ci/gpu/layer_host_wait.py``: 4096->4096, r=64, 4096 tokens, bf16 W, fp32
adapters, bf16 autocast: wall time against process CPU time (all threads) per step, for queues of
5 and 20 steps, under configurations that remove one piece at a time (the finiteness check, the
norm's recompute), and nn.Linear + LoRA, interleaved rounds.
"""
import statistics
import time

import torch
import torch.nn.functional as Fn

import dora_num as dn
from dora_num.ops.config import override
from dora_num.ops.finite import check_pending

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


def dora():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(D)


def lora():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x) + 2.0 * Fn.linear(Fn.linear(x, lA), lB)
    y.backward(D)


def one_round(fn, n):
    torch.cuda.synchronize()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    wall, cpu = (time.perf_counter() - t) / n * 1e6, (time.process_time() - c) / n * 1e6
    torch.cuda.synchronize()
    return wall, cpu


def in_config(fn, kw):
    def run():
        with override(**kw):
            fn()
    return run


variants = {
    "dora": in_config(dora, {}),
    "dora, norm reused": in_config(dora, dict(norm_cache="always")),
    "dora, no finite check": in_config(dora, dict(finite_check="off")),
    "lora": lora,
}
res = {k: [] for k in variants}
for rnd in range(9):  # interleaved rounds (A B C ... A B C ...); the first is a warm-up
    for name, fn in variants.items():
        w, c = one_round(fn, 10)
        if rnd:
            res[name].append((w, c))
    check_pending()
for name, v in res.items():
    w = [a for a, _ in v]
    c = [b for _, b in v]
    print(f"{name:32s}: wall {statistics.median(w):6.0f} us (min {min(w):6.0f}, max {max(w):6.0f}), "
          f"process CPU {statistics.median(c):6.0f} us per step", flush=True)
with torch.no_grad():
    w, c = one_round(lambda: torch.add(D, D), 200)
print(f"torch.add: wall {w:.1f} us, process CPU {c:.1f} us")
