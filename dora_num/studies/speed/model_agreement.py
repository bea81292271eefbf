"""Fidelity of the model level: each variant's logits and loss under bf16 autocast against a float64
evaluation of the fp32 adapter (:class:`dora_num.oracles.DoRALinearRef64` in every projection).

A variant is faithful when its rms relative logit error ``e <= e_peft + e_floor`` (PEFT's error at
the same adapter dtype, plus the frozen bf16 model's own error against fp64: what bf16 activations
alone cost) and its loss lies within ``2 max|logits - logits_ref|`` of the reference loss (mean
cross-entropy is 2-Lipschitz in the max-norm of the logits); the row ``no_adapter`` shows the
tolerance is tighter than the adapter's effect.
"""

from __future__ import annotations

import copy

import torch

from .model_variants import SEED, SMALL, TARGET_MODULES, Shape, adapter_state, build_base, make_variant


def _errors(logits, loss, ref_logits, ref_loss) -> dict:
    d = (logits.double() - ref_logits.double())
    scale = ref_logits.double().abs().max().clamp_min(1e-300)
    rms = d.pow(2).mean().sqrt() / ref_logits.double().pow(2).mean().sqrt().clamp_min(1e-300)
    return {"loss": float(loss), "loss_ref": float(ref_loss), "loss_abs_err": abs(float(loss) - float(ref_loss)),
            "logits_max_abs_err": float(d.abs().max()), "logits_max_rel_err": float(d.abs().max() / scale),
            "logits_rms_rel_err": float(rms)}


def full_size_agreement(runners: dict, device: str, r: int) -> list[dict]:
    """At full size (no fp64 reference there): each variant's loss and logits against PEFT's of
    the same adapter dtype (one forward, bf16 autocast, the same inputs)."""
    out = {}
    for v, run in runners.items():
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            res = run.model(input_ids=run.ids, labels=run.ids)
        out[v] = (res.logits.float(), float(res.loss))
    rows = []
    for v, (logits, loss) in out.items():
        ref = "peft_bf16" if v.endswith("bf16") else "peft_fp32"
        if ref not in out or v == ref:
            continue
        rows.append({"scope": "full_vs_peft", "variant": v, "reference": ref, "rank": r,
                     **_errors(logits, loss, *out[ref])})
    return rows


def _ref64_model(base, state: dict, r: int):
    """Float64 copy of ``base`` with :class:`~dora_num.oracles.DoRALinearRef64` in every projection
    (the fp32 adapter's values, exactly)."""
    from ...oracles import DoRALinearRef64

    ref = copy.deepcopy(base).double()
    s = 2.0 * r / r  # alpha / r
    for name, mod in list(ref.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in TARGET_MODULES:
            continue
        key = f"base_model.model.{name}"
        A, B, m = (state[f"{key}.{k}.default.weight"] for k in ("lora_A", "lora_B", "lora_magnitude_vector"))
        parent = ref.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, leaf, DoRALinearRef64(mod.weight, mod.bias, A, B, m, s))
    return ref


def agreement(device: str, ranks=(8,), shape: Shape = SMALL) -> list[dict]:
    """Loss and logits of every adapter variant (bf16 autocast) and of the frozen bf16 model
    against fp64 evaluations of the same weights (small copy): module docstring."""
    rows = []
    base = build_base(shape, device, seed=SEED + 7)
    gen = torch.Generator(device="cpu").manual_seed(SEED + 8)
    ids = torch.randint(0, shape.vocab, (1, shape.tokens), generator=gen).to(device)
    with torch.no_grad():
        frozen64 = copy.deepcopy(base).double()
        f_ref = frozen64(input_ids=ids, labels=ids)
        with torch.autocast(device, dtype=torch.bfloat16):
            f_bf = base(input_ids=ids, labels=ids)
    floor = _errors(f_bf.logits, f_bf.loss, f_ref.logits, f_ref.loss)
    rows.append({"scope": "small_vs_fp64", "variant": "frozen", "reference": "fp64", "rank": 0, **floor})
    for r in ranks:
        state = adapter_state(base, r, seed=SEED + 9, rel=AGREEMENT_REL, m_noise=AGREEMENT_M_NOISE)
        with torch.no_grad():
            ref = _ref64_model(base, state, r)(input_ids=ids, labels=ids)
        errs = {"no_adapter": _errors(f_bf.logits, f_bf.loss, ref.logits, ref.loss)}  # the tolerance's foil
        for v in ("peft_fp32", "dora_num_fp32", "peft_bf16", "dora_num_bf16"):
            model = make_variant(v, base, r, state).eval()
            with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
                res = model(input_ids=ids, labels=ids)
            errs[v] = _errors(res.logits, res.loss, ref.logits, ref.loss)
            del model
        for v, e in errs.items():
            peft = errs["peft_fp32" if v == "no_adapter" else "peft_" + v.rsplit("_", 1)[1]]
            tol = peft["logits_rms_rel_err"] + floor["logits_rms_rel_err"]
            # mean cross-entropy is 2-Lipschitz in the max-norm of the logits (its gradient
            # softmax - onehot has l1 norm <= 2 per token): the loss must follow its logits
            tol_loss = 2 * e["logits_max_abs_err"]
            rows.append({"scope": "small_vs_fp64", "variant": v, "reference": "fp64_fp32_adapter", "rank": r, **e,
                         "tol_logits_rms_rel_err": tol, "tol_loss_abs_err": tol_loss,
                         "faithful": bool(e["logits_rms_rel_err"] <= tol and e["loss_abs_err"] <= tol_loss)})
    return rows


# The agreement copy's adapter: ||sBA|| = 10% of ||W||, m 1% off ||W + sBA||, so that its effect on
# the logits stands well above the bf16 floor (at 1% / 0.1% it was 1-3x the floor on the CPU copy).
AGREEMENT_REL, AGREEMENT_M_NOISE = 0.1, 1e-2
