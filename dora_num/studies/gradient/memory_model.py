"""A peak-memory model of DoRA fine-tuning.

:func:`predict_peak` adds, for one training step in steady state (optimizer states
exist, gradients set to None before the forward), the bytes of the frozen weights, the
adapters, their optimizer states and gradients, the saved activations and the largest
transient of three phases (the forward's norm, the loss head's backward, a layer's
backward), within :data:`TOLERANCE` of the measured peak, stated a priori.  Its measurement:
:mod:`~dora_num.studies.gradient.record_memory`; out of sample:
:mod:`~dora_num.studies.gradient.memory_holdout`.  The method in full: docs/methods.md,
"studies/gradient/memory_model.py".
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import pandas as pd

from ...ops.norm import chunk_columns  # the operator's own chunking rule

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NORMS = ("dense", "factored", "cached")
ARCHS = ("stack", "bert")
TOLERANCE = 0.15  # relative; stated a priori: the model ignores allocator rounding and small temporaries


@dataclass(frozen=True)
class MemoryConfig:
    arch: str = "stack"
    hidden: int = 8192
    n_layers: int = 4
    intermediate: int = 0  # bert FFN width
    heads: int = 1
    vocab: int = 0  # bert embeddings (word + position + type) in weights
    max_pos: int = 0
    targets: str = "all"  # DoRA on every linear of each layer ("all") or "attention" (bert q,k,v,o)
    rank: int = 16
    dtype: str = "fp32"  # weights, adapters and activations
    batch: int = 1
    seq: int = 1024
    optimizer: str = "adamw"
    checkpointing: bool = False
    zero_stage: int = 0
    n_gpus: int = 1
    norm: str = "cached"
    compose: str = "eager"
    dropout: bool = False
    chunk_bytes: int = 256 * 2**20
    fp32_out_mm: bool = False  # CUDA 16-bit W: U = W A^T without an fp32 copy of W

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.dtype not in BYTES:
            raise ValueError(f"dtype must be one of {tuple(BYTES)}, got {self.dtype!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.compose not in ("eager", "fused"):
            raise ValueError(f"compose must be eager or fused, got {self.compose!r}")
        if self.optimizer != "adamw":
            raise ValueError(f"optimizer must be 'adamw' (the only one modelled), got {self.optimizer!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for name in ("hidden", "n_layers", "rank", "batch", "seq", "n_gpus", "heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.arch == "bert" and self.intermediate < 1:
            raise ValueError("intermediate must be a positive int for arch='bert'")
        if self.targets not in ("all", "attention"):
            raise ValueError(f"targets must be 'all' or 'attention', got {self.targets!r}")


MINILM = MemoryConfig(arch="bert", hidden=384, n_layers=6, intermediate=1536, heads=12, vocab=30522, max_pos=512,
                      rank=16, dtype="fp32", batch=32, seq=64, dropout=True)


def layer_linears(cfg: MemoryConfig) -> list[tuple[str, int, int, bool]]:
    """``(name, d_in, d_out, targeted)`` of one layer's linears."""
    h = cfg.hidden
    if cfg.arch == "stack":
        return [("fc", h, h, True)]
    att = [("query", h, h), ("key", h, h), ("value", h, h), ("attention.output", h, h)]
    ffn = [("intermediate", h, cfg.intermediate), ("output", cfg.intermediate, h)]
    return [(n, i, o, True) for n, i, o in att] + [(n, i, o, cfg.targets == "all") for n, i, o in ffn]


def _norm_transient(cfg: MemoryConfig, d_in: int, d_out: int) -> int:
    """Largest working set of one module's row norm (bytes), as :mod:`dora_num.ops.norm` allocates.

    The factored norm is charged the torch tail's row blocks (capped at 6 MiB, the row
    budget when the model was fitted); on CUDA the tail kernel has none, so this term
    is an upper bound there by up to 6 MiB.  In every recorded H200 configuration
    another term or phase is the larger one, so no recorded prediction depends on it."""
    w = BYTES[cfg.dtype]
    r = cfg.rank
    dense = d_out * d_in * 4
    if cfg.norm == "dense":  # W.float() (a copy unless fp32) + BA + s*BA, then + the sum
        return (2 if w == 4 else 3) * dense + d_out * 4
    cols = chunk_columns(d_out, d_in, cfg.chunk_bytes)
    wchunk = d_out * cols * 4
    u_gram = d_out * r * 4 + r * r * 4 + min(6 * 2**20, 3 * d_out * r * 4)
    u_copy = 0 if (w == 4 or cfg.fp32_out_mm) else wchunk + r * cols * 4  # fp32 chunk of W (and of A)
    if cfg.norm == "factored":
        base = (1 if w == 4 else 2) * wchunk  # the chunk's square (+ the fp32 copy of a 16-bit chunk)
        return max(base + d_out * 4, u_gram + u_copy + d_out * 4)
    return u_gram + u_copy + 2 * d_out * 4


def _module_acts(cfg: MemoryConfig, d_out: int) -> int:
    e = BYTES[cfg.dtype]
    T = cfg.batch * cfg.seq
    keep = 4 if cfg.compose == "eager" else 2 * e
    return T * cfg.rank * e + T * d_out * keep


def _compose_bwd_transient(cfg: MemoryConfig, d_out: int) -> int:
    """Working set of one compose backward (:func:`dora_num.ops.reference.compose_backward_ref`:
    fp32 ``D``, ``dlora``, ``dbase`` and the products ``inner*D``, then casts; the fused
    kernel writes ``dlora``, ``dbase`` in the activation dtype)."""
    e = BYTES[cfg.dtype]
    T = cfg.batch * cfg.seq
    if cfg.compose == "fused":
        return 2 * T * d_out * e
    return T * d_out * (3 * 4 + (4 if e < 4 else 0))  # + the fp32 copy of a 16-bit D


def _layer_acts(cfg: MemoryConfig) -> int:
    e = BYTES[cfg.dtype]
    T = cfg.batch * cfg.seq
    h = cfg.hidden
    dora = sum(_module_acts(cfg, o) for _, _, o, t in layer_linears(cfg) if t)
    if cfg.arch == "stack":
        return 2 * T * h * e + dora
    f = cfg.intermediate
    masks = 2 * T * h if cfg.dropout else 0
    ln = 2 * (2 * T * h * e + 2 * T * 4)
    attn = 3 * T * h * e + T * h * e + cfg.batch * cfg.heads * cfg.seq * 4 + T * h * e  # qkv, out+lse, context
    return T * h * e + attn + ln + 2 * T * f * e + masks + dora


def _loss_bwd_transient(cfg: MemoryConfig) -> int:
    """Working set of the loss head's backward, allocated on top of EVERY activation
    (none has been freed yet: it is the first node the backward runs).

    ``stack``: ``loss = mean(hf ** 2)`` with ``hf = out.float()`` (``T h`` fp32).
    ``MeanBackward`` materialises ``grad / numel`` as a ``[T, h]`` fp32 tensor, and
    ``PowBackward0`` evaluates ``grad * (2 * hf.pow(1))`` in one C++ expression, so
    ``hf.pow(1)`` (a copy), ``2 * (...)`` and the product coexist with ``grad``:
    4 fp32 ``[T, h]`` tensors, ``16 T h`` bytes, more than any compose backward
    (eager: 16 bytes per element; fused: ``2 e``) together with the activations the
    compose backward no longer shares memory with (``hf`` and the last GELU input
    are freed by then).
    ``bert``: ``mean_pool`` saves the fp32 hidden state; ``MulBackward0`` writes one
    ``[T, h]`` fp32 gradient (the pooled and squared tensors are ``[batch, h]``)."""
    T = cfg.batch * cfg.seq
    return (4 if cfg.arch == "stack" else 1) * T * cfg.hidden * 4


def _inputs(cfg: MemoryConfig) -> int:
    """The step's input tensors: allocated before the step (so outside the CPU
    measurement's dynamic part) but after the CUDA baseline, hence static."""
    T = cfg.batch * cfg.seq
    return T * cfg.hidden * BYTES[cfg.dtype] if cfg.arch == "stack" else 2 * T * 8  # bert: int64 ids + mask


def predict_peak(cfg: MemoryConfig) -> dict:
    """Peak bytes of one steady-state training step, by component (docs/methods.md)."""
    cfg.validate()
    w = BYTES[cfg.dtype]
    N = cfg.n_gpus
    lins = layer_linears(cfg)
    L = cfg.n_layers
    bias = cfg.arch == "bert"  # the synthetic stack has no biases
    base_params = L * sum(i * o + (o if bias else 0) for _, i, o, _ in lins)
    if cfg.arch == "bert":
        h = cfg.hidden
        base_params += L * 4 * h + (cfg.vocab + cfg.max_pos + 2) * h + 2 * h  # LayerNorms, embeddings (+ LN)
    targeted = [(i, o) for _, i, o, t in lins if t]
    n_ad = L * sum(cfg.rank * (i + o) for i, o in targeted)
    n_m = L * sum(o for _, o in targeted)
    adapter = n_ad * w + n_m * 4
    shard = lambda x, stage: x / N if cfg.zero_stage >= stage else x  # noqa: E731
    comp = {
        "weights": shard(base_params * w, 3),
        "adapter_params": shard(adapter, 3),
        "base_sq_cache": (n_m * 4) if cfg.norm == "cached" else 0,
        "optimizer_states": shard(2 * adapter, 1),
        "gradients": shard(adapter, 2),
        "inputs": _inputs(cfg),
    }
    T = cfg.batch * cfg.seq
    e = w
    layer = _layer_acts(cfg)
    bound_ = T * cfg.hidden * e  # one layer's input (a checkpoint boundary)
    inp = bound_ if cfg.arch == "stack" else 0  # the stack's input tensor exists before the step
    head = T * cfg.hidden * 4 if cfg.arch == "stack" else 2 * T * cfg.hidden * 4
    norm_t = max(_norm_transient(cfg, i, o) for i, o in targeted)
    bwd_t = max(_compose_bwd_transient(cfg, o) + T * i * e + T * cfg.rank * e for i, o in targeted)
    loss_t = _loss_bwd_transient(cfg)
    if cfg.checkpointing:
        acts = L * bound_ - inp + head
        phases = {"forward_norm": acts - head + norm_t,
                  "loss_backward": acts + loss_t,
                  "backward": acts - head - bound_ + layer + comp["gradients"] + bwd_t}
    else:
        acts = L * layer - inp + head
        phases = {"forward_norm": acts - head - layer + norm_t,
                  "loss_backward": acts + loss_t,
                  # the loss head's saved tensors are freed once its node has run; the last
                  # module's output gradient (T h e) is live during its compose backward
                  "backward": acts - head + bound_ + comp["gradients"] + bwd_t}
    comp["activations"] = acts
    comp["norm_transient"] = norm_t
    comp["loss_transient"] = loss_t
    comp["backward_transient"] = bwd_t
    static = sum(comp[k] for k in ("weights", "adapter_params", "base_sq_cache", "optimizer_states", "inputs"))
    comp["static"] = static
    comp["dynamic"] = max(phases.values())
    comp["peak"] = static + comp["dynamic"]
    comp["norm_phase_dominates"] = int(phases["forward_norm"] > max(phases["loss_backward"], phases["backward"]))
    comp["phase"] = max(phases, key=phases.get)
    return {k: (v if isinstance(v, str) else int(round(v))) for k, v in comp.items()}


def zero_table(cfg: MemoryConfig, n_gpus=(1, 2, 4, 8)):
    """Predicted per-GPU components for ZeRO stages 0-3 (the model's arithmetic only)."""
    rows = []
    for n in n_gpus:
        for st in (0, 1, 2, 3):
            rows.append({"zero_stage": st, "n_gpus": n, **predict_peak(replace(cfg, zero_stage=st, n_gpus=n))})
    return pd.DataFrame(rows)


def repredict(measured):
    """Recompute the predictions of a measured table (e.g. ``data/gpu/memory/memory_peaks.csv``)
    with the CURRENT model, from its config columns; the measurements are kept.  The
    predictions recorded at measurement time move to ``predicted_at_measure`` /
    ``rel_err_at_measure``.  Rows with an ``error`` are dropped."""
    df = measured.copy()
    if "error" in df:
        df = df[df["error"].isna() | (df["error"].astype(str) == "")]
    df = df.rename(columns={"predicted": "predicted_at_measure", "rel_err": "rel_err_at_measure"})
    names = [f.name for f in fields(MemoryConfig)]
    missing = [n for n in names + ["measured", "compared"] if n not in df]
    if missing:
        raise ValueError(f"measured table lacks the columns {missing}")
    rows = []
    for _, r in df.iterrows():
        cfg = MemoryConfig(**{n: (r[n].item() if hasattr(r[n], "item") else r[n]) for n in names})
        pred = predict_peak(cfg)
        rows.append({**{f"pred_{k}": v for k, v in pred.items()}, "predicted": pred[r["compared"]]})
    new = pd.DataFrame(rows, index=df.index)
    df = df.drop(columns=[c for c in new.columns if c in df])
    df = pd.concat([df, new], axis=1)
    df["rel_err"] = (df["predicted"] - df["measured"]) / df["measured"]
    return df

