"""The model level of notebook 05: a Llama-architecture decoder at 8B layer shapes, its adapter variants
(PEFT's DoRA in fp32/bf16, the same adapter on this operator, plain LoRA, the frozen model), one
training or inference step of each, and the time each should take by a traffic/flop model.

Variants share the base weights and the adapter values (:func:`adapter_state`); ``dora_num_*`` is
PEFT's model with every DoRA layer accelerated (:func:`accelerate`).  :func:`predict` is the floor
the measured times are judged against.  Timing: :mod:`.record_model`; fidelity: :mod:`.model_agreement`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ...ops.config import override


TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


VARIANTS = ("peft_fp32", "dora_num_fp32", "peft_bf16", "dora_num_bf16", "lora_fp32", "frozen")


MODES = ("train", "train_opt", "infer", "infer_cold")


SEED = 20261201


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    layers: int = 4
    tokens: int = 4096
    vocab: int = 32000

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                           num_hidden_layers=self.layers, vocab_size=self.vocab,
                           max_position_embeddings=max(self.tokens, 128), attn_implementation="sdpa",
                           tie_word_embeddings=False)

    def projections(self) -> dict[str, tuple[int, int]]:
        """``name -> (d_in, d_out)`` of the 7 projections of one layer."""
        h, i, kv = self.hidden, self.intermediate, self.hidden // self.heads * self.kv_heads
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


FULL = Shape()


SMALL = Shape(hidden=64, intermediate=160, heads=4, kv_heads=2, layers=2, tokens=48, vocab=128)  # agreement copy


SMOKE = Shape(hidden=64, intermediate=160, heads=4, kv_heads=2, layers=2, tokens=64, vocab=128)


RANKS = (16, 64, 384)


SMOKE_RANKS = (4, 8)


def build_base(shape: Shape, device: str, seed: int = SEED):
    """``LlamaForCausalLM`` with random bf16 weights (nothing downloads)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(shape.config())
    return model.to(torch.bfloat16).train()


def _lora_config(r: int, use_dora: bool):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, use_dora=use_dora, target_modules=list(TARGET_MODULES),
                      lora_dropout=0.0)


def adapter_state(base, r: int, seed: int = SEED + 1, *, rel: float = 1e-2, m_noise: float = 1e-3
                  ) -> dict[str, torch.Tensor]:
    """One fp32 DoRA adapter for ``base``: PEFT's initial A, a random B (``||s B A|| = rel ||W||``
    per row) and ``m = ||W + s B A||_row (1 + m_noise N(0, 1))``, keyed by PEFT's parameter
    names (so every variant loads the same values)."""
    from peft import get_peft_model

    pm = get_peft_model(copy.deepcopy(base), _lora_config(r, True))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    state = {}
    for name, mod in pm.named_modules():
        if not hasattr(mod, "lora_magnitude_vector") or "default" not in getattr(mod, "lora_A", {}):
            continue
        W = mod.base_layer.weight.detach().float()
        A = mod.lora_A["default"].weight.detach().float()
        s = mod.scaling["default"]
        B = torch.randn(W.shape[0], r, generator=gen).to(W.device)
        BA = B @ A
        B = B * (rel * W.norm(dim=1, keepdim=True) / (s * BA.norm(dim=1, keepdim=True)).clamp_min(1e-30))
        m = torch.linalg.vector_norm(W + s * (B @ A), dim=1)
        m = m * (1 + m_noise * torch.randn(m.shape, generator=gen).to(m.device))
        for key, t in (("lora_A", A), ("lora_B", B), ("lora_magnitude_vector", m)):
            state[f"{name}.{key}.default.weight"] = t.detach().clone()
    del pm
    return state


def _load_adapter(pm, state: dict[str, torch.Tensor], use_dora: bool) -> None:
    params = dict(pm.named_parameters())
    n = 0
    with torch.no_grad():
        for key, t in state.items():
            if not use_dora and "lora_magnitude_vector" in key:
                continue
            params[key].copy_(t.to(params[key].dtype))
            n += 1
    if n == 0:
        raise RuntimeError("no adapter entry matched the PEFT model's parameters")


def accelerate(peft_model):
    """``dora_num.peft.accelerate`` (quiet), checked to serve every PEFT DoRA projection: the
    ``dora_num_*`` variants are PEFT's model with every DoRA layer on this project's operator."""
    from dora_num import peft as dn_peft

    report = dn_peft.accelerate(peft_model, verbose=False)
    if report.kept:
        raise RuntimeError(f"accelerate kept {len(report.kept)} layers on PEFT's path: {report.kept[:3]}")
    return report


def make_variant(variant: str, base, r: int, state: dict):
    """The model of ``variant`` on a deep copy of ``base`` with the adapter ``state``."""
    from peft import get_peft_model

    model = copy.deepcopy(base)
    if variant == "frozen":
        for p in model.parameters():
            p.requires_grad_(False)
    else:
        use_dora = variant != "lora_fp32"
        model = get_peft_model(model, _lora_config(r, use_dora), autocast_adapter_dtype=variant.endswith("fp32"))
        _load_adapter(model, state, use_dora)
        if variant.startswith("dora_num"):
            report = accelerate(model)
            if len(report.accelerated) != len(TARGET_MODULES) * base.config.num_hidden_layers:
                raise RuntimeError(f"accelerate served {len(report.accelerated)} projections, expected every one")
    model.train()
    _hf(model).enable_input_require_grads()
    return model


def _hf(model):
    """The transformers model inside a PeftModel (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def set_checkpointing(model, on: bool) -> None:
    hf = _hf(model)
    if on:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf.gradient_checkpointing_disable()


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _bump(params) -> None:
    """What an optimizer step does to the version counters, without a kernel."""
    for p in params:
        torch.autograd.graph.increment_version(p)


class Runner:
    """The step functions of one variant (``train``, ``train_opt``, ``infer``, ``infer_cold``)."""

    def __init__(self, model, ids, device: str):
        self.model, self.ids, self.device = model, ids, device
        self.params = trainable(model)
        self.opt = torch.optim.AdamW(self.params, lr=1e-5) if self.params else None

    def _loss(self):
        with torch.autocast(self.device, dtype=torch.bfloat16):
            return self.model(input_ids=self.ids, labels=self.ids).loss

    def train(self):
        _bump(self.params)
        for p in self.params:
            p.grad = None
        loss = self._loss()
        loss.backward()
        return loss

    def train_opt(self):
        loss = self._loss()
        loss.backward()
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss

    def infer(self):
        # the norm reused across calls while the adapter is unchanged (inference only: see
        # OpConfig.norm_cache; PEFT's default recomputes it, which infer_cold measures)
        with override(norm_cache="always"), torch.no_grad(), torch.autocast(self.device, dtype=torch.bfloat16):
            return self.model(input_ids=self.ids).logits

    def infer_cold(self):
        _bump(self.params)
        return self.infer()


def predict(shape: Shape, r: int, ckpt: bool, *, tflops: float = 660.0, copy_gbps: float = 4250.0,
            fp32_tflops: float = 50.0) -> dict[str, float]:
    """Milliseconds of one training step (forward + backward) per variant from a flop/traffic model.

    Frozen model: GEMM flops ``2 T sum(d_in d_out)`` per projection and pass (forward, the
    backward's input gradient; checkpointing adds a forward), the LM head likewise, causal SDPA
    ``2 T^2 hidden`` per layer forward (x 2.5 backward), at ``tflops`` (bf16 dense, what large
    cuBLAS GEMMs reach on the H200), plus elementwise traffic (norms, rotary, SiLU-mul, residual,
    casts: about 24 activation-sized bf16 passes per layer forward, x2 backward) at ``copy_gbps``.
    LoRA: ``2 T r (d_in + d_out)`` per projection and pass, x3 for forward + backward (dx, dA, dB).
    DoRA on this operator: the norm once per step (cached for the recompute) as
    ``split_pieces = 3`` tensor-core products ``2 d_out d_in 3r`` plus ``2 (3r)^2 d_in``, and the
    compose traffic ``16 B`` per output element (forward 6, backward 10). PEFT's DoRA adds, per
    projection and forward, ``lora_B(lora_A(eye(d_in)))`` (``2 d_in r (d_in + d_out)`` flops), the
    dense ``W + s B A`` and its norm (4 bf16 passes over ``d_out d_in``), and about 10 extra
    activation-sized passes (its compose in torch ops), x2 in the backward.  Host cost is not
    modelled (the GPU work is what a same-run ratio can be judged against when the host keeps up).
    """
    T = shape.tokens
    proj = shape.projections()
    L = shape.layers
    gemm = sum(2 * T * a * b for a, b in proj.values()) * L + 2 * T * shape.hidden * shape.vocab
    attn = 2 * T * T * shape.hidden * L
    fwd_passes = 1 + (1 if ckpt else 0)
    frozen_flops = gemm * (fwd_passes + 1) + attn * (fwd_passes + 2.5)
    act = T * shape.hidden * 2  # bytes of one bf16 activation
    elem = act * 24 * L * (fwd_passes + 2)
    ms = lambda fl, by: (fl / (tflops * 1e12) + by / (copy_gbps * 1e9)) * 1e3  # noqa: E731
    frozen = ms(frozen_flops, elem)
    lora_flops = sum(2 * T * r * (a + b) for a, b in proj.values()) * L * (fwd_passes + 2)
    out_elems = sum(b for a, b in proj.values()) * T * L
    lora = frozen + ms(lora_flops, 0)
    norm_flops = sum(2 * b * a * 3 * r + 2 * (3 * r) ** 2 * a for a, b in proj.values()) * L
    compose_bytes = out_elems * (6 * fwd_passes + 10)
    dora_num = lora + ms(norm_flops, compose_bytes)
    peft_extra_flops = sum(2 * a * r * (a + b) for a, b in proj.values()) * L * fwd_passes
    peft_extra_bytes = (sum(4 * 2 * a * b for a, b in proj.values()) * L + out_elems * 2 * 10 * 2) * fwd_passes
    peft = lora + ms(peft_extra_flops, peft_extra_bytes)
    return {"frozen": frozen, "lora_fp32": lora, "dora_num_fp32": dora_num, "peft_fp32": peft}
