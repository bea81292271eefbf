"""Host-side (CPU) cost of the fused compose tier: why the training step is launch-bound.

``python -m dora_num.studies.speed.overhead`` on a CUDA machine prints the CPU time
per call of the fused forward and backward launchers and of one autograd training
step through :class:`~dora_num.ops.compose.ComposeFunction`, and a cProfile of
the step.  Recorded on the H200 host (2026-11-29, torch 2.11, triton 3.6, git
a4ce237; ``data/gpu/host_overhead.log``): fused forward 31 us of CPU per call,
fused backward 65 us (one launch: dg's stage 2 runs inside it), a training step
301 us of CPU (324 us wall) against ~0.28 ms of GPU work at 8192x8192 bf16.  An
earlier probe (git aab0061, three launches, a busier host) read 66 / 143 / 525 us.
So up to ~16384x8192 the fused training step timed one at a time is bound by the
host, not by memory bandwidth (``bench_train_graphs`` times it without the host).

:func:`layer_host_cost` times ``DoRALinear`` where its GPU work is negligible, with the
norm's tail kernel and with its torch tail (the A/B of
:mod:`dora_num.ops.kernels.norm_tail`), each with the output add folded into the
compose and separate (``DoRALinear.FOLD_OUTPUT_ADD``).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time


def main() -> None:
    import torch

    from ...ops.compose import ComposeFunction
    from ...ops.kernels import compose as kc

    if not torch.cuda.is_available():
        raise SystemExit("bench_overhead needs a CUDA GPU")
    for shape in ((64, 512), (8192, 8192)):
        base = torch.randn(shape, device="cuda").bfloat16()
        lora = torch.randn(shape, device="cuda").bfloat16()
        g = 1 + 1e-3 * torch.randn(shape[1], device="cuda")
        grad = torch.randn(shape, device="cuda").bfloat16()
        kc.compose_fwd(base, lora, g, 0.5)
        kc.compose_bwd(grad, None, g, 0.5, base=base, lora=lora)
        torch.cuda.synchronize()
        for name, fn in (("fwd", lambda: kc.compose_fwd(base, lora, g, 0.5)),
                         ("bwd", lambda: kc.compose_bwd(grad, None, g, 0.5, base=base, lora=lora))):
            t = time.perf_counter()
            for _ in range(200):
                fn()
            cpu = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
            print(f"{shape} {name}: CPU {cpu:.1f} us/call", flush=True)
        bl, ll, gg = (t.clone().requires_grad_(True) for t in (base, lora, g))

        def step():
            out = ComposeFunction.apply(bl, ll, gg, 0.5, True)
            return torch.autograd.grad(out, (bl, ll, gg), grad)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            step()
        cpu = (time.perf_counter() - t) / 100 * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 100 * 1e6
        print(f"{shape} train step: CPU {cpu:.1f} us, wall {wall:.1f} us", flush=True)
        print(cprofile_top(step, calls=50, lines=12))
    layer_host_cost()


def cprofile_top(fn, *, calls: int, lines: int, sort: str = "tottime") -> str:
    """cProfile of ``calls`` calls of ``fn`` (CUDA work drained after), the top ``lines``
    functions by ``sort``."""
    import torch

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(lines)
    return s.getvalue()


def layer_host_cost(rounds: int = 7, reps: int = 200) -> None:
    """Host time per call of ``DoRALinear`` (forward; forward+backward) at a shape whose GPU
    work is microseconds (512->512, r=16, 64 tokens, bf16), so wall time is host time:
    the norm's tail kernel or its torch tail, each with the output add folded or separate,
    interleaved over ``rounds`` rounds (median and min of the rounds)."""
    import statistics

    import torch

    from ...ops.layer import DoRALinear
    from ..bench import host_path

    torch.manual_seed(0)
    layer = DoRALinear(torch.nn.Linear(512, 512, bias=False, device="cuda", dtype=torch.bfloat16), 16, 32.0,
                       compose_path="fused")  # the tier of the large shapes
    with torch.no_grad():
        layer.lora_B.normal_(0, 1e-2)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    D = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            layer(x)

    def fwd_bwd():
        layer(x).backward(D)

    configs = [(tail, fold) for tail in ("auto", "torch") for fold in (True, False)]
    times = {(tail, fold, name): [] for tail, fold in configs for name in ("fwd", "fwd_bwd")}
    for _ in range(rounds):
        for tail, fold in configs:
            with host_path(tail, fold):
                for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                    for _ in range(10):
                        fn()
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    torch.cuda.synchronize()
                    times[(tail, fold, name)].append((time.perf_counter() - t) / reps * 1e6)
    for (tail, fold, name), ts in times.items():
        label = ("tail kernel" if tail == "auto" else "torch tail") + (", add folded" if fold else ", add separate")
        print(f"DoRALinear 512->512 r=16 T=64 bf16 fused tier {name} ({label}): host "
              f"{statistics.median(ts):.1f} us median of {rounds} rounds (min {min(ts):.1f})", flush=True)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog="python -m dora_num.studies.speed.overhead",
                            description=__doc__.split("\n\n")[0]).parse_args()
    main()
