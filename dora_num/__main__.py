"""Command line: ``python -m dora_num <command>`` (also the ``dora-num`` script)."""

from __future__ import annotations

import argparse
import sys


def _cmd_reproduce(args) -> int:
    from .repro.runner import NotebookFailed, reproduce

    try:
        reproduce(args.only or None, smoke=args.smoke)
    except NotebookFailed as e:
        print(f"dora-num reproduce: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"dora-num reproduce: {e}", file=sys.stderr)
        return 2
    return 0


_COMMAND_MODULES = (
    "dora_num.adapters.cli",  # collapse
    "dora_num.studies.cli",  # record NAME, gpu-suite
    "dora_num.check",  # bounds check
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dora-num", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("reproduce", help="run the notebooks through papermill, regenerating figures/ and data/")
    r.add_argument("--smoke", action="store_true", help="tiny sizes, outputs to a temporary folder (CI)")
    r.add_argument("--only", nargs="+", metavar="NN", help="notebook numbers or stems to run, e.g. 00 03")
    r.set_defaults(func=_cmd_reproduce)
    # Commands owned by other modules register themselves: register(subparsers).
    import importlib

    for mod in _COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
