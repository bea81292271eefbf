"""Host-side (CPU) cost of the fused compose tier: why the training step is launch-bound.

``python -m dora_num.studies.bench_overhead`` on a CUDA machine prints the CPU time
per call of the fused forward and backward launchers and of one autograd training
step through :class:`~dora_num.ops.compose.ComposeFunction`, and a cProfile of
the step.  Recorded on the H200 host (2026-11-29, torch 2.11, triton 3.6, git
a4ce237; ``data/gpu/host_overhead.log``): fused forward 31 us of CPU per call,
fused backward 65 us (one launch: dg's stage 2 runs inside it), a training step
301 us of CPU (324 us wall) against ~0.28 ms of GPU work at 8192x8192 bf16.  An
earlier probe (git aab0061, three launches, a busier host) read 66 / 143 / 525 us.
So up to ~16384x8192 the fused training step timed one at a time is bound by the
host, not by memory bandwidth (``bench_train_graphs`` times it without the host).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time


def main() -> None:
    import torch

    from ..ops.compose import ComposeFunction
    from ..ops.kernels import compose as kc

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
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            step()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        print(s.getvalue())


if __name__ == "__main__":
    main()
