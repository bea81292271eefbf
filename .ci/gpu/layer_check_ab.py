"""A/B of ``DoRALinear``'s finiteness check of ``g`` on the H200 (interleaved rounds).

``PYTHONPATH=. python3 .ci/gpu/layer_check_ab.py`` (CUDA; a device script, not a module): forward+backward
of ``DoRALinear`` at 4096->4096 (r=384, 4096 tokens) and 8192->8192 (r=384, 2048
tokens), bf16, with four versions of the check swapped in (the current pinned byte
+ event per call; one cached pinned byte; a sync right after ``g``; no check), and
PEFT's default DoRA layer, in 4 interleaved rounds; plus the host (CPU) time of one
step.  Recorded in ``data/gpu/layer_check_ab.log`` (run at git f27de12 from an
uncommitted copy of this file, identical below this docstring).  It patches
``_FiniteCheck(g)`` as it was at f27de12 (the check now also takes the norm's flag):
rerun it against that revision (``git worktree add /tmp/ab f27de12``).
"""
import math, time, torch, statistics
from dora_num.ops import layer as L
from dora_num.studies.bench import time_ms
from dora_num.studies.suite import _peft_layer
import copy

class Cached(L._FiniteCheck):
    __slots__ = ()
    _buf = {}
    def __init__(self, g):
        ok = torch.isfinite(g.detach()).all()
        b = Cached._buf.get(g.device)
        if b is None:
            b = Cached._buf[g.device] = torch.empty((), dtype=torch.bool, pin_memory=True)
        b.copy_(ok, non_blocking=True)
        self.flag = b
        self.event = torch.cuda.Event(); self.event.record(torch.cuda.current_stream(g.device))

class Sync(L._FiniteCheck):
    __slots__ = ()
    def __init__(self, g):
        self.flag = bool(torch.isfinite(g.detach()).all()); self.event = None

class Off(L._FiniteCheck):
    __slots__ = ()
    def __init__(self, g):
        self.flag = True; self.event = None

variants = {"per_call_pinned": L._FiniteCheck, "cached_pinned": Cached, "sync_mid": Sync, "no_check": Off}
gen = torch.Generator(device="cuda").manual_seed(0)
for d, r, T in ((4096, 384, 4096), (8192, 384, 2048)):
    lin = torch.nn.Linear(d, d, bias=False, device="cuda", dtype=torch.bfloat16)
    ours = L.DoRALinear(copy.deepcopy(lin), r, use_rslora=True)
    with torch.no_grad():
        ours.lora_B.copy_((1e-2 * torch.randn(d, r, device="cuda", generator=gen)).bfloat16())
    pm = _peft_layer(copy.deepcopy(lin), r, float(r), True)
    x = torch.randn(T, d, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    D = torch.randn(T, d, device="cuda", generator=gen).bfloat16()
    def fb(m):
        def f():
            m(x).backward(D)
        return f
    res = {k: [] for k in list(variants) + ["peft_default"]}
    orig = L._FiniteCheck
    for rnd in range(4):
        for name, cls in variants.items():
            L._FiniteCheck = cls
            res[name].append(time_ms(fb(ours)).ms)
        L._FiniteCheck = orig
        res["peft_default"].append(time_ms(fb(pm)).ms)
    # host CPU time per fwd+bwd of ours (current variant)
    f = fb(ours); f(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(50): f()
    cpu = (time.perf_counter() - t) / 50 * 1e3; torch.cuda.synchronize()
    print(f"d={d} r={r} T={T}: host ms/step (per_call) {cpu:.3f}")
    for k, v in res.items():
        print(f"  {k:16s} median {statistics.median(v):.3f} ms  rounds {[round(a, 3) for a in v]}  "
              f"peft/this {statistics.median(res['peft_default']) / statistics.median(v):.2f}x" if k != "peft_default" else
              f"  {k:16s} median {statistics.median(v):.3f} ms  rounds {[round(a, 3) for a in v]}", flush=True)
