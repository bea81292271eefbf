"""Builders of the adapter tests (a helper module, imported by the tests and by
conftest.py): a tiny two-linear model wrapped by DoRALinear with non-trivial
(trained-looking) A, B, m."""

import copy

import torch
from torch import nn

from dora_num.ops.layer import DoRALinear

D_IN, D_HID, D_OUT, RANK = 12, 7, 20, 3  # odd, non-power-of-two shapes


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleDict({"q": nn.Linear(D_IN, D_HID), "up": nn.Linear(D_HID, D_OUT)})

    def forward(self, x):
        return self.encoder["up"](torch.relu(self.encoder["q"](x)))


def make_base(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


@torch.no_grad()
def make_dora(base: Tiny, *, seed: int = 1, rank: int = RANK, alpha: float = 5.0, use_rslora: bool = False) -> Tiny:
    """Wrap both linears of a copy of ``base`` by DoRALinear with random B and |g - 1| ~ 1e-2."""
    model = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(seed)
    for name in ("q", "up"):
        mod = DoRALinear.from_linear(model.encoder[name], rank, alpha, use_rslora=use_rslora)
        mod.lora_A.copy_(torch.randn(mod.lora_A.shape, generator=gen) * 0.3)
        mod.lora_B.copy_(torch.randn(mod.lora_B.shape, generator=gen) * 0.1)
        mod.magnitude.mul_(1 + 0.01 * torch.randn(mod.magnitude.shape, generator=gen))
        model.encoder[name] = mod
    return model
