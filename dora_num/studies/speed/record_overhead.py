"""Host-side (CPU) cost of the fused compose tier: why the training step is launch-bound.

The method in full: docs/methods.md, studies/speed/record_overhead.py.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch

from ...ops.compose import ComposeFunction
from ...ops.kernels import compose as kc
from ...ops.layer import DoRALinear
from ...repro import recording as recorded
from ..bench import host_path
from ...repro.recording import parser as recorder_parser
from .datasets import OVERHEAD

LOG = OVERHEAD.filename()


def measure(emit=print, *, smoke: bool = False) -> None:
    """The probe; every result line goes to ``emit`` (``smoke``: the small shape only, few rounds)."""
    for shape in ((64, 512),) if smoke else ((64, 512), (8192, 8192)):
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
            emit(f"{shape} {name}: CPU {cpu:.1f} us/call")
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
        emit(f"{shape} train step: CPU {cpu:.1f} us, wall {wall:.1f} us")
        emit(cprofile_top(step, calls=50, lines=12))
    layer_host_cost(emit=emit, **(dict(rounds=1, reps=20) if smoke else {}))


def cprofile_top(fn, *, calls: int, lines: int, sort: str = "tottime") -> str:
    """cProfile of ``calls`` calls of ``fn`` (CUDA work drained after), the top ``lines``
    functions by ``sort``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(lines)
    return s.getvalue()


def layer_host_cost(rounds: int = 7, reps: int = 200, emit=print) -> None:
    """Host time per call of ``DoRALinear`` (forward; forward+backward) at a shape whose GPU
    work is microseconds (512->512, r=16, 64 tokens, bf16), so wall time is host time:
    the norm's tail kernel or its torch tail, each with the output add folded or separate,
    interleaved over ``rounds`` rounds (median and min of the rounds)."""
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
        emit(f"DoRALinear 512->512 r=16 T=64 bf16 fused tier {name} ({label}): host "
             f"{statistics.median(ts):.1f} us median of {rounds} rounds (min {min(ts):.1f})")


def build_parser(prog: str = "dora-num record overhead", name: str = "overhead"):
    return recorder_parser(prog, __doc__, smoke="the small shape only, few rounds (a check of the probe)",
                           out=f"also write {LOG} and {recorded.MACHINE_FILE} into this folder", out_required=False)


def ingest_args(a) -> list[Path]:
    return recorded.ingest_folder(a.ingest, a.out or OVERHEAD.dest(), producer=OVERHEAD.producer, names=(LOG,),
                                  git_sha=a.git_sha)


def record(a) -> int:
    from ...repro.recording import require_cuda

    require_cuda("overhead", torch.cuda.is_available())
    lines = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    measure(emit, smoke=a.smoke)
    if a.out is not None:
        recorded.write_machine(a.out, recorded.describe_machine(a.git_sha, smoke=a.smoke))
        (a.out / LOG).write_text("\n".join(lines) + "\n")
    return 0
