"""dora-num: the floating-point behaviour of DoRA, with exact ground truth.

Public API (docs/design.md)::

    dense_row_norm, factored_row_norm, base_row_norm_sq, magnitude_scale    (dora_num.ops.norm)
    compose_naive, compose_stable, compose, DoRALinear                      (dora_num.ops)
    check_flags          (what compiled DoRALinear forwards flagged: dora_num.ops.layer)
    NotFiniteError, check_pending        (deferred finiteness checks: dora_num.ops.finite)
    wrap, merge, unmerge, merge_and_unload, trainable_parameters            (dora_num.wrapper)
    load_peft_dora, load_adapter, export_peft_dora                          (dora_num.adapters.peft_io)
    collapse_table (dora_num.adapters.collapse), check_bounds (dora_num.check), setup (notebooks)

``dora_num.peft.accelerate(peft_model)`` / ``restore``: a PEFT model's DoRA layers on this package's
operator (import ``dora_num.peft``).
"""

from .ops.compose import compose
from .ops.finite import NotFiniteError, check_pending
from .ops.layer import DoRALinear, check_flags
from .ops.norm import base_row_norm_sq, dense_row_norm, factored_row_norm, magnitude_scale
from .ops.reference import compose_naive, compose_stable
from .repro.notebook import setup

__version__ = "0.1.0"

_LAZY = {  # heavier modules (PEFT, transformers, pandas) load on first use
    "load_peft_dora": "dora_num.adapters.peft_io",
    "collapse_table": "dora_num.adapters.collapse",
    "check_bounds": "dora_num.check",
    "load_adapter": "dora_num.adapters.peft_io",
    "export_peft_dora": "dora_num.adapters.peft_io",
    "wrap": "dora_num.wrapper",
    "merge_and_unload": "dora_num.wrapper",
    "merge": "dora_num.wrapper",
    "unmerge": "dora_num.wrapper",
    "trainable_parameters": "dora_num.wrapper",
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
    "check_flags",
    "base_row_norm_sq",
    "check_bounds",
    "collapse_table",
    "load_peft_dora",
    "load_adapter",
    "export_peft_dora",
    "wrap",
    "merge",
    "unmerge",
    "merge_and_unload",
    "trainable_parameters",
    "compose",
    "compose_naive",
    "compose_stable",
    "dense_row_norm",
    "factored_row_norm",
    "magnitude_scale",
    "setup",
]
