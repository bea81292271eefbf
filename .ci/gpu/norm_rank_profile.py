"""Where the factored norm's time goes by rank at one shape (a diagnostic, not a data set): bf16 W 8192 x 8192,
bf16 A and B, ranks 8 to 384; do_bench medians, then the kernels of one call at r = 16 and r = 384 (torch.profiler).
Then the tail kernel alone by rank, fp32 B as PEFT keeps it, with the rate its B @ G would imply if it were all of
the time (2 d_out r^2 flops): the test of docs/operator.md's explanation of the tail's measured 0.64 ms (B @ G
on the CUDA cores, fp32 FMA at a fraction of their peak, time growing as r^2).  Last, the tail with the guard both
ways of ``OpConfig.tail_bg`` (the fp32 dot, bf16 pieces on tensor cores), interleaved: what decides that default.
Run on the GPU: PYTHONPATH=. python3 .ci/gpu/norm_rank_profile.py OUT_DIR"""

import sys
from pathlib import Path

import torch
import triton

from dora_num.numerics.formulas import scale_constants
from dora_num.ops.kernels.norm_tail import norm_tail
from dora_num.ops.norm import factored_row_norm

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
lines = [f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}"]
d = 8192
g = torch.Generator(device="cuda").manual_seed(0)
W = (torch.randn(d, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
for r in (8, 16, 32, 64, 128, 256, 384):
    A = (torch.randn(r, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
    B = (torch.randn(d, r, device="cuda", generator=g) * 0.01).bfloat16()
    ms = triton.testing.do_bench(lambda: factored_row_norm(W, A, B, 2.0), quantiles=[0.5, 0.2, 0.8])
    lines.append(f"r={r:4d} factored_row_norm ms median {ms[0]:.4f} p20 {ms[1]:.4f} p80 {ms[2]:.4f}")
    if r in (16, 384):
        for _ in range(3):
            factored_row_norm(W, A, B, 2.0)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                factored_row_norm(W, A, B, 2.0)
            torch.cuda.synchronize()
        lines.append(f"--- r={r}: 5 calls")
        lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
_, two_s, s_sq = scale_constants(2.0)
for r in (16, 32, 64, 128, 256, 384, 512):
    B = torch.randn(d, r, device="cuda", generator=g) * 0.01
    A = torch.randn(r, d, device="cuda", generator=g) / d ** 0.5
    U, G, base = torch.randn(d, r, device="cuda", generator=g), A @ A.T, torch.rand(d, device="cuda") + 1
    ms = triton.testing.do_bench(lambda: norm_tail(U, B, G, base, two_s, s_sq), quantiles=[0.5, 0.2, 0.8])
    lines.append(f"r={r:4d} norm_tail ms median {ms[0]:.4f} p20 {ms[1]:.4f} p80 {ms[2]:.4f} "
                 f"B@G at {2 * d * r * r / ms[0] / 1e9:.1f} TFLOP/s if it were all of the time")
# the tail's B G both ways (OpConfig.tail_bg: the fp32 dot, bf16 pieces on tensor cores), with the guard as the layer
# runs it, fp32 B (PEFT's adapters) and bf16 B; interleaved rounds, the ratio within each round
from dora_num.numerics.norm_posterior import posterior_constants  # noqa: E402
from dora_num.ops.config import override  # noqa: E402

lines.append("--- tail_bg: the tail with the guard, fma (fp32 dot) against tensor_core (bf16 pieces), ms medians")
for b_dtype, fmt in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
    for r in (16, 64, 128, 256, 384, 512):
        B = (torch.randn(d, r, device="cuda", generator=g) * 0.01).to(b_dtype)
        A = torch.randn(r, d, device="cuda", generator=g) / d ** 0.5
        U, G, base = torch.randn(d, r, device="cuda", generator=g), A @ A.T, torch.rand(d, device="cuda") + 1
        got = {"fma": [], "tensor_core": []}
        for _ in range(3):
            for tail in got:
                with override(tail_bg=tail) as cfg:
                    C = posterior_constants(two_s, s_sq, d_in=d, r=r, products="tensor_core",
                                            tail_bg=fmt if tail == "tensor_core" else None)
                    got[tail].append(triton.testing.do_bench(
                        lambda: norm_tail(U, B, G, base, two_s, s_sq, guard=C, rel_max=2.0**-6, config=cfg)))
        fma, tc = (sorted(v)[1] for v in got.values())
        lines.append(f"B {fmt} r={r:4d} tail fma {fma:.4f} tensor_core {tc:.4f} ratio {tc / fma:.3f} "
                     f"(rounds fma {[round(x, 4) for x in got['fma']]} tc {[round(x, 4) for x in got['tensor_core']]})")
text = "\n".join(lines)
(out / "norm_rank_profile.txt").write_text(text + "\n")
print(text)
