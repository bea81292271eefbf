"""Timeline of one ``DoRALinear`` forward+backward step on the H200 (a device script).

``PYTHONPATH=. python3 .ci/gpu/layer_timeline.py``: at 4096->4096, r=384, 4096 tokens,
bf16: (1) interleaved timings of the step under each finiteness check of ``g``
(``OpConfig.finite_check``: ``late`` as shipped, ``sync`` right after ``g``, ``off``),
the A/B of what the check costs; (2) a torch.profiler trace of three steps, printed as a
timeline (host annotations and GPU kernels, microseconds from the step's start) so the
gaps where the GPU waits for the host are visible.  Recorded:
``.ci/gpu/diagnostics/layer_timeline_c658e09.log`` (at git c658e09, by this script as it
was then: its variants were ``shipped`` (= ``late``) and ``no_wait``, which queued the
flag's copy but did not wait for it, a subclass of the layer's private check class that
``finite_check="off"`` replaces; ``git show c658e09:.ci/gpu/layer_timeline.py``).
"""
import json
import os
import statistics
import tempfile
import time

import torch

from dora_num.ops import layer as L
from dora_num.ops.config import override
from dora_num.studies.bench import time_ms

torch.manual_seed(0)
d, r, T = 4096, 384, 4096
dt = torch.bfloat16
layer = L.DoRALinear(torch.nn.Linear(d, d, bias=False, device="cuda", dtype=dt), r, 192.0, use_rslora=True)
with torch.no_grad():
    # ||sBA|| ~ 5% of ||W||: with N(0, 1e-2) the cancellation guard would recompute every row
    layer.lora_B.normal_(0, 5e-4)
x = torch.randn(T, d, device="cuda", dtype=dt, requires_grad=True)
D = torch.randn(T, d, device="cuda", dtype=dt)


def step():
    layer(x).backward(D)


variants = ("late", "sync", "off")
res = {k: [] for k in variants}
for _ in range(5):
    for name in variants:
        with override(finite_check=name):
            res[name].append(time_ms(step).ms)
for name, ts in res.items():
    print(f"fwd+bwd {name:8s}: median {statistics.median(ts):.3f} ms  rounds {' '.join(f'{t:.3f}' for t in ts)}")

# host time of the forward alone and of the backward alone
for _ in range(10):
    step()
torch.cuda.synchronize()
tf, tb = [], []
for _ in range(50):
    t0 = time.perf_counter()
    y = layer(x)
    t1 = time.perf_counter()
    y.backward(D)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    tf.append((t1 - t0) * 1e6)
    tb.append((t2 - t1) * 1e6)
print(f"host (sync between steps): forward {statistics.median(tf):.0f} us, backward call {statistics.median(tb):.0f} us")

# timeline
from torch.profiler import ProfilerActivity, profile, record_function

for _ in range(5):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for i in range(3):
        with record_function(f"STEP{i}"):
            with record_function("forward"):
                y = layer(x)
            with record_function("backward"):
                y.backward(D)
    torch.cuda.synchronize()
path = os.path.join(tempfile.mkdtemp(), "trace.json")
prof.export_chrome_trace(path)
ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
steps = sorted((e for e in ev if e["name"].startswith("STEP")), key=lambda e: e["ts"])
s = steps[-1]
t0, t1 = s["ts"], s["ts"] + s["dur"]
print(f"\nlast profiled step: host span {s['dur']:.0f} us")
rows = []
for e in ev:
    cat = e.get("cat", "")
    if e["ts"] < t0 - 5 or e["ts"] > t1 + 3000:
        continue
    if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        rows.append((e["ts"] - t0, e["dur"], "GPU", e["name"][:70]))
    elif cat == "user_annotation" or (cat == "cpu_op" and e["dur"] > 15):
        rows.append((e["ts"] - t0, e["dur"], "CPU", e["name"][:70]))
for ts, dur, kind, name in sorted(rows):
    print(f"{ts:9.1f} {dur:8.1f} {kind} {name}")
