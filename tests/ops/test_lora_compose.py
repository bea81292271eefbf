"""The up-projection and the compose as one node that keeps ``x A^T`` instead of ``lora``
(:mod:`dora_num.ops.lora_compose`, ``OpConfig.recompute_lora``): every output and gradient bitwise the
unfused path's, fewer bytes saved for the backward."""

from __future__ import annotations

import pytest
import torch

from dora_num.ops.config import override

from .kernels.helpers import assert_bitwise

CASES = {  # id: (base dtype, adapter dtype, autocast dtype or None)
    "fp32": (torch.float32, torch.float32, None),
    "bf16-autocast-fp32-adapters": (torch.bfloat16, torch.float32, torch.bfloat16),
    "fp32-autocast-bf16": (torch.float32, torch.float32, torch.bfloat16),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
}


def _run(small_layer, case, recompute, *, bias=False, dropout=0.0, batched=False, base_out=False, seed=0,
         path="auto"):
    wdt, adt, ac = CASES[case]
    layer = small_layer(dtype=wdt, adapter_dtype=adt if adt != torch.float32 else None, bias=bias, seed=seed,
                        m_noise=1e-3, lora_dropout=dropout, compose_path=path)
    shape = (2, 3, 40) if batched else (6, 40)
    x = torch.randn(shape, dtype=wdt).requires_grad_(True)
    with override(recompute_lora=recompute), torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
        torch.manual_seed(seed + 1)  # the dropout mask
        if base_out:
            y = layer(x, base_out=torch.nn.functional.linear(x, layer.base.weight, layer.base.bias))
        else:
            y = layer(x)
    y.float().square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in (layer.magnitude, layer.lora_A, layer.lora_B)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", ["plain", "bias", "dropout", "batched", "base_out"])
def test_one_node_gives_the_unfused_bits(case, variant, small_layer):
    kw = {"bias": dict(bias=True), "dropout": dict(dropout=0.3), "batched": dict(batched=True),
          "base_out": dict(base_out=True, bias=True), "plain": {}}[variant]
    for a, b in zip(_run(small_layer, case, True, **kw), _run(small_layer, case, False, **kw)):
        assert_bitwise(a, b)


@pytest.mark.interpreter
def test_one_node_on_the_fused_tier(small_layer):
    for a, b in zip(_run(small_layer, "fp32", True, path="fused"), _run(small_layer, "fp32", False, path="fused")):
        assert_bitwise(a, b)


def _saved_bytes(small_layer, case, recompute, T=64):
    wdt, adt, ac = CASES[case]
    layer = small_layer(256, 512, rank=8, dtype=wdt, adapter_dtype=adt if adt != torch.float32 else None)
    x = torch.randn(T, 256, dtype=wdt)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), override(recompute_lora=recompute), \
            torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
        layer(x)
    return sum(seen.values())


@pytest.mark.parametrize("case", ["bf16-autocast-fp32-adapters", "bf16"])
def test_one_node_saves_less(case, small_layer):
    """Bytes of the distinct storages saved for the backward (T = 64, d_out = 512, r = 8): without
    the node the compose keeps fp32 ``inner`` (the eager tier: 4 bytes per output element); with it,
    ``base`` in the activation dtype (2 bytes): half the output-sized bytes."""
    before, after = _saved_bytes(small_layer, case, False), _saved_bytes(small_layer, case, True)
    assert before - after == 64 * 512 * 2, (before, after)


def test_compiled_node_is_a_registered_custom_op():
    """Under torch.compile the node is ``dora_num::lora_compose_fwd`` (tests/ops/test_compiled.py
    compiles the layer through it); its schema, fake tensor and autograd registration."""
    from dora_num.ops.config import get_config

    torch.manual_seed(0)
    base, xa, B = torch.randn(6, 24), torch.randn(6, 4, requires_grad=True), torch.randn(24, 4, requires_grad=True)
    g = (1 + 1e-3 * torch.randn(24)).requires_grad_(True)
    for add_base in (False, True):  # the output add in the compose's pass, or not
        torch.library.opcheck(torch.ops.dora_num.lora_compose_fwd.default,
                              (base, xa, B, g, 0.5, False, add_base, get_config().key),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
