"""The PEFT user's story: a DoRA adapter trained with PEFT (fp32 A, B, m: PEFT's
``autocast_adapter_dtype=True``; a ``modules_to_save`` classifier head) loaded into the
same bf16 base with this package's loader.

What went wrong before (measured by a new user): A and B were created in W's dtype and
the adapter rounded to bf16, so after 5 AdamW steps at lr 1e-4 47.9% of the ``lora_A``
entries had not changed at all (an update of ~1e-4 is below half a bf16 ulp of entries
~0.1); the classifier head was dropped without a word, so the logits differed
completely from PEFT's.  This test uses only the loader's public API as it stood then
(``load_peft_dora`` + ``apply_to_model``) so that it shows the failure on that code.

Logits tolerance (flash-attention's criterion, as ``tests/ops/test_layer_vs_peft.py``):
with the fp64 evaluation ``ref`` (PEFT's own model run in float64, the same function),
``e_peft = max|peft - ref|``, ``e_ours = max|ours - ref|``: ``e_ours <= 2 e_peft + u_bf16
max|ref|`` (no less accurate than PEFT up to a factor 2, plus one bf16 rounding of the
largest logit), and ``max|ours - peft| <= 3 e_peft + u_bf16 max|ref|``.
"""

import copy

import torch
from torch import nn

from dora_num.adapters.peft_io import apply_to_model, load_peft_dora

U_BF16 = 2.0**-8


def _base(seed=0):
    import transformers as tf

    cfg = tf.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_labels=3, max_position_embeddings=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    return tf.BertForSequenceClassification(cfg).to(torch.bfloat16).eval()


def _peft_adapter(tmp_path):
    """A PEFT DoRA adapter on the bf16 base, trained-looking (B, m and the head perturbed), saved."""
    from peft import LoraConfig, TaskType, get_peft_model

    pm = get_peft_model(_base(), LoraConfig(r=4, lora_alpha=8, use_dora=True, task_type=TaskType.SEQ_CLS,
                                            target_modules=["query", "value", "dense"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            elif "lora_magnitude_vector" in n:
                p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=gen))
            elif "modules_to_save" in n:
                p.add_(0.5 * torch.randn(p.shape, generator=gen).to(p.dtype))
    pm.save_pretrained(str(tmp_path / "adapter"))
    return pm.eval(), tmp_path / "adapter"


def _batch(seed=2):
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 64, (4, 9), generator=gen),
            "attention_mask": torch.ones(4, 9, dtype=torch.long),
            "labels": torch.randint(0, 3, (4,), generator=gen)}


def _adamw_unchanged_fraction(model, batch, steps=5, lr=1e-4):
    """Fraction of lora_A entries that 5 AdamW steps (lr 1e-4) left exactly unchanged."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    A = [p for n, p in model.named_parameters() if "lora_A" in n]
    before = [a.detach().clone() for a in A]
    for _ in range(steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    same = sum(int((a.detach() == b).sum()) for a, b in zip(A, before))
    return same / sum(a.numel() for a in A)


def test_peft_adapter_into_bf16_base_trains_and_predicts_like_peft(tmp_path):
    pm, adir = _peft_adapter(tmp_path)
    ours = apply_to_model(_base(), load_peft_dora(adir, _base()))
    ours.eval()

    # adapters kept as PEFT keeps them
    dora = [m for m in ours.modules() if hasattr(m, "lora_A") and isinstance(m.lora_A, nn.Parameter)]
    assert len(dora) == 2 * 5 + 1  # 2 layers x (query, value, attention/intermediate/output dense) + pooler
    assert all(m.lora_A.dtype == m.lora_B.dtype == m.magnitude.dtype == torch.float32 for m in dora)

    # logits: the classifier head is applied, ours within the oracle-derived tolerance of PEFT's
    batch = {k: v for k, v in _batch().items() if k != "labels"}
    with torch.no_grad():
        ref = copy.deepcopy(pm).double()(**batch).logits
        peft_logits = pm(**batch).logits.double()
        our_logits = ours(**batch).logits.double()
    scale = float(ref.abs().max())
    e_peft = float((peft_logits - ref).abs().max())
    e_ours = float((our_logits - ref).abs().max())
    d = float((our_logits - peft_logits).abs().max())
    floor = U_BF16 * scale
    assert e_ours <= 2 * e_peft + floor, (e_ours, e_peft, floor)
    assert d <= 3 * e_peft + floor, (d, e_peft, floor)

    # training: every lora_A entry moves, as with PEFT (0% unchanged)
    batch = _batch()
    frac_peft = _adamw_unchanged_fraction(copy.deepcopy(pm), batch)
    frac_ours = _adamw_unchanged_fraction(ours, batch)
    assert frac_peft == 0.0
    assert frac_ours == frac_peft, f"{100 * frac_ours:.1f}% of lora_A entries unchanged after 5 AdamW steps"
