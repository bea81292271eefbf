"""The operator's switches, in one frozen configuration object.

Every choice of implementation that is not an argument of a call lives here: the
compose tier taken by ``path="auto"``, where the factored norm's tail runs, whether
``DoRALinear`` folds its output add into the compose pass, where ``dg``'s second
stage runs, whether the fused backward recomputes ``inner``, the kernels' tile
sizes, and whether Triton runs under its CPU interpreter.  Nothing in the package
assigns to another module's globals to change these; studies and tests use
:func:`override`.

Sources, in order:

1. the process default, built from the environment by :func:`from_env` the first
   time :func:`get_config` is called (so a variable set after ``import dora_num``
   but before the first operator call is honoured); :func:`reload` builds it again;
2. :func:`override`, a context manager whose changes are visible only inside the
   ``with`` block and only to the thread (or asyncio task) that entered it
   (``contextvars``), so concurrent studies do not see each other's switches.

Environment variables (each validated; an invalid value raises ``ValueError``
naming the variable):

=============================  ===========================================  =========
variable                       field                                        default
=============================  ===========================================  =========
``DORA_NUM_COMPOSE_PATH``      ``compose_path``: auto / eager / fused        auto
``DORA_NUM_NORM_TAIL``         ``norm_tail``: auto / triton / torch          auto
``DORA_NUM_FOLD_OUTPUT_ADD``   ``fold_output_add`` (0 / 1)                   1
``DORA_NUM_DG_TWO_LAUNCH``     ``dg_stage2_in_kernel`` is its negation       0
``DORA_NUM_RECOMPUTE_INNER``   ``recompute_inner`` (0 / 1)                   1
``TRITON_INTERPRET``           ``interpret`` (read only: Triton reads it     0
                               itself at import, so it cannot be overridden)
=============================  ===========================================  =========

Under ``torch.compile`` the configuration is read while tracing: it is a
trace-time constant of the compiled graph.  A change made later (by
:func:`override` or :func:`reload`) applies to eager calls at once, and to a
compiled function only after it is compiled again (``torch._dynamo.reset()``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

COMPOSE_PATHS = ("auto", "eager", "fused")
NORM_TAIL_MODES = ("auto", "triton", "torch")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class ComposeTiles:
    """Launch geometry of the compose kernels (:mod:`dora_num.ops.kernels.compose`).

    From the GPU suite's tile sweep at 8192x8192 bf16 on the H200
    (``data/gpu/tile_sweep.csv``).  Forward: every tile of 2048..16384 elements with
    4 or 8 warps reached 92.0-93.4% of the copy bandwidth, so 4096 / 4 warps.
    Backward: 64 x 128 with 4 warps was best for the saved-inner kernel (89.1%),
    against 62-85% for 32-row tiles and 36-88% for 128-row tiles; taller tiles
    also keep the number of row blocks, which enters the dg bound, small.  Under
    the CPU interpreter each program costs about a millisecond, so
    :func:`from_env` takes :meth:`for_interpreter` there.
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
    """Launch geometry of the factored norm's tail kernel (:mod:`dora_num.ops.kernels.norm_tail`)."""

    block_m: int = 32  # rows per program (d_out = 4096 -> 128 programs on 132 SMs)
    block_r: int = 64  # columns of B G (and of cross) per step
    block_k: int = 32  # reduction step of B @ G
    num_warps: int = 4

    def __post_init__(self):
        _check_positive_ints(self)


def _check_positive_ints(obj) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class OpConfig:
    """One immutable set of operator switches (module docstring for each source)."""

    compose_path: str = "auto"  # what compose(path="auto") resolves to: auto / eager / fused
    norm_tail: str = "auto"  # factored norm tail: auto (Triton on CUDA), triton (also CPU interpreter), torch
    fold_output_add: bool = True  # DoRALinear: base + delta inside the compose pass (bitwise the same)
    dg_stage2_in_kernel: bool = True  # dg's fixed-order second stage inside the backward kernel
    recompute_inner: bool = True  # fused backward recomputes inner = s*lora + base (saves base, lora)
    compose_tiles: ComposeTiles = field(default_factory=ComposeTiles)
    norm_tail_tiles: NormTailTiles = field(default_factory=NormTailTiles)
    interpret: bool = False  # Triton runs under TRITON_INTERPRET=1 (CPU); read from the environment
    poison: bool = False  # fill every buffer a kernel launcher allocates with NaN (tests)

    def __post_init__(self):
        if self.compose_path not in COMPOSE_PATHS:
            raise ValueError(f"compose_path must be one of {COMPOSE_PATHS}, got {self.compose_path!r}")
        if self.norm_tail not in NORM_TAIL_MODES:
            raise ValueError(f"norm_tail must be one of {NORM_TAIL_MODES}, got {self.norm_tail!r}")
        for name in ("fold_output_add", "dg_stage2_in_kernel", "recompute_inner", "interpret", "poison"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.compose_tiles, ComposeTiles):
            raise TypeError(f"compose_tiles must be a ComposeTiles, got {type(self.compose_tiles).__name__}")
        if not isinstance(self.norm_tail_tiles, NormTailTiles):
            raise TypeError(f"norm_tail_tiles must be a NormTailTiles, got {type(self.norm_tail_tiles).__name__}")


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
        compose_tiles=ComposeTiles.for_interpreter() if interpret else ComposeTiles(),
        interpret=interpret,
    )


_default: OpConfig | None = None
_active: contextvars.ContextVar[OpConfig | None] = contextvars.ContextVar("dora_num_op_config", default=None)


def get_config() -> OpConfig:
    """The configuration in force here: the innermost :func:`override`, else the
    process default (built from the environment at the first call)."""
    cfg = _active.get()
    if cfg is not None:
        return cfg
    global _default
    if _default is None:
        _default = from_env()
    return _default


def reload() -> OpConfig:
    """Build the process default from the environment again (e.g. after changing a
    variable in a running session) and return it; overrides in force stay in force."""
    global _default
    _default = from_env()
    return _default


@contextlib.contextmanager
def override(**changes) -> Iterator[OpConfig]:
    """Run a block under the current configuration with ``changes`` applied.

    ``with override(norm_tail="torch", fold_output_add=False): ...``.  Unknown
    names raise ``TypeError``; invalid values raise as :class:`OpConfig` does.
    Nested overrides compose; each is undone on exit, also on an exception.
    ``interpret`` cannot be changed (Triton fixes it when it is imported).
    """
    if "interpret" in changes and changes["interpret"] != get_config().interpret:
        raise ValueError("interpret follows TRITON_INTERPRET, which Triton reads once at import; "
                         "set the variable before importing triton instead")
    cfg = dataclasses.replace(get_config(), **changes)
    token = _active.set(cfg)
    try:
        yield cfg
    finally:
        _active.reset(token)
