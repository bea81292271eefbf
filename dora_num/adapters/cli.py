"""``dora-num collapse``: registered into the CLI by :func:`register`.

    python -m dora_num collapse ADAPTER_DIR [--base MODEL_DIR] [--out FILE.csv]

Prints the pooled collapse statistics per format (``--per-module`` prints every
module) and writes the full table (one row per module x format, plus pooled
rows) to ``--out``.  Exit status 2 on a malformed adapter or base model, with the
problem on stderr.  The help text below is what a user reads (no markup).
"""

from __future__ import annotations

import sys

PRINT_COLUMNS = ["module", "format", "n", "g_mean", "g_std", "abs_gm1_q50", "abs_gm1_q99", "frac_symmetric_zone",
                 "frac_rounds_to_one", "absorption"]


def _cmd_collapse(args) -> int:
    import warnings
    from pathlib import Path

    import pandas as pd

    from ..numerics.formats import NARROW_FORMATS
    from .collapse import POOLED, analyse_adapter
    from .peft_io import AdapterError

    formats = tuple(args.formats or NARROW_FORMATS)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            more = {} if args.texts is None else {"n_texts": args.texts}
            df = analyse_adapter(args.adapter_dir, args.base, formats=formats, activations=not args.no_activations,
                                 progress=not args.quiet, **more)
        for w in caught:
            if "absorption" in str(w.message):
                print(f"dora-num collapse: warning: {w.message}", file=sys.stderr)
    except (AdapterError, ValueError, FileNotFoundError) as e:
        print(f"dora-num collapse: {e}", file=sys.stderr)
        return 2
    shown = df if args.per_module else df[df["module"] == POOLED]
    if shown.empty:  # a one-module adapter has no pooled row
        shown = df
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_rows", 500,
                           "display.float_format", "{:.4g}".format):
        print(shown[[c for c in PRINT_COLUMNS if c in shown.columns]].to_string(index=False))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(out, index=False, lineterminator="\n")
        print(f"wrote {out} ({len(df)} rows)")
    return 0


DESCRIPTION = """\
How often does DoRA's magnitude scale g = m / ||W + s*B*A|| (per output row) collapse to 1
when stored in a low-precision format? Reads a PEFT DoRA adapter and its base model, forms
g for every adapted module in float64, and prints one row per format (pooled over modules).
Exit status 2 when the adapter or the base model cannot be read."""

COLUMNS = """\
columns:
  module               the adapted module, or "(all modules)" for the pooled row
  format               storage format (bf16, fp16, fp8_e4m3fn, fp8_e5m2)
  n                    number of g values (output rows)
  g_mean, g_std        mean and standard deviation of g
  abs_gm1_q50, _q99    median and 99th percentile of |g - 1|
  frac_symmetric_zone  fraction with |g - 1| < eps/2 (the usual "collapse zone")
  frac_rounds_to_one   fraction whose value rounded to the format is exactly 1: the zone
                       is asymmetric, [1 - eps/4, 1 + eps/2], since the spacing below 1
                       is half the spacing above
  absorption           fraction of real base activations x (the base model run on
                       validation text, rounded to the format) with fl(g*x) == x: where
                       the magnitude scaling is lost in the product itself
--out writes every column (more quantiles, the zone ends, per-module rows)."""


def register(sub) -> None:
    """Add ``collapse`` to the CLI's subparsers."""
    import argparse

    from ..numerics.formats import NARROW_FORMATS

    p = sub.add_parser("collapse", help="collapse statistics of g for a PEFT DoRA adapter (per module and format)",
                       description=DESCRIPTION, epilog=COLUMNS, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("adapter_dir", metavar="ADAPTER_DIR", help="folder with adapter_config.json + adapter_model.safetensors|.bin")
    p.add_argument("--base", metavar="MODEL_DIR", default=None,
                   help="base model folder (*.safetensors or *.bin); default: the config's base_model_name_or_path "
                        "if it is a folder, or the packaged all-MiniLM-L6-v2")
    p.add_argument("--out", metavar="FILE.csv", default=None, help="write the full table here")
    p.add_argument("--formats", nargs="+", default=None, metavar="FORMAT",
                   help=f"format names or aliases (default: {' '.join(NARROW_FORMATS)})")
    p.add_argument("--per-module", action="store_true", help="print every module, not only the pooled rows")
    p.add_argument("--no-activations", action="store_true", help="skip running the base model (no absorption column)")
    p.add_argument("--texts", type=int, default=None,
                   help="validation sentences run through the base model (float64) for activations "
                        "(default: collapse.ACTIVATION_TEXTS, 32)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr")
    p.set_defaults(func=_cmd_collapse)
