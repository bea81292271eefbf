"""Oracles: fp64 references of the DoRA operator and PEFT's DoRA layer on given factors.

The one home of the references that studies and tests hold the fp32 operator to
(an independent evaluation of the same mathematics; none of it is "exact": the
certified ground truth is :mod:`dora_num.numerics.ground_truth`):

The method in full: docs/methods.md, oracles.py.
"""

from __future__ import annotations

from contextlib import contextmanager

import copy

import torch
from torch import nn

from .numerics import formulas as F
from .numerics.arithmetic import TorchFP32
from .numerics.bounds import gamma

U32 = 2.0**-24  # unit roundoff of IEEE binary32
U64 = 2.0**-53  # unit roundoff of IEEE binary64


class TorchFP64(TorchFP32):
    """The torch arithmetic of :class:`TorchFP32` on float64 tensors (one rounding
    per op, no FMA, ``u = 2^-53``): the formulas of
    :mod:`dora_num.numerics.formulas` evaluated as an fp64 reference."""

    name = "torch-fp64"
    dtype = torch.float64

    @staticmethod
    def const(x: float) -> float:
        return float(x)


def fp32_scale(scale: float) -> float:
    """The scale an fp32 evaluation actually multiplies by: ``fl32(scale)``.

    Both dora_num (:func:`~dora_num.numerics.formulas.scale_constants`) and PEFT
    (torch casts a Python scalar to the tensor's dtype) use it, so the fp64
    reference does too."""
    return F.scale_constants(scale)[0]


# --------------------------------------------------------------------------
# fp64 DoRA layer
# --------------------------------------------------------------------------

def row_norm_ref64(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float,
                   *, round_scale: bool = True) -> torch.Tensor:
    """``||W + s BA||_row`` in float64 from the dense definition (no gradient).

    ``s = fl32(scale)`` (what fp32 evaluations use), or ``scale`` itself with
    ``round_scale=False`` (what an fp64 evaluation such as PEFT in fp64 uses)."""
    s = fp32_scale(scale) if round_scale else float(scale)
    with torch.no_grad():
        return torch.linalg.vector_norm(W.double() + s * (B.double() @ A.double()), dim=1)


def dg_ref64(inner: torch.Tensor, grad: torch.Tensor, *, max_elems: int | None = None) -> torch.Tensor:
    """``dg = sum over rows of inner * D`` in float64 ``[N]`` (no gradient).

    The products of fp32 (or 16-bit) factors are exact in float64; the sum of the
    ``T`` rows rounds (relative error below ``(T-1) 2^-53`` of ``sum |inner D|``).
    ``max_elems`` bounds the float64 temporaries: rows are summed in chunks of
    ``max(1, max_elems // N)`` (for ``T`` at most one chunk the result is the same)."""
    with torch.no_grad():
        if max_elems is None:
            return (inner.double() * grad.double()).sum(0)
        d = torch.zeros(grad.shape[-1], dtype=torch.float64, device=grad.device)
        step = max(1, max_elems // grad.shape[-1])
        for i in range(0, grad.shape[0], step):
            d += (inner[i:i + step].double() * grad[i:i + step].double()).sum(0)
        return d


def dora_linear_ref64(x, W, bias, A, B, m, scale: float, *, round_scale: bool = True) -> torch.Tensor:
    """The DoRA layer in float64: ``x W^T + b + (g-1)(x W^T) + g s (x A^T B^T)``.

    ``g = m / ||W + sBA||_row`` with the norm detached.  All inputs are used as
    float64 tensors as given (pass fp64 leaves with ``requires_grad`` to get fp64
    gradients by autograd).  No eps guard: the reference is for nonzero rows.
    ``round_scale`` as in :func:`row_norm_ref64`.
    """
    s = fp32_scale(scale) if round_scale else float(scale)
    wnorm = row_norm_ref64(W, A, B, s, round_scale=False)
    g = m / wnorm
    base = x @ W.T
    lora = (x @ A.T) @ B.T
    delta = F.compose_stable(TorchFP64, base, lora, g, s)
    out = base if bias is None else base + bias
    return out + delta


class DoRALinearRef64(nn.Module):
    """A module evaluating :func:`dora_linear_ref64` on fp64 copies of a layer's state.

    Drop-in replacement for a DoRA-wrapped ``nn.Linear`` inside a model converted
    to float64 (``model.double()``), for model-level references.
    """

    def __init__(self, W, bias, A, B, m, scale: float, *, round_scale: bool = True):
        super().__init__()
        self.register_buffer("W", W.detach().double().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().double().clone())
        self.A = nn.Parameter(A.detach().double().clone())
        self.B = nn.Parameter(B.detach().double().clone())
        self.m = nn.Parameter(m.detach().double().clone())
        self.scale = float(scale)
        self.round_scale = round_scale

    def forward(self, x):
        return dora_linear_ref64(x.double(), self.W, self.bias, self.A, self.B, self.m, self.scale,
                                 round_scale=self.round_scale)


# --------------------------------------------------------------------------
# PEFT's DoRA layer on given factors
# --------------------------------------------------------------------------

class _Holder(nn.Module):
    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(x)


def peft_dora_linear(linear: nn.Linear, rank: int, alpha: float, *, use_rslora: bool = False,
                     autocast_adapter_dtype: bool = True) -> nn.Module:
    """PEFT's DoRA ``Linear`` (``LoraConfig(use_dora=True)``) around a deep copy of ``linear``.

    ``autocast_adapter_dtype=True`` is PEFT's default (16-bit adapters upcast to fp32);
    ``False`` keeps the adapters in the base layer's dtype."""
    import peft  # heavy and needed only by the PEFT comparisons: imported on use

    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=use_rslora, use_dora=True,
        lora_dropout=0.0, target_modules=["lin"], init_lora_weights=True,
    )
    model = peft.get_peft_model(_Holder(copy.deepcopy(linear)), config, autocast_adapter_dtype=autocast_adapter_dtype)
    return model.base_model.model.lin


def peft_dora_params(layer: nn.Module, adapter: str = "default") -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """``(A, B, m)`` parameters of a PEFT DoRA ``Linear``: ``[r, d_in]``, ``[d_out, r]``, ``[d_out]``."""
    return (
        layer.lora_A[adapter].weight,
        layer.lora_B[adapter].weight,
        layer.lora_magnitude_vector[adapter].weight,
    )


def peft_scale(layer: nn.Module, adapter: str = "default") -> float:
    return float(layer.scaling[adapter])


def set_dora_state(layer: nn.Module, A: torch.Tensor, B: torch.Tensor, m: torch.Tensor) -> None:
    """Copy ``A, B, m`` into a PEFT DoRA ``Linear`` or a :class:`~dora_num.DoRALinear`."""
    if hasattr(layer, "lora_magnitude_vector"):
        pA, pB, pm = peft_dora_params(layer)
    else:
        pA, pB, pm = layer.lora_A, layer.lora_B, layer.magnitude
    with torch.no_grad():
        for dst, src, name in ((pA, A, "A"), (pB, B, "B"), (pm, m, "m")):
            if dst.shape != src.shape:
                raise ValueError(f"{name} has shape {tuple(src.shape)}; the layer expects {tuple(dst.shape)}")
            dst.copy_(src)


def peft_model_ref64(peft_model: nn.Module, *, round_scale: bool = True) -> nn.Module:
    """An fp64 copy of a PEFT model with every DoRA ``lora.Linear`` replaced by a
    :class:`DoRALinearRef64` on its active adapter's ``W, b, A, B, m`` and scale.

    The rest of the network (embeddings, norms, attention, ``modules_to_save`` heads) is
    PEFT's / transformers' own code run in float64.  The reference's ``A``, ``B``, ``m`` are
    fp64 leaves named ``<layer>.A``, ``<layer>.B``, ``<layer>.m`` (for fp64 gradients).
    Only layers with exactly one active adapter, no merged weights and adapters enabled
    are supported (anything else raises)."""
    from peft.tuners.lora.layer import LoraLayer

    ref = copy.deepcopy(peft_model).double()
    targets = []
    for name, mod in ref.named_modules():
        if not isinstance(mod, LoraLayer) or not any(mod.use_dora.values()):
            continue
        active = [a for a in mod.active_adapters if a in mod.lora_A]
        if len(active) != 1 or mod.merged or mod.disable_adapters:
            raise ValueError(f"{name}: the fp64 reference needs exactly one active, unmerged, enabled adapter")
        (a,) = active
        lin = mod.get_base_layer()
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"{name}: the fp64 reference covers DoRA on nn.Linear only, got {type(lin).__name__}")
        targets.append((name, DoRALinearRef64(lin.weight, lin.bias, mod.lora_A[a].weight, mod.lora_B[a].weight,
                                              mod.lora_magnitude_vector[a].weight, float(mod.scaling[a]),
                                              round_scale=round_scale)))
    for name, new in targets:
        parent, _, leaf = name.rpartition(".")
        setattr(ref.get_submodule(parent) if parent else ref, leaf, new)
    return ref


def tiny_hf_model(kind: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    """A small randomly initialised transformers model (nothing downloads): ``"llama"`` (a
    ``LlamaForCausalLM``: hidden 32, 2 layers, 4 heads, 2 KV heads, vocab 64) or ``"bert"``
    (a MiniLM-like ``BertForSequenceClassification``: hidden 32, 2 layers, 4 heads, 3 labels,
    dropout off).  ``config`` overrides fields of the transformers config."""
    import transformers as tf

    if kind == "llama":
        fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        fields.update(config)
        cfg, cls = tf.LlamaConfig(**fields), tf.LlamaForCausalLM
    elif kind == "bert":
        fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_labels=3, max_position_embeddings=64,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        fields.update(config)
        cfg, cls = tf.BertConfig(**fields), tf.BertForSequenceClassification
    else:
        raise ValueError(f"kind must be 'llama' or 'bert', got {kind!r}")
    torch.manual_seed(seed)
    return cls(cfg).to(dtype).eval()


@torch.no_grad()
def perturb_peft_dora(peft_model: nn.Module, *, seed: int, update_ratio: float = 0.05,
                      g_spread: float = 1e-3) -> None:
    """Give every DoRA adapter of a PEFT model trained-looking ``B, m`` (:func:`perturbed_adapter`,
    per layer and adapter, computed from the layer's own ``W`` and ``A``; kept in their dtypes)."""
    from peft.tuners.lora.layer import LoraLayer

    i = 0
    for _, mod in sorted(peft_model.named_modules(), key=lambda t: t[0]):
        if not isinstance(mod, LoraLayer):
            continue
        for a in sorted(mod.lora_magnitude_vector):
            A = mod.lora_A[a].weight
            W = mod.get_base_layer().weight.detach().double().cpu()
            B, m = perturbed_adapter(W, A.detach().double().cpu(), float(mod.scaling[a]), seed=seed + i,
                                     update_ratio=update_ratio, g_spread=g_spread)
            mod.lora_B[a].weight.copy_(B)
            mod.lora_magnitude_vector[a].weight.copy_(m)
            i += 1


def perturbed_adapter(W: torch.Tensor, A: torch.Tensor, scale: float, *, seed: int,
                      update_ratio: float = 0.05, g_spread: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic trained-looking ``(B, m)`` for given ``W`` and ``A``.

    ``B`` is Gaussian, scaled so that ``||s BA||_F = update_ratio * ||W||_F``
    (realistic: ``||sBA|| << ||W||``); ``m = ||W + sBA||_row * (1 + g_spread * z)``
    with ``z ~ N(0, 1)``, so ``g - 1`` is of order ``g_spread`` (the realistic regime,
    docs/contract.md: about 1e-3 in training).  Computed in fp64, returned in ``W``'s dtype.
    """
    gen = torch.Generator().manual_seed(seed)
    d_out, r = W.shape[0], A.shape[0]
    B = torch.randn(d_out, r, generator=gen, dtype=torch.float64)
    s = fp32_scale(scale)
    upd = torch.linalg.matrix_norm(s * (B @ A.double()))
    wn = torch.linalg.matrix_norm(W.double())
    if upd > 0 and wn > 0:
        B = B * (update_ratio * wn / upd)
    B = B.to(W.dtype)
    wnorm = row_norm_ref64(W, A, B, s)
    z = torch.randn(d_out, generator=gen, dtype=torch.float64)
    m = (wnorm * (1.0 + g_spread * z)).to(W.dtype)
    return B, m


def row_norm_ref64_error_bound(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """Bound on ``|row_norm_ref64 - ||W + sBA||_row|`` (float64 ``[d_out]``).

    The dense evaluation in float64 (``u = 2^-53``): each element of
    ``W + s BA`` carries ``gamma_{r+2} M`` with ``M = |W| + |s| |B||A|`` (the
    product, the scaling and the sum); the norm of the perturbed row moves by at
    most the norm of the perturbation; the fp64 norm itself (squares, a
    ``d_in``-term sum in any order, a square root) adds ``gamma_{d_in+3}``::

        gamma_{r+2} ||M_j|| + gamma_{d_in+3} (||T_j|| + gamma_{r+2} ||M_j||)
    """
    d_in, r = W.shape[1], A.shape[0]
    s = fp32_scale(scale)
    with torch.no_grad():
        W64, A64, B64 = W.double(), A.double(), B.double()
        exact = row_norm_ref64(W64, A64, B64, s)
        Mrow = torch.linalg.vector_norm(W64.abs() + abs(s) * (B64.abs() @ A64.abs()), dim=1)
        g_r = gamma(r + 2, U64)
        return g_r * Mrow + gamma(d_in + 3, U64) * (exact + g_r * Mrow)


# --------------------------------------------------------------------------
# Host-memory measurement (torch.profiler, CPU)
# --------------------------------------------------------------------------

@contextmanager
def _stderr_fd_silenced():
    """File descriptor 2 to /dev/null for the block (C++ log lines that no setting turns off)."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _allocator_order(events: list[tuple]) -> list[tuple]:
    """Allocation events ``(time_ns, ptr, size, total, parent)`` in the order the allocator made them.

    Time orders them, but two events can share a nanosecond; the allocator's running total
    orders those (it moves under one lock, so each event starts at the total the one before it left).
    """
    events = sorted(events, key=lambda e: e[0])
    ordered, i = [], 0
    while i < len(events):
        j = i
        while j < len(events) and events[j][0] == events[i][0]:
            j += 1
        tied = events[i:j]
        prev = ordered[-1][3] if ordered else None
        while tied:
            nxt = next((e for e in tied if e[3] - e[2] == prev), tied[0])
            tied.remove(nxt)
            ordered.append(nxt)
            prev = nxt[3]
        i = j
    return ordered


def measure_cpu_allocations(fn) -> dict:
    """Run ``fn()`` under ``torch.profiler`` with ``profile_memory=True``; report its
    CPU allocator traffic, measured from the profiler's allocation events.

    Returns ``{"largest_block": bytes of the largest single allocation,
    "peak_extra": peak of the bytes the call allocated and had not yet freed,
    "n_allocations": count, "largest_op": name of the op that made the largest
    block}``.  Works on CPU tensors (the CUDA analogue is
    ``torch.cuda.max_memory_allocated``).  Uses the profiler's event tree
    (``kineto_results.experimental_event_tree``), the one place where each
    allocation's address and size are exposed.
    """
    import gc

    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
    # Python's cyclic collector runs when its allocation counters say so, which in a notebook kernel
    # depends on the kernel's own traffic: a tensor held in a reference cycle was freed before or
    # inside the measured call from one run to the next (a 4-byte scalar moved the peak). Collected
    # first, and off while measuring, the peak is the call's own.
    # Likewise the intra-op threads: their scratch allocations interleave by timing; one thread
    # allocates in program order.
    gc.collect()
    was_enabled, threads = gc.isenabled(), torch.get_num_threads()
    gc.disable()
    torch.set_num_threads(1)
    with _stderr_fd_silenced():  # kineto writes "USDT: ... profiler_start/stop" to fd 2 at each
        prof.start()
    try:
        fn()
    finally:
        with _stderr_fd_silenced():
            prof.stop()
        torch.set_num_threads(threads)
        if was_enabled:
            gc.enable()
    # The profiler's running total (``total_allocated``) is not this call's: c10 keeps one size table per
    # process, written only while a profiler records memory. A block allocated under an earlier profile
    # and freed after it leaves its address in the table; a block malloc later puts at that address
    # outside any profile is then "freed" inside this one with the stale size (notebook 06 measures six
    # steps in one kernel; in two full runs the MiniLM step's peak fell by 64 KiB, as malloc happened to
    # reuse such an address). The level is
    # rebuilt here from this call's own events: a free counts only for a block allocated inside the call.
    events = []
    stack = [(node, None) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, parent = stack.pop()
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size, fields.total_allocated, parent))
        stack.extend((child, node) for child in node.children)
    if not events:
        return {"largest_block": 0, "peak_extra": 0, "n_allocations": 0, "largest_op": None}
    live: dict[int, int] = {}
    level = peak = 0
    for _, ptr, size, _, _ in _allocator_order(events):
        if size > 0:
            live[ptr] = size
            level += size
        elif ptr in live:
            level -= live.pop(ptr)
        peak = max(peak, level)
    largest = max(events, key=lambda a: a[2])
    op = largest[4]
    return {
        "largest_block": int(largest[2]),
        "peak_extra": int(peak),
        "n_allocations": sum(1 for a in events if a[2] > 0),
        "largest_op": None if op is None else op.name,
    }
