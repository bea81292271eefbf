"""Training a DoRA model on an existing engine: DDP and FSDP2, against one process.

A model wrapped by :func:`dora_num.wrap` or accelerated by :func:`dora_num.peft.accelerate`
trains under ``torch.nn.parallel.DistributedDataParallel`` and under FSDP2
(``torch.distributed.fsdp.fully_shard``, one unit per decoder layer plus the root) with
nothing specific to this package: :class:`~dora_num.DoRALinear` is an ``nn.Module`` whose
parameters the engines shard, gather and reduce like any other.

The method in full: docs/methods.md, scaleout.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
from torch import nn

ENGINES = ("ddp", "fsdp2")
MODELS = ("wrap", "peft")
STEPS = 3
ROWS = 4  # sequences per step (2 per rank)


def build_model(kind: str) -> nn.Module:
    """The tiny Llama with DoRA on every linear: ``"wrap"`` (:func:`dora_num.wrap`) or
    ``"peft"`` (PEFT's ``get_peft_model`` + :func:`dora_num.peft.accelerate`); adapters
    perturbed deterministically so that ``g != 1`` and every gradient is non-trivial."""
    from . import wrapper
    from .adapters.peft_io import dora_linear_modules
    from .oracles import perturb_peft_dora, perturbed_adapter, tiny_hf_model

    model = tiny_hf_model("llama", seed=0)
    if kind == "wrap":
        wrapper.wrap(model, "all-linear", r=4, alpha=8, verbose=False)
        with torch.no_grad():
            for i, (_, m) in enumerate(sorted(dora_linear_modules(model).items())):
                B, mm = perturbed_adapter(m.base.weight.double(), m.lora_A.double(), m.scale, seed=10 + i)
                m.lora_B.copy_(B)
                m.magnitude.copy_(mm)
        return model.train()
    from peft import LoraConfig, get_peft_model

    from . import peft as dp

    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    perturb_peft_dora(pm, seed=10)
    report = dp.accelerate(pm, verbose=False)
    if report.kept:
        raise RuntimeError(str(report))
    return pm.train()


def decoder_layers(model: nn.Module):
    inner = model.base_model.model if hasattr(model, "base_model") and hasattr(model.base_model, "model") else model
    return inner.model.layers


def batches():
    gen = torch.Generator().manual_seed(123)
    return [torch.randint(0, 64, (ROWS, 8), generator=gen) for _ in range(STEPS)]


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=False)


def _trainable(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            t = p.detach()
            out[n.removeprefix("module.")] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def single_process(kind: str, *, accumulate: bool):
    """One process: per step, the two halves accumulated (``0.5 * loss_h``), or the whole batch."""
    model = build_model(kind)
    opt = _optimizer(model)
    losses = []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        if accumulate:
            step = []
            for h in range(2):
                loss = _loss(model, ids[2 * h:2 * h + 2])
                (0.5 * loss).backward()
                step.append(loss.item())
            losses.append(step)
        else:
            loss = _loss(model, ids)
            loss.backward()
            losses.append([loss.item()])
        opt.step()
    return losses, _trainable(model)


def _rank(rank: int, world: int, port: int, out: str):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    try:
        for kind in MODELS:
            for engine in ENGINES:
                model = build_model(kind)
                n_layers = len(decoder_layers(model))
                if engine == "ddp":
                    from torch.nn.parallel import DistributedDataParallel as DDP

                    model = DDP(model, broadcast_buffers=False)
                else:
                    from torch.distributed.device_mesh import init_device_mesh
                    from torch.distributed.fsdp import fully_shard

                    mesh = init_device_mesh("cpu", (world,))
                    for layer in decoder_layers(model):
                        fully_shard(layer, mesh=mesh)
                    fully_shard(model, mesh=mesh)
                opt = _optimizer(model)
                losses, collectives = [], {}
                for step, ids in enumerate(batches()):
                    opt.zero_grad(set_to_none=True)
                    with _count_collectives(collectives, enabled=step == STEPS - 1):
                        loss = _loss(model, ids[2 * rank:2 * rank + 2])
                        loss.backward()
                    opt.step()
                    losses.append(loss.item())
                params = _trainable(model)
                gathered = [None] * world
                dist.all_gather_object(gathered, losses)
                if rank == 0:
                    results[f"{kind}/{engine}"] = (gathered, params, collectives, n_layers)
        if rank == 0:
            report = {}
            for kind in MODELS:
                ref_losses, ref_params = single_process(kind, accumulate=True)
                full_losses, full_params = single_process(kind, accumulate=False)
                for engine in ENGINES:
                    gathered, params, collectives, n_layers = results[f"{kind}/{engine}"]
                    per_step = [[gathered[r][s] for r in range(world)] for s in range(STEPS)]
                    assert sorted(params) == sorted(ref_params)
                    report[f"{kind}/{engine}"] = {
                        "losses": per_step, "losses_one_process": ref_losses,
                        "losses_bitwise": per_step == ref_losses,
                        "params_bitwise": all(torch.equal(params[k], ref_params[k]) for k in ref_params),
                        "n_params": len(params), "n_layers": n_layers,
                        "collectives_last_step": collectives,
                        "max_abs_diff_vs_whole_batch": max(float((params[k] - full_params[k]).abs().max())
                                                           for k in full_params),
                        "max_abs_param_change": max(float((params[k] - ref_params[k]).abs().max())
                                                    for k in ref_params),
                    }
            with open(out, "w") as f:
                json.dump(report, f, indent=2)
    finally:
        dist.destroy_process_group()


class _count_collectives:
    """Count the collectives of a forward + backward (torch.profiler event names; c10d ops)."""

    NAMES = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allreduce_")

    def __init__(self, out: dict, enabled: bool):
        self.out, self.enabled, self.prof = out, enabled, None

    def __enter__(self):
        if self.enabled:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prof is not None:
            self.prof.__exit__(*exc)
            for e in self.prof.key_averages():
                if e.key in self.NAMES:
                    self.out[e.key] = e.count
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_check(out: str, world: int = 2) -> None:
    """Spawn ``world`` gloo ranks on CPU, train every (model, engine) pair, and write the
    comparison with one process to ``out`` (JSON)."""
    import torch.multiprocessing as mp

    # fork after the heavy imports (children start in milliseconds instead of re-importing
    # torch, transformers and PEFT); no torch computation has run in this process yet
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from . import peft as _dp, wrapper as _w  # noqa: F401

    torch.set_num_threads(1)
    mp.start_processes(_rank, args=(world, _free_port(), out), nprocs=world, join=True, start_method="fork")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the comparison")
    args = ap.parse_args(argv)
    run_check(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
