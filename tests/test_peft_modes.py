"""The accelerated PEFT model in every mode a PEFT user touches: PEFT's own training/eval semantics.

PEFT's ``DoraLinearVariant.forward`` applies dropout only where the LoRA *layer* is training (and its
dropout is not ``nn.Identity``), and then in the dropout module's own mode, with the compose's base
recomputed from the dropped input.  The two flags disagree after ``model.eval()`` followed by
``add_adapter(..., lora_dropout=0.1)`` or ``load_adapter(..., is_trainable=True)`` (a new dropout
module starts in training mode), and after ``model.train()`` with a dropout module put in eval.

Each sequence runs on a PEFT model and on an accelerated copy, the same RNG state before each
call (so dropout draws the same masks), on the real MiniLM and on the tiny Llama.  With the dense
norm (``accelerate(..., norm="dense")``) the accelerated model is PEFT's arithmetic
(tests/test_peft.py), so every output is held to PEFT's bit for bit: a dropout applied where PEFT
applies none (or the other way round) changes the output by 1-26%, and a base not recomputed where
PEFT recomputes it by rounding.  With the default norm the outputs are held to PEFT's through the
fp64 oracle (tests/test_peft.py's per-tensor criterion); that is checked for the sequence of the
report (eval, add an adapter with dropout, set it), where no dropout runs (the oracle has none).
Every forward is also checked to have gone through dora_num's compose.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dora_num.peft as dp
from dora_num.ops import compose as C
from dora_num.oracles import peft_model_ref64, perturb_peft_dora, tiny_hf_model
from test_peft import TENSOR_FACTOR, U

KINDS = {  # (base model builder, target modules, vocabulary for random ids)
    "minilm": (lambda: _minilm(), ["query", "key", "value", "dense"], 1000),
    "llama": (lambda: tiny_hf_model("llama"), "all-linear", 64),
}


def _minilm():
    from dora_num.adapters.model import load_base_model

    return load_base_model()[0]


def _config(kind, **fields):
    from peft import LoraConfig

    return LoraConfig(**{**dict(r=4, lora_alpha=8, use_dora=True, target_modules=KINDS[kind][1]), **fields})


def _pair(kind, **fields):
    """A PEFT model (trained-looking adapter, eval mode) and an accelerated deep copy (dense norm)."""
    from peft import get_peft_model

    pm = get_peft_model(KINDS[kind][0](), _config(kind, **fields))
    perturb_peft_dora(pm, seed=10)
    pm.eval()
    acc = copy.deepcopy(pm)
    dp.accelerate(acc, verbose=False, norm="dense")
    return pm, acc


def _batch(kind):
    ids = torch.randint(0, KINDS[kind][2], (2, 9), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _out(model, batch, seed):
    torch.manual_seed(seed)
    out = model(**batch)
    return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits).detach()


def _served_layers(model) -> int:
    """The LoRA layers whose active adapter is accelerated (each makes one dora_num compose call)."""
    from peft.tuners.lora.layer import LoraLayer

    return sum(1 for _, mod in model.named_modules()
               if isinstance(mod, LoraLayer) and dp.is_accelerated(mod, mod.active_adapters[0]))


def _check(pm, acc, batch, *, seed=0, served=True):
    """The accelerated model's output is PEFT's, bit for bit (dense norm), under the same RNG state;
    ``served``: every DoRA layer went through dora_num's compose (else none did)."""
    with torch.no_grad():
        C.reset_dispatch_counts()
        got = _out(acc, batch, seed)
        calls = sum(C.dispatch_counts().values())
        want = _out(pm, batch, seed)
    assert calls == (_served_layers(acc) if served else 0) and (calls or not served), calls
    assert torch.equal(got, want), float((got - want).norm() / want.norm())
    return got


def _same_new_adapter(models, kind, name, seed, **fields):
    """``add_adapter`` on each model with the same initial A (PEFT draws it from the global RNG), then
    the same trained-looking B and m."""
    for m in models:
        torch.manual_seed(seed)
        m.add_adapter(name, _config(kind, **fields))
        perturb_peft_dora(m, seed=20)


@pytest.mark.parametrize("kind", list(KINDS))
def test_eval_then_add_adapter_with_dropout_then_set_adapter(kind):
    """The report's sequence: no dropout in eval (PEFT reads the layer's flag; the new dropout module
    is in training mode), so two identical calls agree and agree with PEFT."""
    pm, acc = _pair(kind)
    batch = _batch(kind)
    for m in (pm, acc):
        m.eval()
    _same_new_adapter((pm, acc), kind, "other", seed=3, lora_dropout=0.1)
    for m in (pm, acc):
        m.set_adapter("other")
    dp.accelerate(acc, verbose=False, norm="dense")  # (adapters added later are picked up too: test_peft.py)
    drops = [d for n, d in acc.named_modules() if n.endswith("lora_dropout.other")]
    assert not acc.training and drops and all(d.training for d in drops)  # the two flags disagree
    first = _check(pm, acc, batch, seed=0)
    assert torch.equal(first, _check(pm, acc, batch, seed=1))  # no dropout: the RNG state does not matter


@pytest.mark.parametrize("kind", list(KINDS))
def test_eval_then_load_adapter_trainable(kind, tmp_path):
    """``load_adapter(..., is_trainable=True)`` leaves the model's mode alone (eval) and its new dropout
    modules in training mode: PEFT runs no dropout; neither does the accelerated model."""
    from peft import get_peft_model

    torch.manual_seed(5)
    donor = get_peft_model(KINDS[kind][0](), _config(kind, lora_dropout=0.2))
    perturb_peft_dora(donor, seed=30)
    donor.save_pretrained(str(tmp_path / "donor"))
    pm, acc = _pair(kind)
    batch = _batch(kind)
    for m in (pm, acc):
        m.eval()
        m.load_adapter(str(tmp_path / "donor"), "loaded", is_trainable=True)
        m.set_adapter("loaded")
    dp.accelerate(acc, verbose=False, norm="dense")
    assert not pm.training and any(d.training for n, d in pm.named_modules() if n.endswith("lora_dropout.loaded"))
    first = _check(pm, acc, batch, seed=0)
    assert torch.equal(first, _check(pm, acc, batch, seed=1))


@pytest.mark.parametrize("kind", list(KINDS))
def test_train_eval_toggles_with_dropout(kind):
    """train (dropout on: PEFT's masks, the compose's base recomputed from the dropped input), eval
    (off), train, eval: PEFT's output at every step."""
    pm, acc = _pair(kind, lora_dropout=0.3)
    batch = _batch(kind)
    outs = []
    for mode in ("train", "eval", "train", "eval"):
        for m in (pm, acc):
            getattr(m, mode)()
        outs.append(_check(pm, acc, batch, seed=len(outs)))
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[3])  # dropout ran in training only


@pytest.mark.parametrize("kind", list(KINDS))
def test_training_layer_with_its_dropout_module_in_eval(kind):
    """The other disagreement: the LoRA layer training, its dropout module in eval.  PEFT takes its
    training branch (``x = dropout(x)``, the identity here, and the compose's base recomputed as
    ``x W^T`` instead of ``result - b``): bitwise the same here only if the accelerated model does too."""
    pm, acc = _pair(kind, lora_dropout=0.3)
    batch = _batch(kind)
    for m in (pm, acc):
        m.train()
        for n, d in m.named_modules():
            if n.endswith("lora_dropout.default"):
                d.eval()
    _check(pm, acc, batch)


@pytest.mark.parametrize("kind", list(KINDS))
def test_inference_modes(kind):
    """PEFT's ``inference_mode=True`` (adapters frozen), ``torch.inference_mode()`` and ``no_grad``, then
    a training step after them: outputs PEFT's, and the gradients of every A and B too (those of m differ
    by the order of the ``dg`` sum: tests/test_peft.py)."""
    pm, acc = _pair(kind, lora_dropout=0.1, inference_mode=True)
    batch = _batch(kind)
    assert not any(p.requires_grad for n, p in acc.named_parameters() if "lora_" in n)
    _check(pm, acc, batch)
    for m in (pm, acc):
        m.train()
    with torch.inference_mode():
        _check(pm, acc, batch, seed=1)  # (the caches filled here are inference tensors)
    grads = []
    for m in (acc, pm):
        m.set_requires_grad("default", requires_grad=True)
        torch.manual_seed(2)
        out = m(**batch)
        (out.last_hidden_state if kind == "minilm" else out.logits).square().mean().backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if "lora_A" in n or "lora_B" in n})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.parametrize("kind", list(KINDS))
def test_disable_adapter_in_training_and_eval(kind):
    """``with disable_adapter():`` PEFT's base model, bitwise (no dora_num call), in training with dropout
    and in eval; after it the adapter is served by dora_num again."""
    pm, acc = _pair(kind, lora_dropout=0.3)
    batch = _batch(kind)
    for mode in ("train", "eval"):
        for m in (pm, acc):
            getattr(m, mode)()
        with acc.disable_adapter(), pm.disable_adapter():
            _check(pm, acc, batch, served=False)
        _check(pm, acc, batch, seed=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_report_sequence_with_the_default_norm(kind, device):
    """eval, ``add_adapter(..., lora_dropout=0.1)``, ``set_adapter``, default (factored, cached) norm: two
    identical calls give the same output and it is held to PEFT's by the fp64 oracle (per tensor:
    ``F_acc <= 4 F_peft + u ||ref||_F``, tests/test_peft.py)."""
    from peft import get_peft_model

    pm = get_peft_model(KINDS[kind][0](), _config(kind))
    perturb_peft_dora(pm, seed=10)
    acc = copy.deepcopy(pm)
    dp.accelerate(acc, verbose=False)
    for m in (pm, acc):
        m.eval()
    _same_new_adapter((pm, acc), kind, "other", seed=3, lora_dropout=0.1)
    for m in (pm, acc):
        m.set_adapter("other")
        m.to(device)
    dp.accelerate(acc, verbose=False)
    batch = {k: v.to(device) for k, v in _batch(kind).items()}
    with torch.no_grad():
        got, again, want = _out(acc, batch, 0), _out(acc, batch, 1), _out(pm, batch, 0)
        ref = _out(peft_model_ref64(pm), batch, 0)
        if device == "cuda":
            import dora_num as dn

            dn.check_pending()
    assert torch.equal(got, again)
    f_acc, f_peft = float((got.double() - ref).norm()), float((want.double() - ref).norm())
    assert f_acc <= TENSOR_FACTOR * f_peft + U["fp32"] * float(ref.norm()), (f_acc, f_peft)
