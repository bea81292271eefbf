"""The training compose on the device alone: fused vs ``torch.compile`` under CUDA graphs.

The method in full: docs/methods.md, studies/speed/record_train_graphs.py.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ...ops.compose import ComposeFunction
from ...ops.config import get_config
from ...repro import recording as recorded
from ..bench import Timing, bitwise_equal, compose_bytes, copy_bandwidth, max_rel_err, time_ms
from ...repro.recording import parser as recorder_parser, require_cuda
from ..inputs import suite_compose_torch
from .datasets import TRAIN_GRAPHS
from .record_compose import BASELINE_TOL, SCALE, SEED, autograd_expr

SHAPES = ((8192, 8192), (16384, 8192), (4096, 8192))


def _graph_of(step, stream):
    """Capture ``step()`` in a CUDA graph on ``stream`` (the stream every tensor of the
    step was made on: autograd makes a backward wait on the stream of each leaf, and
    a capture may not depend on another stream); returns the graph and its outputs."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = step()
    return graph, outs


def _device_ms(step, n: int = 20) -> float:
    """Sum of the CUDA kernel (and memset) durations of one step, by torch.profiler:
    the step's device time without the host's gaps between launches."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    # device-side events only (kernels, memsets): CPU op events would count their kernels again
    total_us = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    return total_us / n / 1e3


def measure(shapes=SHAPES, repeats: int = 3) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    copy = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    s = SCALE
    rows = []
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    for tokens, d_out in shapes:
        base, lora, g, grad = suite_compose_torch(tokens, d_out, torch.bfloat16, gen)
        bl, ll, gg = (t.detach().requires_grad_(True) for t in (base, lora, g))
        inputs = (bl, ll, gg)
        fwds = {"fused": lambda b_, l_, g_: ComposeFunction.apply(b_, l_, g_, s, True),
                "compile": torch.compile(lambda b_, l_, g_: autograd_expr(b_, l_, g_, s), dynamic=False)}
        nbytes = compose_bytes("train", base.numel(), base.element_size(), d_out, bwd_block_m=get_config().compose_tiles.bwd_block_m)
        floor_ms = nbytes / (copy["gbps"] * 1e9) * 1e3
        steps, graphs, want = {}, {}, None
        for name, fwd in fwds.items():
            def step(fwd=fwd):
                out = fwd(bl, ll, gg)
                return (out, *torch.autograd.grad(out, inputs, grad))

            eager = [t.clone() for t in step()]
            if want is None:
                want = eager  # the fused step, itself bitwise equal to the reference (GPU tests)
            err = max(max_rel_err(a, b) for a, b in zip(eager[:3], want[:3]))
            ok = name == "fused" or err <= BASELINE_TOL["bfloat16"]
            try:
                graph, outs = _graph_of(step, stream)
                graph.replay()
                torch.cuda.synchronize()
                ok_graph = all(bitwise_equal(a, b) for a, b in zip(outs, eager))
            except Exception as e:  # noqa: BLE001 - recorded; the profiler's device time still stands
                print(f"{tokens}x{d_out} {name}: CUDA graph capture failed: {e!r}"[:400], flush=True)
                graph, ok_graph = None, False
            steps[name], graphs[name] = step, (graph, ok, ok_graph, err)
        for rep in range(repeats):
            for name in fwds:
                graph, ok, ok_graph, err = graphs[name]
                timings = [("do_bench_step", time_ms(steps[name]))]
                if graph is not None:
                    timings.append(("cuda_graph", time_ms(graph.replay)))
                dev = _device_ms(steps[name])
                timings.append(("profiler_device_sum", Timing(dev, dev, dev)))
                for mode, t in timings:
                    rows.append({"tokens": tokens, "d_out": d_out, "dtype": "bfloat16", "impl": name, "mode": mode,
                                 "round": rep, **t.as_dict(), "bytes": nbytes, "floor_ms": floor_ms,
                                 "pct_copy": 100 * floor_ms / t.ms, "check_ok": ok,
                                 "graph_bitwise_eager": ok_graph, "rel_err_vs_fused": err,
                                 "copy_gbps": copy["gbps"]})
                    print(f"{tokens}x{d_out} {name:8s} {mode:20s} round {rep}: {t.ms:.4f} ms "
                          f"({100 * floor_ms / t.ms:.0f}% of floor)", flush=True)
        del base, lora, g, grad, bl, ll, gg, graphs, steps, want
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    torch.cuda.set_stream(torch.cuda.default_stream())
    return rows


def build_parser(prog: str = "dora-num record train-graphs", name: str = "train-graphs"):
    p = recorder_parser(prog, __doc__, smoke="one 1024x1024 shape, one round (a check of the recorder)",
                        out=f"folder for {TRAIN_GRAPHS.filename()} and {recorded.MACHINE_FILE}")
    p.add_argument("--repeats", type=int, default=3)
    return p


def ingest_args(a) -> list[Path]:
    return recorded.ingest_folder(a.ingest, a.out or TRAIN_GRAPHS.dest(), producer=TRAIN_GRAPHS.producer,
                                  names=(TRAIN_GRAPHS.filename(),), git_sha=a.git_sha)


def record(a) -> int:
    require_cuda("train-graphs", torch.cuda.is_available())
    a.out.mkdir(parents=True, exist_ok=True)
    shapes, repeats = (((1024, 1024),), 1) if a.smoke else (SHAPES, a.repeats)
    pd.DataFrame(measure(shapes, repeats=repeats)).to_csv(TRAIN_GRAPHS.path(folder=a.out), index=False)
    recorded.write_machine(a.out, recorded.describe_machine(a.git_sha, repeats=repeats, smoke=a.smoke))
    return 0
