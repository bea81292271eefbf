"""dora-num: the floating-point behaviour of DoRA, with exact ground truth.

Public API (DESIGN.md section 4)::

    dense_row_norm, factored_row_norm, magnitude_scale,
    compose_naive, compose_stable, compose, DoRALinear,
    check_pending (read every deferred finiteness check now: dora_num.ops.finite)
"""

from .ops.compose import compose
from .ops.finite import NotFiniteError, check_pending
from .ops.layer import DoRALinear
from .ops.norm import base_row_norm_sq, dense_row_norm, factored_row_norm, magnitude_scale
from .ops.reference import compose_naive, compose_stable
from .repro.notebook import setup

__version__ = "0.1.0"

_LAZY = {  # heavier modules (PEFT, transformers, pandas) load on first use
    "load_peft_dora": "dora_num.adapters.peft_io",
    "collapse_table": "dora_num.adapters.collapse",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dora_num' has no attribute {name!r}")

__all__ = [
    "DoRALinear",
    "NotFiniteError",
    "check_pending",
    "base_row_norm_sq",
    "collapse_table",
    "load_peft_dora",
    "compose",
    "compose_naive",
    "compose_stable",
    "dense_row_norm",
    "factored_row_norm",
    "magnitude_scale",
    "setup",
]
