"""The training compose on the device alone: fused vs ``torch.compile`` under CUDA graphs.

``python -m dora_num.studies.bench_train_graphs --out DIR`` (CUDA) writes
``train_graphs.csv``.  Issue 4's training target (fused forward+backward >= 1.5x
faster than ``torch.compile`` of the same forward+backward) is timed by the GPU
suite one step at a time through autograd (``do_bench``).  At 8192x8192 bf16 that
step is bound by the host: ~0.3 ms of Python, autograd and launch per step against
~0.28 ms of GPU work, so the recorded ratio measures host overheads and moved
between two runs of the same kernels (1.31x, then 0.93x).  Here each step (the
forward, ``torch.autograd.grad`` for base, lora and g) is captured once in a CUDA
graph and replayed, which removes the host from the timing: what remains is each
implementation's kernels, to set beside the bandwidth floor.

Per shape and implementation, interleaved over ``repeats`` rounds: the host-bound
``do_bench`` time of the step (as the suite measures it) and the replay time of its
graph.  The replayed graph's output and gradients are checked against the eager
step (bitwise for the fused path; the suite's baseline tolerance for compile).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SHAPES = ((8192, 8192), (16384, 8192), (4096, 8192))


def _graph_of(step):
    """Capture ``step()`` in a CUDA graph (after a warm-up on a side stream, as
    ``torch.cuda.graphs`` requires); returns the graph and its static outputs."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def measure(shapes=SHAPES, repeats: int = 3) -> list[dict]:
    import torch

    from ..ops.compose import ComposeFunction
    from ..ops.kernels import compose as kc
    from .bench import bitwise_equal, compose_bytes, copy_bandwidth, max_rel_err, time_ms
    from .gpu_suite import BASELINE_TOL, SCALE, SEED, _autograd_expr, _compose_inputs

    torch.backends.cuda.matmul.allow_tf32 = False
    copy = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    s = SCALE
    rows = []
    for tokens, d_out in shapes:
        base, lora, g, grad = _compose_inputs(tokens, d_out, torch.bfloat16, gen)
        bl, ll, gg = (t.detach().requires_grad_(True) for t in (base, lora, g))
        inputs = (bl, ll, gg)
        fwds = {"fused": lambda b_, l_, g_: ComposeFunction.apply(b_, l_, g_, s, True),
                "compile": torch.compile(lambda b_, l_, g_: _autograd_expr(b_, l_, g_, s), dynamic=False)}
        nbytes = compose_bytes("train", base.numel(), base.element_size(), d_out, bwd_block_m=kc.BWD_BLOCK_M)
        floor_ms = nbytes / (copy["gbps"] * 1e9) * 1e3
        steps, graphs, want = {}, {}, None
        for name, fwd in fwds.items():
            def step(fwd=fwd):
                out = fwd(bl, ll, gg)
                return (out, *torch.autograd.grad(out, inputs, grad))

            eager = [t.clone() for t in step()]
            graph, outs = _graph_of(step)
            graph.replay()
            torch.cuda.synchronize()
            if want is None:
                want = eager  # the fused step, itself bitwise equal to the reference (GPU tests)
            ok_graph = all(bitwise_equal(a, b) for a, b in zip(outs, eager))
            err = max(max_rel_err(a, b) for a, b in zip(eager[:3], want[:3]))
            ok = ok_graph and (name == "fused" or err <= BASELINE_TOL["bfloat16"])
            steps[name], graphs[name] = step, (graph, ok, err)
        for rep in range(repeats):
            for name in fwds:
                graph, ok, err = graphs[name]
                for mode, fn in (("do_bench_step", steps[name]), ("cuda_graph", graph.replay)):
                    t = time_ms(fn)
                    rows.append({"tokens": tokens, "d_out": d_out, "dtype": "bfloat16", "impl": name, "mode": mode,
                                 "round": rep, **t.as_dict(), "bytes": nbytes, "floor_ms": floor_ms,
                                 "pct_copy": 100 * floor_ms / t.ms, "check_ok": ok, "rel_err_vs_fused": err,
                                 "copy_gbps": copy["gbps"]})
                    print(f"{tokens}x{d_out} {name:8s} {mode:14s} round {rep}: {t.ms:.4f} ms "
                          f"({100 * floor_ms / t.ms:.0f}% of floor)", flush=True)
        del base, lora, g, grad, bl, ll, gg, graphs, steps, want
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dora_num.studies.bench_train_graphs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for train_graphs.csv")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    import pandas as pd
    import torch

    if not torch.cuda.is_available():
        print("bench_train_graphs needs a CUDA GPU", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(measure(repeats=a.repeats)).to_csv(a.out / "train_graphs.csv", index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
