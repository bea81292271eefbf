"""Contrastive DoRA fine-tuning of MiniLM on (summary, signature) pairs.

Objective: in-batch negatives (InfoNCE, summary -> signature).  For a batch of
``n`` pairs with normalised embeddings ``q_i`` (summaries) and ``d_j``
(signatures), ``loss = CE(q d^T / T, arange(n))`` with temperature ``T = 0.05``
(sentence-transformers' MultipleNegativesRankingLoss scale 20).

DoRA sits on every ``nn.Linear`` of the encoder (36 modules), through one of two
backends that see the *same* adapter initialisation and the *same* data order:

The method in full: docs/methods.md, adapters/train.py.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as Fn
from torch import nn

from ..ops.layer import DoRALinear
from .collapse import g_fp64
from .corpus import load_corpus
from .model import embed, embed_texts, encoder_linear_names, load_base_model, mrr_at_k, tokenize

BACKENDS = ("dora_num", "peft")
TEMPERATURE = 0.05


@dataclass
class TrainConfig:
    rank: int = 16
    alpha: float | None = None  # None: alpha = rank (scale s = 1; s = sqrt(r) with rsLoRA)
    use_rslora: bool = False
    lr: float = 1e-3
    steps: int = 200
    batch_size: int = 32
    max_len: int = 64
    seed: int = 0
    warmup_steps: int = 10  # linear warmup, then constant
    weight_decay: float = 0.0
    backend: str = "dora_num"
    compose_path: str = "eager"  # DoRALinear compose path (dora_num backend)
    bf16_autocast: bool = False
    device: str = "cpu"
    capture_steps: tuple[int, ...] = ()  # g snapshots after these many updates (0 = init)
    eval_steps: tuple[int, ...] = ()  # validation MRR@10 + loss after these many updates
    eval_limit: int | None = None  # validation pairs used (None: all)
    perturb_seed: int | None = None  # move each m by 1 fp32 ulp (random sign): the noise-floor baseline
    progress: bool = True
    joint_encode: bool = False  # one forward over summaries + signatures (half the launches; pads to the longer)

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("rank", "steps", "batch_size", "max_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "steps" else 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.batch_size < 2:
            raise ValueError("batch_size must be >= 2 (in-batch negatives)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be positive and finite, got {self.lr}")
        for name in ("capture_steps", "eval_steps"):
            bad = [s for s in getattr(self, name) if not 0 <= s <= self.steps]
            if bad:
                raise ValueError(f"{name} must lie in [0, steps={self.steps}], got {bad}")

    @property
    def alpha_value(self) -> float:
        return float(self.rank if self.alpha is None else self.alpha)


@dataclass
class TrainResult:
    config: TrainConfig
    history: list[dict] = field(default_factory=list)  # per step: step, loss, grad_norm, lr, seconds
    evals: list[dict] = field(default_factory=list)  # step, mrr10, val_loss
    g_minus_1: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # step -> module -> float32
    model: nn.Module | None = None
    module_names: list[str] = field(default_factory=list)
    captures: dict[int, object] = field(default_factory=dict)  # step -> what TrainHooks.capture returned
    stop_reason: str = "max_steps"  # or the reason TrainHooks.should_stop gave

    @property
    def seconds_per_step(self) -> float:
        t = [h["seconds"] for h in self.history[1:]] or [h["seconds"] for h in self.history]
        return float(np.median(t)) if t else float("nan")


@dataclass
class TrainHooks:
    """Optional extension points of :func:`train` (None: the single-process default).

    ``wrap_model(model) -> module`` runs the training forwards (e.g. DDP; evaluation
    uses the bare model); ``shard(indices) -> indices`` picks this process's part of
    a batch; ``gather(embeddings) -> embeddings`` rebuilds the whole batch's
    embeddings (autograd-aware) before the loss; ``on_step(record)`` sees each
    step's history record; ``compose_fn`` is the ``compose_fn`` of every
    :class:`~dora_num.DoRALinear` of the ``dora_num`` backend (None: the layer's own
    compose).

    ``capture(result, step) -> object`` replaces the default ``g - 1`` snapshot at the
    capture steps (kept in ``result.captures[step]``).  ``should_stop(result, step) ->
    str | None`` runs after each step's evaluation and capture; a reason it returns ends
    training there (``result.stop_reason``; ``"max_steps"`` otherwise).  With a
    ``should_stop``, the last step reached is always evaluated and captured (once),
    whatever ended the run.
    """

    wrap_model: Callable | None = None
    shard: Callable | None = None
    gather: Callable | None = None
    on_step: Callable | None = None
    compose_fn: Callable | None = None
    capture: Callable | None = None
    should_stop: Callable | None = None


# ----------------------------------------------------------------------------
# Adapter construction: one seeded init, two backends.
# ----------------------------------------------------------------------------

def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def inject_dora(model: nn.Module, cfg: TrainConfig, names: list[str] | None = None, **layer_kwargs) -> list[str]:
    """Replace the encoder's linears by seeded :class:`DoRALinear` (in place); returns their names.
    ``layer_kwargs`` go to every :class:`DoRALinear` (e.g. its ``norm=`` or ``compose_fn=`` seam)."""
    names = encoder_linear_names(model) if names is None else names
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        for n in names:
            lin = model.get_submodule(n)
            _set_submodule(model, n, DoRALinear.from_linear(lin, cfg.rank, cfg.alpha_value, use_rslora=cfg.use_rslora,
                                                            compose_path=cfg.compose_path, **layer_kwargs))
    return names


def peft_dora_model(base: nn.Module, cfg: TrainConfig, names: list[str]):
    """PEFT DoRA on ``names`` of ``base`` (the PeftModel wraps ``base`` in place)."""
    from peft import LoraConfig, get_peft_model

    lc = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha_value, use_rslora=cfg.use_rslora, use_dora=True,
                    lora_dropout=0.0, target_modules=list(names), bias="none")
    return get_peft_model(base, lc)


def peft_dora_modules(peft_model) -> dict[str, nn.Module]:
    """``{encoder-relative name: peft LoraLayer}`` of a PEFT DoRA model."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for n, mod in peft_model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in getattr(mod, "lora_magnitude_vector", {}):
            out[n.removeprefix("base_model.model.")] = mod
    return out


@torch.no_grad()
def copy_adapter_into_peft(src: nn.Module, peft_model, names: list[str]) -> None:
    """Give PEFT's layers the A, B, m of ``src``'s :class:`DoRALinear` modules."""
    mods = peft_dora_modules(peft_model)
    for n in names:
        ours, theirs = src.get_submodule(n), mods[n]
        theirs.lora_A["default"].weight.copy_(ours.lora_A)
        theirs.lora_B["default"].weight.copy_(ours.lora_B)
        theirs.lora_magnitude_vector["default"].weight.copy_(ours.magnitude)


def adapter_tensors(model: nn.Module, backend: str, names: list[str]) -> dict[str, tuple]:
    """``{name: (W, A, B, m, scale)}`` (live tensors) for either backend."""
    out = {}
    if backend == "dora_num":
        for n in names:
            mod = model.get_submodule(n)
            out[n] = (mod.base.weight, mod.lora_A, mod.lora_B, mod.magnitude, mod.scale)
    else:
        for n, mod in peft_dora_modules(model).items():
            out[n] = (mod.get_base_layer().weight, mod.lora_A["default"].weight, mod.lora_B["default"].weight,
                      mod.lora_magnitude_vector["default"].weight, mod.scaling["default"])
    return out


def g_minus_one_exact(W, A, B, m, scale: float) -> np.ndarray:
    """``g - 1`` (float32 storage) of :func:`dora_num.adapters.collapse.g_fp64` (float64 norm)."""
    return (g_fp64(W, A, B, m, scale) - 1.0).astype(np.float32)


@torch.no_grad()
def perturb_magnitudes_one_ulp(tensors: dict[str, tuple], seed: int) -> None:
    """``m <- nextafter(m, +-inf)`` with a seeded random sign per element (in place).

    The size of the disagreement between two correct fp32 evaluations of the
    init norm (PEFT's ``torch.linalg.norm`` is not correctly rounded on CPU; ours is).
    """
    gen = torch.Generator().manual_seed(seed)
    for n in sorted(tensors):
        m = tensors[n][3]
        sign = torch.randint(0, 2, m.shape, generator=gen).to(m.device, m.dtype) * 2 - 1  # CPU draws: device-free
        m.copy_(torch.nextafter(m, sign * float("inf")))


def build_model(cfg: TrainConfig, base_path=None, *, compose_fn: Callable | None = None):
    """``(model, tokenizer, module names)``: MiniLM with the seeded DoRA adapter on ``cfg.backend``
    (``compose_fn``: :attr:`TrainHooks.compose_fn`)."""
    model, tok = load_base_model(base_path)
    names = inject_dora(model, cfg, compose_fn=compose_fn)
    model.to(cfg.device)
    for n in names:  # m from the norm on the training device: g == 1 exactly at step 0 there
        model.get_submodule(n).reset_magnitude()
    if cfg.backend == "peft":
        base, _ = load_base_model(base_path)
        peft_model = peft_dora_model(base, cfg, names)
        copy_adapter_into_peft(model, peft_model, names)
        model = peft_model
    if cfg.perturb_seed is not None:
        perturb_magnitudes_one_ulp(adapter_tensors(model, cfg.backend, names), cfg.perturb_seed)
    model.to(cfg.device)
    for n, p in model.named_parameters():
        p.requires_grad_(("lora_" in n) or n.endswith("magnitude"))
    return model, tok, names


# ----------------------------------------------------------------------------
# Training.
# ----------------------------------------------------------------------------

def contrastive_loss(q: torch.Tensor, d: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    logits = (q @ d.T) / temperature
    return Fn.cross_entropy(logits, torch.arange(q.shape[0], device=q.device))


def batch_order(n_items: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Batches of indices: consecutive slices of a fresh seeded permutation per epoch (drop last)."""
    if n_items < batch_size:
        raise ValueError(f"need at least batch_size={batch_size} training pairs, have {n_items}")
    gen = torch.Generator().manual_seed(10_007 * seed + 1)
    per_epoch = n_items // batch_size
    out: list[list[int]] = []
    while len(out) < steps:
        perm = torch.randperm(n_items, generator=gen).tolist()
        out.extend(perm[i * batch_size : (i + 1) * batch_size] for i in range(per_epoch))
    return out[:steps]


def _autocast(cfg: TrainConfig):
    if cfg.bf16_autocast:
        return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, tok, pairs: list[dict], cfg: TrainConfig) -> dict:
    """Validation MRR@10 (each summary ranks all validation signatures) and mean in-batch loss."""
    s = [p["summary"] for p in pairs]
    d = [p["signature"] for p in pairs]
    with _autocast(cfg):
        q = embed_texts(model, tok, s, max_len=cfg.max_len, device=cfg.device)
        k = embed_texts(model, tok, d, max_len=cfg.max_len, device=cfg.device)
    bs = cfg.batch_size
    losses = [float(contrastive_loss(q[i : i + bs], k[i : i + bs])) for i in range(0, len(s) - bs + 1, bs)]
    return {"mrr10": mrr_at_k(q, k, 10), "val_loss": float(np.mean(losses)) if losses else float("nan")}


def train(cfg: TrainConfig, *, corpus: list[dict] | None = None, base_path=None,
          hooks: TrainHooks | None = None) -> TrainResult:
    """Fine-tune MiniLM with DoRA per ``cfg``; returns losses, evaluations, g snapshots, the model."""
    cfg.validate()
    corpus = load_corpus() if corpus is None else corpus
    train_pairs = [p for p in corpus if p["split"] == "train"]
    val_pairs = [p for p in corpus if p["split"] == "validation"][: cfg.eval_limit]
    hooks = hooks or TrainHooks()
    model, tok, names = build_model(cfg, base_path, compose_fn=hooks.compose_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / max(cfg.warmup_steps, 1)))
    res = TrainResult(config=cfg, model=model, module_names=names)
    fwd_model = hooks.wrap_model(model) if hooks.wrap_model else model
    capture, evals = set(cfg.capture_steps), set(cfg.eval_steps)

    def snapshot(step, force=False):  # force: the final state (once, if not already taken at this step)
        if (step in capture or force) and step not in res.captures and step not in res.g_minus_1:
            if hooks.capture is not None:
                res.captures[step] = hooks.capture(res, step)
            else:
                res.g_minus_1[step] = {n: g_minus_one_exact(*t) for n, t in adapter_tensors(model, cfg.backend, names).items()}
        if (step in evals or force) and not (res.evals and res.evals[-1]["step"] == step):
            t0 = time.perf_counter()
            res.evals.append({"step": step, **evaluate(model, tok, val_pairs, cfg), "seconds": time.perf_counter() - t0})

    torch.manual_seed(cfg.seed)  # dropout masks: same stream for both backends
    snapshot(0)
    batches = batch_order(len(train_pairs), cfg.batch_size, cfg.steps, cfg.seed)
    from tqdm.std import tqdm  # a text bar: no widget comm in a headless notebook run

    model.train()
    bar = tqdm(batches, desc=f"{cfg.backend} r={cfg.rank} lr={cfg.lr:g}", disable=not cfg.progress, leave=False)
    for step, idx in enumerate(bar, start=1):
        t0 = time.perf_counter()
        idx = hooks.shard(idx) if hooks.shard else idx
        summaries, signatures = [train_pairs[i]["summary"] for i in idx], [train_pairs[i]["signature"] for i in idx]
        with _autocast(cfg):
            if cfg.joint_encode:
                e = embed(fwd_model, tokenize(tok, summaries + signatures, cfg.max_len, cfg.device))
                q, d = e[: len(idx)], e[len(idx) :]
            else:
                q = embed(fwd_model, tokenize(tok, summaries, cfg.max_len, cfg.device))
                d = embed(fwd_model, tokenize(tok, signatures, cfg.max_len, cfg.device))
            if hooks.gather:
                q, d = hooks.gather(q), hooks.gather(d)
            loss = contrastive_loss(q, d)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        res.history.append({"step": step, "loss": loss.item(), "grad_norm": grad_norm, "lr": lr,
                            "seconds": time.perf_counter() - t0})
        bar.set_postfix(loss=f"{res.history[-1]['loss']:.4f}")
        if hooks.on_step:
            hooks.on_step(res.history[-1])
        snapshot(step)
        if hooks.should_stop is not None:
            reason = hooks.should_stop(res, step)
            if reason:
                res.stop_reason = str(reason)
                break
    bar.close()
    if hooks.should_stop is not None:  # the state training ended in is always evaluated and captured
        snapshot(res.history[-1]["step"] if res.history else 0, force=True)
    model.eval()
    return res


def config_dict(cfg: TrainConfig) -> dict:
    d = asdict(cfg)
    d["capture_steps"] = list(cfg.capture_steps)
    d["eval_steps"] = list(cfg.eval_steps)
    return d

