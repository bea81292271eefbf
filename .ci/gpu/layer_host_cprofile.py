"""cProfile of the host path of ``DoRALinear`` pieces on the H200 (a device script).

``PYTHONPATH=. python3 .ci/gpu/layer_host_cprofile.py [SORT]``: 512->512, r=16, 64 tokens, bf16,
the layer on the fused compose tier; 500 calls of each piece, functions by SORT (default: own time).
Recorded: ``.ci/gpu/diagnostics/layer_host_cprofile_c658e09.log`` (at git c658e09, by
this script as it was then: its ``compose()`` piece took ``path="auto"``, i.e. the eager
tier at this size, and skipped the argument checks through a private keyword; the piece
now asks for the fused tier, through the public ``compose`` with its checks, and the
norm piece is named after the public ``magnitude_scale_and_flag``).
"""
import sys

import torch
import torch.nn.functional as Fn

from dora_num.ops import layer as L
from dora_num.ops.compose import compose
from dora_num.ops.kernels import compose as _kc
from dora_num.ops.weight_norm import magnitude_scale_and_flag
from dora_num.studies.speed.record_overhead import cprofile_top

torch.manual_seed(0)
d, r, T = 512, 16, 64
dt = torch.bfloat16
layer = L.DoRALinear(torch.nn.Linear(d, d, bias=False, device="cuda", dtype=dt), r, 32.0, compose_path="fused")
SORT = sys.argv[1] if len(sys.argv) > 1 else "tottime"  # pstats sort key: tottime (default), cumulative, ...
with torch.no_grad():
    layer.lora_B.normal_(0, 1e-2)
x = torch.randn(T, d, device="cuda", dtype=dt, requires_grad=True)
D = torch.randn(T, d, device="cuda", dtype=dt)


def g_and_flag():
    return magnitude_scale_and_flag(layer.base.weight, layer.lora_A, layer.lora_B, layer.scale, layer.magnitude,
                                    chunk_bytes=layer.chunk_bytes)


g = g_and_flag()[0].detach()
base = Fn.linear(x.detach(), layer.base.weight)
with torch.autocast("cuda", dtype=dt):
    lora = Fn.linear(Fn.linear(x.detach(), layer.lora_A.detach()), layer.lora_B.detach())
bl, ll, gl = (t.clone().requires_grad_(True) for t in (base, lora, g))

def _nograd():
    with torch.no_grad(), torch.autocast("cuda", dtype=dt):
        layer(x)


def _fwd_bwd():
    with torch.autocast("cuda", dtype=dt):
        y = layer(x)
    y.backward(D)


pieces = {
    "compose() training fwd": lambda: compose(bl, ll, gl, layer.scale, path="fused"),
    "compose() inference fwd": lambda: compose(base, lora, g, layer.scale, path="fused"),
    "magnitude_scale_and_flag": g_and_flag,
    "compose_bwd (kernel wrapper)": lambda: _kc.compose_bwd(D, None, g, layer.scale, base=base, lora=lora),
    "layer fwd (no grad)": lambda: _nograd(),
    "layer fwd+bwd": lambda: _fwd_bwd(),
}
for name, fn in pieces.items():
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    print(f"===== {name} =====\n" + cprofile_top(fn, calls=500, lines=45, sort=SORT), flush=True)
