r"""Model-level speed, memory and fidelity: PEFT's DoRA against the same adapter on this project's operator.

``dora-num record model --out DIR [--smoke]`` (also ``dora-num gpu-suite --only
model``).  A Llama-architecture decoder (transformers ``LlamaConfig`` + ``LlamaForCausalLM``, random
weights, nothing downloads) at 8B layer shapes (hidden 4096, intermediate 14336, 32 heads / 8 KV
heads, vocab 32000), 4 layers, 4096 tokens (one sequence), bf16 weights, bf16 autocast, DoRA on all
7 projections, ``r`` in {16, 64, 384}, ``alpha = 2r``, with and without gradient checkpointing
(non-reentrant).  Variants, all on the same base weights and the same adapter values:

- ``peft_fp32``: PEFT's default (``get_peft_model(model, LoraConfig(use_dora=True, ...))``, adapters fp32);
- ``dora_num_fp32``: that PEFT model accelerated (:func:`dora_num.peft.accelerate`: this project's
  ``DoRALinear`` on PEFT's own parameters, fp32 A, B, m);
- ``peft_bf16`` / ``dora_num_bf16``: the same with bf16 adapters (``autocast_adapter_dtype=False``);
- ``lora_fp32``: plain LoRA (PEFT, fp32 adapters), the cost of the adapter without DoRA;
- ``frozen``: the base model alone (input embeddings requiring grad, so the backward runs through
  every layer), the floor no adapter method can go below.

Modes: ``train`` (forward + backward, optimizer excluded as in the paper; the trainable parameters'
version counters are bumped before every step, as an optimizer step would, so no variant reuses a
norm across steps), ``train_opt`` (+ ``AdamW.step`` and ``zero_grad``), ``infer`` (forward under
``no_grad``, adapters frozen: ``DoRALinear`` reuses its norm, ``OpConfig.norm_cache="always"``), ``infer_cold`` (the norm recomputed
every call, as PEFT does: versions bumped), each with its peak extra memory (allocator peak above the
memory held before the step).  Timing: CUDA events around each step, ``REPS`` steps per round after
a warm-up, the variants interleaved within each round (A B C ... A B C ...), ``ROUNDS`` rounds; each
row reports the median over rounds of the per-round median and every round's value.

Fidelity (:func:`agreement`): on a small copy (same architecture, tiny sizes) the loss and logits of
each variant under bf16 autocast against an fp64 evaluation of the fp32 adapter
(:class:`dora_num.oracles.DoRALinearRef64` in every projection of a float64 copy), beside the error
of the frozen bf16 model against its own fp64 evaluation (``e_floor``: what bf16 activations alone
cost).  A variant is ``faithful`` when its error ``e`` satisfies ``e <= e_peft + e_floor``, ``e_peft``
PEFT's error at the same adapter dtype (``e`` the rms relative error of the logits): no farther from
the exact function than PEFT is, up to one more bf16 evaluation's worth of activation rounding (two
bf16 evaluations of one function differ by about that much, so a tighter tolerance would judge
rounding noise); and its loss within ``2 max|logits - logits_ref|`` of the reference loss (mean
cross-entropy is 2-Lipschitz in the max-norm of the logits), i.e. the loss follows the logits.  The
loss alone is one scalar: its error against the reference is a single draw of rounding noise
(PEFT's was 5e-6 or 2e-4 from one seed to the next) and sets no tolerance.  The copy's adapter is
larger than the timed one (``||sBA|| = 10% ||W||``, :data:`AGREEMENT_REL`) so that its effect stands
well above ``e_floor``; even so the adapter's own rounding is far below ``e_floor``: this checks the
model-level wiring (scale, g, which modules), the layer tests check the numerics; the row
``no_adapter`` (the frozen model against the adapter's reference) shows the tolerance is tighter than
the adapter's effect, i.e. that a model that ignored the adapter would fail.  The full-size run
also records each variant's loss and logits against PEFT's.

``frozen`` and ``lora_fp32`` give the floor of every target (:func:`predict` writes the traffic/flop
model the measured times are judged against).  The adapter copy of :func:`accelerate` stands in for
``dora_num.peft.accelerate`` until that exists (see :func:`accelerate`).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...ops.config import override
from ..cli import parser as recorder_parser
from .datasets import MODEL

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
ROUNDS, REPS = 5, 3
SMOKE_ROUNDS, SMOKE_REPS = 2, 2


def _log(msg: str) -> None:
    print(f"[model-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------

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


# --------------------------------------------------------------------------
# Steps and timing
# --------------------------------------------------------------------------

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


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(fn, reps: int, device: str) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` (CUDA events; wall clock on the CPU)."""
    out = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def peak_extra(fn, device: str) -> float:
    """Allocator peak above what was allocated before ``fn()`` (bytes; NaN on the CPU, where
    ``fn`` is not run)."""
    if device != "cuda":  # no allocator statistics: not measured (and not run)
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - before)


def bench_rank(shape: Shape, r: int, device: str, *, rounds: int, reps: int, variants=VARIANTS,
               checkpointing=(False, True), base=None) -> tuple[list[dict], list[dict]]:
    """Every variant x checkpointing x mode at rank ``r``, interleaved rounds: ``(timing rows,
    full-size agreement rows)``."""
    base = build_base(shape, device) if base is None else base
    state = adapter_state(base, r)
    gen = torch.Generator(device="cpu").manual_seed(SEED + r)
    ids = torch.randint(0, shape.vocab, (1, shape.tokens), generator=gen).to(device)
    runners = {v: Runner(make_variant(v, base, r, state), ids, device) for v in variants}
    rows = []
    for ckpt in checkpointing:
        for run in runners.values():
            set_checkpointing(run.model, ckpt)
        modes = MODES if not ckpt else ("train", "train_opt")  # inference does not checkpoint
        peaks = {}
        for v, run in runners.items():  # warm-up (Triton compiles, caches) and peaks
            for mode in modes:
                getattr(run, mode)()
                _sync(device)
                for p in run.params:  # the peak then counts this step's gradients in full
                    p.grad = None
                peaks[v, mode] = peak_extra(getattr(run, mode), device)
        times = {(v, m): [] for v in runners for m in modes}
        for _ in range(rounds):
            for v, run in runners.items():
                for mode in modes:
                    times[v, mode].append(statistics.median(time_steps(getattr(run, mode), reps, device)))
        for (v, mode), per_round in times.items():
            rows.append({"variant": v, "rank": r, "checkpointing": ckpt, "mode": mode,
                         "ms": statistics.median(per_round), "ms_min_round": min(per_round),
                         "ms_max_round": max(per_round), "rounds_ms": ";".join(f"{t:.4f}" for t in per_round),
                         "reps_per_round": reps, "peak_extra_bytes": peaks[v, mode], "tokens": shape.tokens,
                         "layers": shape.layers, "hidden": shape.hidden, "intermediate": shape.intermediate,
                         "device": device})
        _log(f"r={r} checkpointing={ckpt}: " + ", ".join(
            f"{v} {statistics.median(times[v, 'train']):.1f} ms" for v in runners))
    full_fid = full_size_agreement(runners, device, r)
    del runners, state
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows, full_fid


# --------------------------------------------------------------------------
# Fidelity
# --------------------------------------------------------------------------

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


# The agreement copy's adapter: ||sBA|| = 10% of ||W||, m 1% off ||W + sBA||, so that its effect on
# the logits stands well above the bf16 floor (at 1% / 0.1% it was 1-3x the floor on the CPU copy).
AGREEMENT_REL, AGREEMENT_M_NOISE = 0.1, 1e-2


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


# --------------------------------------------------------------------------
# Host cost and the public compose (probe)
# --------------------------------------------------------------------------

def probe(device: str, *, smoke: bool, copy_gbps: float | None) -> list[dict]:
    """Host cost of one ``DoRALinear`` forward+backward (4096->4096, r=384, 4096 tokens, bf16, fp32
    adapters), against a plain ``nn.Linear`` with LoRA (the floor of any adapter layer's host
    path), and the public ``dn.compose`` fused forward at 8192x8192 bf16 against its kernel and
    the copy bandwidth.  Host cost: CPU time of the Python call per step with the device kept
    busy ahead (no wait inside the timed loop), median of interleaved rounds."""
    import dora_num as dn

    from ...ops.finite import check_pending
    from ..bench import compose_bytes

    rows = []
    d, r, T = (256, 16, 256) if smoke else (4096, 384, 4096)
    torch.manual_seed(SEED + 3)
    lin = torch.nn.Linear(d, d, bias=False, device=device, dtype=torch.bfloat16)
    layer = dn.DoRALinear(copy.deepcopy(lin), r, 2.0 * r)
    layer.lora_A = torch.nn.Parameter(layer.lora_A.detach().float())
    layer.lora_B = torch.nn.Parameter(1e-3 * torch.randn(d, r, device=device))
    layer.magnitude = torch.nn.Parameter(layer.magnitude.detach().float())
    lora_A = torch.nn.Parameter(layer.lora_A.detach().clone())
    lora_B = torch.nn.Parameter(layer.lora_B.detach().clone())
    x = torch.randn(T, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    D = torch.randn(T, d, device=device, dtype=torch.bfloat16)
    params = [layer.lora_A, layer.lora_B, layer.magnitude]

    def dora_step():
        _bump(params)
        with torch.autocast(device, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(D)

    def lora_step():
        with torch.autocast(device, dtype=torch.bfloat16):
            y = lin(x) + 2.0 * torch.nn.functional.linear(torch.nn.functional.linear(x, lora_A), lora_B)
        y.backward(D)

    def host_us(fn, n):
        _sync(device)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n * 1e6
        _sync(device)
        return host

    for fn in (dora_step, lora_step):
        fn()
    _sync(device)
    n = 3 if smoke else 10
    res = {"dora_linear_fwd_bwd": [], "lora_linear_fwd_bwd": []}
    for _ in range(2 if smoke else 5):
        res["dora_linear_fwd_bwd"].append(host_us(dora_step, n))
        res["lora_linear_fwd_bwd"].append(host_us(lora_step, n))
    check_pending()
    for name, vals in res.items():
        rows.append({"probe": "host_us", "what": name, "shape": f"{d}x{d} r={r} T={T}", "value": statistics.median(vals),
                     "rounds": ";".join(f"{v:.1f}" for v in vals), "unit": "us"})
    if device == "cuda":
        from ..bench import time_ms
        from ...ops.kernels import compose as kc

        n_rows = n_cols = 1024 if smoke else 8192
        base = torch.randn(n_rows, n_cols, device=device).bfloat16()
        lora = torch.randn_like(base)
        g = 1 + 1e-3 * torch.randn(n_cols, device=device)
        nbytes = compose_bytes("fwd", base.numel(), 2, n_cols)
        for what, fn in (("public_compose_fused_fwd", lambda: dn.compose(base, lora, g, 0.5, path="fused")),
                         ("kernel_compose_fwd", lambda: kc.compose_fwd(base, lora, g, 0.5))):
            fn()
            t = time_ms(fn)
            rows.append({"probe": "compose_fwd", "what": what, "shape": f"{n_rows}x{n_cols} bf16", "value": t.ms,
                         "unit": "ms", "gbps": nbytes / (t.ms * 1e-3) / 1e9,
                         "pct_copy": (100 * nbytes / (t.ms * 1e-3) / 1e9 / copy_gbps) if copy_gbps else float("nan")})
        check_pending()
    return rows


# --------------------------------------------------------------------------
# Prediction (written down before the measurement; the run records it beside)
# --------------------------------------------------------------------------

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


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

def run(out: Path, *, smoke: bool = False, device: str | None = None, copy_gbps: float | None = None,
        ranks=None, rounds: int | None = None, reps: int | None = None, shape: Shape | None = None,
        checkpointing=(False, True)) -> dict:
    """The whole section: timings, agreement, probe, predictions; CSVs under ``out``
    (``model_bench.csv``, ``model_agreement.csv``, ``model_probe.csv``, ``model_predictions.csv``).
    Full sizes on CUDA; tiny ones with ``smoke`` or on the CPU (the eager tier).  ``ranks``,
    ``rounds``, ``reps``, ``shape``, ``checkpointing`` override the defaults (tests)."""
    import pandas as pd

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    small = smoke or device != "cuda"
    shape = shape or (SMOKE if small else FULL)
    ranks = tuple(ranks or (SMOKE_RANKS if small else RANKS))
    rounds = rounds or (SMOKE_ROUNDS if smoke else ROUNDS)
    reps = reps or (SMOKE_REPS if smoke else REPS)
    t0 = time.time()
    rows, fid = [], []
    base = build_base(shape, device)
    for r in ranks:
        rr, ff = bench_rank(shape, r, device, rounds=rounds, reps=reps, base=base, checkpointing=checkpointing)
        rows += rr
        fid += ff
        pd.DataFrame(rows).to_csv(out / "model_bench.csv", index=False, lineterminator="\n")
    del base
    fid += agreement(device, ranks=(ranks[0],) if small else (16, 64))
    pd.DataFrame(fid).to_csv(out / "model_agreement.csv", index=False, lineterminator="\n")
    pd.DataFrame(probe(device, smoke=smoke, copy_gbps=copy_gbps)).to_csv(out / "model_probe.csv", index=False,
                                                                          lineterminator="\n")
    preds = [{"rank": r, "checkpointing": c, "variant": v, "predicted_ms": t}
             for r in ranks for c in (False, True) for v, t in predict(shape, r, c, **(
                 {"copy_gbps": copy_gbps} if copy_gbps else {})).items()]
    pd.DataFrame(preds).to_csv(out / "model_predictions.csv", index=False, lineterminator="\n")
    summary = {"shape": asdict(shape), "ranks": list(ranks), "rounds": rounds, "reps": reps, "device": device,
               "wall_s": time.time() - t0, "smoke": smoke}
    _log(f"model section done in {summary['wall_s']:.0f} s")
    return summary


def ingest(src: Path, dest: Path | None = None, *, git_sha: str | None = None) -> list[Path]:
    """Copy the model section's files of a suite (or standalone) folder into ``data/gpu/`` with
    provenance (the device and git sha from the folder's ``device.json``), leaving the committed
    ``device.json`` of the other sections alone."""
    from ...repro.recording import ingest_folder

    return ingest_folder(Path(src), dest or MODEL.dest(), producer=MODEL.producer, git_sha=git_sha,
                         names=tuple(Path(f).name for f in MODEL.files))


def describe(device: str, smoke: bool) -> dict:
    """The standalone run's ``device.json`` (the suite writes its own): device, versions, git sha,
    and on CUDA the copy bandwidth of this run."""
    from ...repro.recording import checkout_git_sha

    sha = checkout_git_sha()
    desc = {"standalone": True, "argv": sys.argv, "smoke": smoke, "sections": ["model"]}
    if device == "cuda":
        from ..bench import copy_bandwidth, gpu_description

        desc.update(gpu_description(sha))
        desc["copy"] = copy_bandwidth(256 * 2**20 if smoke else 2 * 2**30)
    else:
        from ...repro.provenance import device_info, versions

        desc.update(device=device_info(), versions=versions(), git_sha=sha)
    return desc


def build_parser(prog: str = "dora-num record model", name: str = "model"):
    p = recorder_parser(prog, __doc__, smoke="tiny sizes, two ranks, two rounds (tests the machinery)",
                        out="output folder (model_*.csv, device.json)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if available")
    p.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {ROUNDS}; smoke {SMOKE_ROUNDS})")
    return p


def ingest_args(a) -> list[Path]:
    return ingest(a.ingest, a.out, git_sha=a.git_sha)


def record(a) -> int:
    if a.rounds is not None and a.rounds < 1:
        raise SystemExit("dora-num record model: --rounds must be >= 1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    desc = describe(device, a.smoke)
    if a.git_sha:
        desc["git_sha"] = a.git_sha
    desc["model"] = run(out, smoke=a.smoke, device=device, copy_gbps=desc.get("copy", {}).get("gbps"), rounds=a.rounds)
    (out / "device.json").write_text(json.dumps(desc, indent=2, default=str) + "\n")
    return 0
