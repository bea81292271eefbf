"""``torch.compile`` of a PEFT model accelerated by :func:`dora_num.peft.accelerate`, and the input cast
it skips: one graph (fullgraph), the eager accelerated model's bits, the layers' running flags.

The CPU cases trace with ``backend="aot_eager"`` (the same AOT graphs Inductor receives, run by the
eager kernels: bitwise comparable with eager, and 4x faster to build than Inductor's CPU code for a
whole model); the layer-level Inductor cases are tests/ops/test_compiled.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dora_num as dn
import dora_num.peft as dp
from dora_num.oracles import perturb_peft_dora, tiny_hf_model



def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    ints = {2: torch.int16, 4: torch.int32}
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _accelerated(dtype=torch.float32, seed=0, **fields):
    from peft import LoraConfig, get_peft_model

    cfg = dict(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear")
    cfg.update(fields)
    pm = get_peft_model(tiny_hf_model("llama", seed=seed).to(dtype), LoraConfig(**cfg))
    perturb_peft_dora(pm, seed=seed + 100)
    dp.accelerate(pm, verbose=False)
    return pm


def _step(model, pm, ids, autocast=False):
    for p in pm.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().clone(), {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_accelerated_peft_model_compiles_to_one_graph():
    pm = _accelerated().train()
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    want = _step(pm, pm, ids)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(pm, fullgraph=True, backend=cnt)
    for _ in range(2):
        got = _step(compiled, pm, ids)
    assert cnt.frame_count == 1
    assert_bitwise(got[0], want[0])
    assert got[1].keys() == want[1].keys() and len(want[1]) == 42
    for k in want[1]:
        assert_bitwise(got[1][k], want[1][k])
    assert dn.check_flags(pm) == 14  # every served projection has a flag, and none is set


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-base", "bf16-autocast"])
def test_skipped_input_cast_changes_no_bit(autocast):
    """PEFT casts x to the fp32 adapters' dtype before the variant; on served layers without dropout
    accelerate skips that cast (under autocast the LoRA products cast x back; without it the layer
    casts x itself, exactly): the logits and every gradient stay bitwise those with the cast."""
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    pm = _accelerated(torch.bfloat16).train()
    served = [m for m in pm.modules() if hasattr(m, "_dora_num_cast_input_dtype")]
    assert len(served) == 14 and not any(m.cast_input_dtype_enabled for m in served)
    skipped = _step(pm, pm, ids, autocast)
    for m in served:
        m.cast_input_dtype_enabled = True
    cast = _step(pm, pm, ids, autocast)
    assert_bitwise(skipped[0], cast[0])
    for k in cast[1]:
        assert_bitwise(skipped[1][k], cast[1][k])
    dp.restore(pm)
    assert all(m.cast_input_dtype_enabled for m in served)
    assert not any(hasattr(m, "_dora_num_cast_input_dtype") for m in served)


def test_input_cast_kept_with_dropout_and_on_the_fallback():
    """With dropout the cast stays (dropout of fp32 and of bf16 inputs differ); a call PEFT serves
    itself (two active adapters) gets the cast this package skipped."""
    pm = _accelerated(torch.bfloat16, lora_dropout=0.1)
    assert all(m.cast_input_dtype_enabled for m in pm.modules() if hasattr(m, "_dora_num_cast_input_dtype"))
    pm = _accelerated(torch.bfloat16)
    from peft import LoraConfig

    pm.add_adapter("other", LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    dp.accelerate(pm, verbose=False)
    pm.base_model.set_adapter(["default", "other"])
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = pm(input_ids=ids).logits
    assert bool(torch.isfinite(out).all())
