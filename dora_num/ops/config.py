"""The operator's switches, in one frozen configuration object (:class:`OpConfig`).

Every choice of implementation that is not an argument of a call lives here (compose tier, norm tail,
folds, dg's second stage, recomputes, tiles, finiteness checks, the norm cache).  Sources: the process
default from the environment (:func:`from_env`, read at the first :func:`get_config`; every variable
validated and named in its error), and :func:`override`, a thread-local context.  Code reads
:func:`get_config` once per public call and hands the result down (kernel launchers take
``config=``), so a backward keeps its forward's configuration.  Under ``torch.compile`` the
configuration is a trace-time constant guarded by Dynamo (another one traces again).  The
environment table and the compile behaviour in full: docs/operator.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

COMPOSE_PATHS = ("auto", "eager", "fused")
NORM_TAIL_MODES = ("auto", "triton", "torch")
FINITE_CHECKS = ("deferred", "late", "sync", "off")
SPLIT_PIECES = (2, 3)
NORM_CACHE_MODES = ("recompute", "always", "off")
TAIL_BG_MODES = ("fma", "tensor_core")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class ComposeTiles:
    """Launch geometry of the compose kernels (:mod:`dora_num.ops.kernels.compose`).

    From the tile sweep at 8192x8192 bf16 (``data/gpu/tile_sweep.csv``; the H200 first, the H100 since
    90d2c3b): forward tiles of 2048..16384 elements all reach 92-93% of the copy bandwidth on both (4096 / 4
    warps kept); backward 64 x 128 / 4 warps was best for both kernels on the H200 and is within 1% of the
    H100's best (128 x 128 for the kernel that reads ``inner``, 91.7% against 91.3% of copy), and taller
    tiles keep the row blocks (which enter the dg bound) few.  ``bwd_block_m`` and ``fin_chunk`` fix the order of ``dg``'s sum
    (:func:`dora_num.ops.kernels.compose.dg_error_bound`).  The interpreter pays per program:
    :meth:`for_interpreter`.
    """

    fwd_tile_elems: int = 4096  # elements per forward program (BLOCK_M * BLOCK_N)
    fwd_max_block_n: int = 1024  # widest forward column block
    fwd_num_warps: int = 4
    bwd_block_m: int = 64  # rows per backward program (one dg partial per program and column)
    bwd_max_block_n: int = 128
    bwd_num_warps: int = 4
    fin_block_n: int = 64  # dg stage 2: columns per program (separate-launch mode)
    fin_chunk: int = 64  # dg stage 2: partial rows summed per step

    def __post_init__(self):
        _check_positive_ints(self)

    @classmethod
    def for_interpreter(cls) -> "ComposeTiles":
        """Few, large programs (the interpreter's cost is per program, not per element)."""
        return cls(fwd_tile_elems=1 << 16, bwd_max_block_n=1024, fin_block_n=1024)


@dataclass(frozen=True)
class NormTailTiles:
    """Launch geometry of the factored norm's tail kernel (:mod:`dora_num.ops.kernels.norm_tail`).

    Defaults from the sweep in ``data/gpu/tile_sweep.csv`` (``dora-num record tiles``, its ``norm_tail``
    rows at the operator's shapes and ranks).  ``block_m`` is the divisor of the flag's program count;
    ``block_r`` and ``block_k`` fix the order of ``cross`` and ``ba`` (within lemma 4's bound in any).
    """

    block_m: int = 32  # rows per program (d_out = 4096 -> 128 programs on 132 SMs)
    block_r: int = 64  # columns of B G (and of cross) per step
    block_k: int = 32  # reduction step of B @ G
    # the guard's float64 recompute of flagged rows: columns of W per step (two [block_m, block_d]
    # float64 accumulators, 16 registers per thread at 32 x 32 and 4 warps: no more than the
    # fp32 B @ G tile of the main loop, so the rare path does not raise the kernel's register count)
    block_d: int = 32
    num_warps: int = 4

    def __post_init__(self):
        _check_positive_ints(self)


@dataclass(frozen=True)
class RowSumsqTiles:
    """Launch geometry of the row-sum kernel ``base_sq = rowsum(W*W)`` (:mod:`dora_num.ops.kernels.row_sumsq`).

    ``block_m`` and ``block_k`` fix the order of every row's sum (blocks of ``block_k`` columns, each
    reduced by ``tl.sum``'s tree, added in sequence), so they are part of what a cached ``base_sq``
    was formed under (:func:`dora_num.ops.norm.base_cache_key`); any tiles are within lemma 4's bound
    of ``base``.  The sweep in ``data/gpu/tile_sweep.csv`` (``dora-num record tiles``, its ``row_sumsq``
    rows at the operator's shapes against the copy bandwidth; the H100 at 90d2c3b) puts these defaults (the
    constants they were before the sweep) at 70-82% of copy, and ``block_k = 1024`` at 88-92% on 4096 x 4096
    and 4096 x 14336 (``block_k = 256``: 89% on 14336 x 4096): not changed yet, since a change moves the last
    bit of every GPU ``base_sq`` and with it the recorded GPU norms (0.02-0.07 ms per projection, once per W
    except under CUDA graphs).  Powers of two (``tl.arange``'s extents and Triton's warp counts).
    """

    block_m: int = 8  # rows per program (d_out = 1024: 128 programs on 132 SMs)
    block_k: int = 512  # columns per step (1 KiB of bf16 per row per step)
    num_warps: int = 4

    def __post_init__(self):
        _check_positive_ints(self)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v & (v - 1):
                raise ValueError(f"RowSumsqTiles.{f.name} must be a power of two, got {v}")


def _check_positive_ints(obj) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be a positive int, got {v!r}")


# OpConfig's fields that hold a kernel's tiles: validated by type, written into the key as objects
_TILES = {"compose_tiles": ComposeTiles, "norm_tail_tiles": NormTailTiles, "row_sumsq_tiles": RowSumsqTiles}


@dataclass(frozen=True)
class OpConfig:
    """One immutable set of operator switches (module docstring for each source).

    ``finite_check`` is how :class:`~dora_num.ops.layer.DoRALinear`, :func:`~dora_num.ops.compose.compose`
    and :func:`~dora_num.ops.norm.factored_row_norm` check finiteness on a CUDA device
    (:mod:`dora_num.ops.finite`; on the CPU every mode but ``"off"`` reads the flag at
    once: there is no device to drain): ``"deferred"`` (the default: the device flag is
    copied to pinned host memory behind an event and read once that event has completed,
    at a later public call of this package or at :func:`~dora_num.ops.finite.check_pending`;
    the error then names the call at fault; no host wait at all), ``"late"`` (read at the
    end of the call: the host waits for the work queued up to the flag), ``"sync"`` (read
    right away: the device is drained; the A/B baseline) or ``"off"`` (no check: only for
    timing what the check costs; a non-finite value then propagates).

    ``split_pieces``: how many 16-bit pieces the factored norm splits an fp32 ``A`` into
    when W is 16-bit (:func:`~dora_num.ops.norm.split_pieces`): 3 (the default: exact for
    every ``|A| >= 2^-110``) or 2 (about 17 bits of A; a study variant).

    ``traced_ops``: under ``torch.compile`` on CUDA the fused compose's forward and backward, the norm's
    products and ``g = m / den`` are ``torch.library.triton_op``s, whose bodies Inductor traces and whose
    kernels its generated code launches (:func:`dora_num.ops.compose.traceable`; the same kernels and
    bits; the default); off: the opaque custom ops, whose Python runs in every call (a diagnostic, and the
    path of rank 1, where Inductor rewrites the K = 1 products).

    ``traced_tail`` (with ``traced_ops``): the norm's tail kernel launched by Inductor too, beside one short
    opaque op (the base cache's refresh); off (the default until a GPU has held it to the eager bits and timed
    it): the refresh and the tail's launch in one opaque op, ``dora_num::norm_den`` (docs/operator.md, "A
    compiled step").

    ``tail_bg``: how the Triton tail of the factored norm forms ``B G`` (``ba = rowsum((B G) * B)``): ``"fma"``
    (the default: an IEEE fp32 dot, fp32 FMA on the CUDA cores) or ``"tensor_core"`` (each tile of ``B`` and
    ``G`` split in registers into bf16 pieces, their products exact on tensor cores with fp32 accumulation;
    the guard's constants and lemma 4 charge it: docs/bounds.md, "The tail's B G on tensor cores").

    ``norm_cache``: :class:`~dora_num.ops.layer.DoRALinear` keeps its last denominator of ``g``
    (``wnorm``, ``eps`` on a zero row) keyed on the storage and version counters of W, A, B and m.  ``"recompute"`` (the default)
    reuses it only inside a backward pass, i.e. for the recompute of an activation-checkpointed
    forward, where the parameters cannot have changed since the forward that stored it;
    ``"always"`` also across forward calls while the keys match (repeated inference);
    ``"off"``: computed every forward.  The reuse is bitwise invisible.  ``"always"`` is not
    safe while training: an optimizer that writes parameters without bumping their version
    counters (``torch.optim.AdamW(fused=True)``, HF Trainer's default ``adamw_torch_fused``;
    writes through ``.data``) leaves the key unchanged, and the cached norm would be stale.
    """

    compose_path: str = "auto"  # what compose(path="auto") resolves to: auto / eager / fused
    norm_tail: str = "auto"  # factored norm tail: auto (Triton on CUDA), triton (also CPU interpreter), torch
    fold_output_add: bool = True  # DoRALinear: base + delta inside the compose pass (bitwise the same)
    dg_stage2_in_kernel: bool = True  # dg's fixed-order second stage inside the backward kernel
    recompute_inner: bool = True  # fused backward recomputes inner = s*lora + base (saves base, lora)
    recompute_lora: bool = True  # DoRALinear's backward recomputes lora = (x A^T) B^T (saves x A^T, not lora)
    traced_ops: bool = True  # under torch.compile on CUDA the layer's kernels as triton_ops Inductor launches
    traced_tail: bool = False  # with traced_ops: the norm's tail launched by Inductor too (class docstring)
    compose_tiles: ComposeTiles = field(default_factory=ComposeTiles)
    norm_tail_tiles: NormTailTiles = field(default_factory=NormTailTiles)
    row_sumsq_tiles: RowSumsqTiles = field(default_factory=RowSumsqTiles)  # also in the key of a cached base_sq
    interpret: bool = False  # Triton runs under TRITON_INTERPRET=1 (CPU); read from the environment
    poison: bool = False  # fill every buffer a kernel launcher allocates with NaN (tests)
    finite_check: str = "deferred"  # finiteness checks on CUDA: deferred / late / sync / off (class docstring)
    split_pieces: int = 3  # 16-bit pieces of an fp32 A in the factored norm's products (2 or 3)
    norm_cache: str = "recompute"  # DoRALinear reuses its norm: recompute / always / off (class docstring)
    tail_bg: str = "fma"  # the Triton tail's B G: fma (fp32 dot) / tensor_core (bf16 pieces; class docstring)
    key: str = field(init=False, repr=False, compare=False)  # canonical text of the fields above

    def __post_init__(self):
        if self.compose_path not in COMPOSE_PATHS:
            raise ValueError(f"compose_path must be one of {COMPOSE_PATHS}, got {self.compose_path!r}")
        if self.norm_tail not in NORM_TAIL_MODES:
            raise ValueError(f"norm_tail must be one of {NORM_TAIL_MODES}, got {self.norm_tail!r}")
        if self.finite_check not in FINITE_CHECKS:
            raise ValueError(f"finite_check must be one of {FINITE_CHECKS}, got {self.finite_check!r}")
        if isinstance(self.split_pieces, bool) or self.split_pieces not in SPLIT_PIECES:
            raise ValueError(f"split_pieces must be one of {SPLIT_PIECES}, got {self.split_pieces!r}")
        if self.norm_cache not in NORM_CACHE_MODES:
            raise ValueError(f"norm_cache must be one of {NORM_CACHE_MODES}, got {self.norm_cache!r}")
        if self.tail_bg not in TAIL_BG_MODES:
            raise ValueError(f"tail_bg must be one of {TAIL_BG_MODES}, got {self.tail_bg!r}")
        for name in ("fold_output_add", "dg_stage2_in_kernel", "recompute_inner", "recompute_lora", "traced_ops",
                     "traced_tail",
                     "interpret", "poison"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name, cls in _TILES.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for name in _TILES:
            fields[name] = dataclasses.asdict(fields[name])
        object.__setattr__(self, "key", json.dumps(fields, sort_keys=True, separators=(",", ":")))

    @staticmethod
    def from_key(key: str) -> "OpConfig":
        """The configuration whose :attr:`key` is ``key`` (how the custom ops of
        :mod:`dora_num.ops.compose` and :mod:`dora_num.ops.norm` receive it: a traced
        graph holds it as a constant string)."""
        return _from_key(key)


@functools.lru_cache(maxsize=64)
def _from_key(key: str) -> OpConfig:
    fields = json.loads(key)
    for name, cls in _TILES.items():
        fields[name] = cls(**fields[name])
    return OpConfig(**fields)


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    raw = env.get(name, "")
    value = raw.strip().lower() or default
    if value not in choices:
        raise ValueError(f"environment variable {name} must be one of {choices}, got {raw!r}")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name} must be 0 or 1 (or true/false), got {raw!r}")


def from_env(env: Mapping[str, str] | None = None) -> OpConfig:
    """The configuration the environment ``env`` (default ``os.environ``) asks for."""
    env = os.environ if env is None else env
    interpret = _flag(env, "TRITON_INTERPRET", False)
    return OpConfig(
        compose_path=_choice(env, "DORA_NUM_COMPOSE_PATH", COMPOSE_PATHS, "auto"),
        norm_tail=_choice(env, "DORA_NUM_NORM_TAIL", NORM_TAIL_MODES, "auto"),
        fold_output_add=_flag(env, "DORA_NUM_FOLD_OUTPUT_ADD", True),
        dg_stage2_in_kernel=not _flag(env, "DORA_NUM_DG_TWO_LAUNCH", False),
        recompute_inner=_flag(env, "DORA_NUM_RECOMPUTE_INNER", True),
        recompute_lora=_flag(env, "DORA_NUM_RECOMPUTE_LORA", True),
        traced_ops=_flag(env, "DORA_NUM_TRACED_OPS", True),
        traced_tail=_flag(env, "DORA_NUM_TRACED_TAIL", False),
        tail_bg=_choice(env, "DORA_NUM_TAIL_BG", TAIL_BG_MODES, "fma"),
        compose_tiles=ComposeTiles.for_interpreter() if interpret else ComposeTiles(),
        interpret=interpret,
    )


def _import_time_default() -> OpConfig | None:
    try:
        return from_env()
    except ValueError:  # reported, naming the variable, by the first call of get_config()
        return None


# The process default.  Built from the environment at import only for a torch.compile trace
# that runs before any eager operator call (TorchDynamo cannot trace from_env); the first
# eager get_config() builds it again, so a variable set after import is honoured.
_default: OpConfig | None = _import_time_default()
_read_at_first_use = False
_local = threading.local()  # .config: this thread's innermost override (None or absent: none)
_local.config = None  # present in the importing thread: getattr with a default is slow where it is absent
_ABSENT = object()


def get_config() -> OpConfig:
    """The configuration in force here: this thread's innermost :func:`override`, else
    the process default (built from the environment at the first call).  Costs one
    attribute lookup; safe to call on every operator call."""
    cfg = getattr(_local, "config", None)  # (what TorchDynamo traces and guards on; _local.__dict__ it does not)
    if cfg is not None:
        return cfg
    # is_compiling() first: a trace that read _read_at_first_use would guard on it, and recompile once the
    # first eager call flips it
    if not torch.compiler.is_compiling() and not _read_at_first_use:
        return reload()
    return _default


def reload() -> OpConfig:
    """Build the process default from the environment again (e.g. after changing a
    variable in a running session) and return it.  An :func:`override` in force is a
    snapshot taken when it was entered: it keeps its values until its block ends."""
    global _default, _read_at_first_use
    fresh = from_env()
    if fresh != _default:  # an equal one is not swapped in: graphs traced on _default stay valid
        _default = fresh
    _read_at_first_use = True
    return _default


@contextlib.contextmanager
def override(**changes) -> Iterator[OpConfig]:
    """Run a block under the current configuration with ``changes`` applied.

    ``with override(norm_tail="torch", fold_output_add=False): ...``.  Unknown
    names raise ``TypeError``; invalid values raise as :class:`OpConfig` does.
    Nested overrides compose; each is undone on exit, also on an exception.  The
    change is seen by this thread only.  The backward of CUDA tensors runs on the autograd
    engine's thread; the operators' backward keeps its forward's configuration, and an eager
    :class:`~dora_num.ops.layer.DoRALinear` forward run inside a backward (the recompute of an
    activation-checkpointed forward) takes the configuration of that layer's last forward outside
    a backward: a forward of the same layer in between under another configuration, or a compiled
    layer's recompute (traced again under the configuration of the backward's thread), can still
    record other operations than the forward it replays (``torch.utils.checkpoint`` then raises
    ``CheckpointError``; its ``context_fn`` can enter the same override for the recompute).
    ``interpret`` cannot be changed (Triton fixes it when it is imported).
    """
    if "interpret" in changes and changes["interpret"] != get_config().interpret:
        raise ValueError("interpret follows TRITON_INTERPRET, which Triton reads once at import; "
                         "set the variable before importing triton instead")
    if "key" in changes:
        raise TypeError("key is derived from the other fields; it cannot be overridden")
    cfg = dataclasses.replace(get_config(), **changes)
    prev = _local.__dict__.get("config", _ABSENT)
    _local.config = cfg
    try:
        yield cfg
    finally:  # exactly the state before (absent or not: what a compiled graph guards on)
        if prev is _ABSENT:
            del _local.config
        else:
            _local.config = prev


def uses_tail_kernel(device: torch.device, config: OpConfig | None = None) -> bool:
    """Whether the factored norm's tail (cross, ba, assembly; for the layer also the clamp and
    the finiteness flag of g) runs as the one-launch Triton kernel of
    :mod:`dora_num.ops.kernels.norm_tail` on ``device`` under ``config`` (default
    :func:`get_config`): ``norm_tail="auto"`` on CUDA, ``"triton"`` on CUDA and on CPU under the
    interpreter; otherwise (``"torch"``, or CPU without the interpreter) the torch sequence runs."""
    cfg = get_config() if config is None else config
    if cfg.norm_tail == "torch":
        return False
    if device.type == "cuda":
        return True
    return cfg.norm_tail == "triton" and device.type == "cpu" and cfg.interpret


def traces_kernels(device: torch.device, config: OpConfig) -> bool:
    """Whether a compiled graph on ``device`` takes the traced ops, whose kernels Inductor launches
    (``OpConfig.traced_ops`` on, CUDA, not the interpreter, under which ``wrap_triton`` cannot trace a
    kernel): the one test the compose, the norm and ``g = m / den`` each add their own conditions to."""
    return config.traced_ops and not config.interpret and device.type == "cuda"
