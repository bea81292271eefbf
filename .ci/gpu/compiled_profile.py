"""Where a compiled step's GPU time goes: the model of notebook 05 (8B layer shapes), eager beside
``torch.compile`` (default and ``reduce-overhead``), kernel by kernel.

    python3 .ci/gpu/compiled_profile.py OUT [--layers 1] [--ranks 384] [--variants lora_fp32 peft_fp32 dora_num_fp32]

For each variant x mode x phase (train: forward + backward; infer: no_grad forward): three warm-up
steps (trace, compile, record), the step time by CUDA events (median of 5), the host time of a step
(wall clock of the enqueue, to the last launch), then ``torch.profiler`` over 2 steps: every CUDA
kernel's total time per step, by name.  Writes ``OUT/compiled_profile.json`` (all of it) and
``OUT/compiled_profile.txt`` (per config: step ms, host ms, summed kernel ms, the kernels by time).
A diagnostic (.ci/gpu/diagnostics/README.md), not a data set.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dora_num.studies.bench import lift_recompile_limits  # noqa: E402
from dora_num.studies.speed.model_variants import (SEED, Shape, adapter_state, build_base,  # noqa: E402
                                                   make_variant)
from dora_num.studies.speed.record_model import CompiledRunner, time_steps  # noqa: E402


class EagerRunner:
    def __init__(self, model, ids):
        self.model, self.ids = model, ids
        self.params = [p for p in model.parameters() if p.requires_grad]

    def train(self):
        for p in self.params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        return loss.detach()

    def infer(self):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return self.model(input_ids=self.ids).logits


def step_ms(fn, n=5):
    return statistics.median(time_steps(fn, n, "cuda"))


def host_ms(fn, n=5):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)  # enqueue time (the step returns before the GPU ends)
        torch.cuda.synchronize()
    return statistics.median(out)


def kernels(fn, steps=2):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            tot[ev.name] += ev.device_time / 1e3 / steps  # ms per step
            cnt[ev.name] += 1
    return {k: [round(tot[k], 4), cnt[k] / steps] for k in sorted(tot, key=tot.get, reverse=True)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--ranks", type=int, nargs="+", default=[384])
    p.add_argument("--variants", nargs="+", default=["lora_fp32", "peft_fp32", "dora_num_fp32"])
    p.add_argument("--modes", nargs="+", default=["eager", "default", "reduce-overhead"])
    p.add_argument("--phases", nargs="+", default=["train", "infer"])
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lift_recompile_limits()
    shape = Shape(layers=a.layers)
    base = build_base(shape, "cuda")
    res, lines = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": a.layers}, []
    for r in a.ranks:
        state = adapter_state(base, r)
        gen = torch.Generator(device="cpu").manual_seed(SEED + r)
        ids = torch.randint(0, shape.vocab, (1, shape.tokens), generator=gen).to("cuda")
        for v in a.variants:
            for mode in a.modes:
                model = make_variant(v, base, r, state)
                run = EagerRunner(model, ids) if mode == "eager" else CompiledRunner(model, ids, "cuda", mode)
                for ph in a.phases:
                    fn = getattr(run, ph)
                    t = time.time()
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    warm = time.time() - t
                    ms, hms = step_ms(fn), host_ms(fn)
                    ks = kernels(fn)
                    ksum = sum(x[0] for x in ks.values())
                    key = f"r{r} {v} {mode} {ph}"
                    res[key] = {"step_ms": ms, "host_ms": hms, "kernel_ms": ksum, "warm_s": warm, "kernels": ks}
                    lines.append(f"== {key}: step {ms:.2f} ms, host {hms:.2f} ms, kernels {ksum:.2f} ms, "
                                 f"{sum(c for _, c in ks.values()):.0f} launches, warm-up {warm:.1f} s")
                    for name, (t_ms, c) in list(ks.items())[:40]:
                        lines.append(f"   {t_ms:8.3f} ms  x{c:5.0f}  {name[:150]}")
                    print(lines[-41 if len(ks) >= 40 else -(len(ks) + 1)], flush=True)
                    (out / "compiled_profile.json").write_text(json.dumps(res, indent=1))
                    (out / "compiled_profile.txt").write_text("\n".join(lines) + "\n")
                del run, model
                torch.compiler.reset()
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
