"""torch.distributed for the convergence harness: DDP hooks for :func:`~dora_num.adapters.train.train`.

Under ``torchrun`` each rank takes a contiguous slice of every batch
(``batch_size`` must divide by the world size), encodes it, and all-gathers the
embeddings (autograd-aware) so that every rank computes the *whole batch's*
in-batch contrastive loss, the same number a single process computes.

The method in full: docs/methods.md, studies/convergence/dist.py.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn


def dist_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's environment (``(0, 1, 0)`` without it)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's ``[n_r, d]`` slice (equal ``n_r``) in rank order.

    Backward: the gradient of the gathered tensor is summed over ranks (all-reduce,
    gloo and nccl both have it) and each rank keeps its own slice.
    """

    @staticmethod
    def forward(ctx, x):
        world = dist.get_world_size()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n]


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return _AllGather.apply(x)


def shard_fn(rank: int, world: int):
    """``indices -> this rank's contiguous slice`` (the batch must split evenly)."""

    def shard(idx):
        n = len(idx)
        if n % world:
            raise ValueError(f"batch_size={n} must be divisible by the world size {world}")
        k = n // world
        return idx[rank * k : (rank + 1) * k]

    return shard


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every ``nn.Dropout`` of ``model`` to ``p = 0`` (BERT's attention reads its module's ``p``)."""
    for mod in model.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    return model
