"""Command line: ``python -m dora_num <command>`` (also the ``dora-num`` script)."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = ("Floating-point behaviour of DoRA: regenerate the notebooks' results, check them against the "
               "committed ones, analyse a PEFT DoRA adapter, record GPU measurements.")


def _cmd_reproduce(args) -> int:
    import shutil
    import tempfile
    from pathlib import Path

    from .repro import check as chk
    from .repro import paths
    from .repro.runner import Limits, NotebookFailed, reproduce

    dest = keep = None
    if args.check:
        dest = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="dora-num-check-"))
        keep = args.out is not None or args.keep
    elif args.out:
        dest = Path(args.out)
    try:
        limits = Limits(cell_s=args.cell_timeout, notebook_s=args.timeout, retries=args.retries)
    except ValueError as e:
        print(f"dora-num reproduce: {e}", file=sys.stderr)
        return 2
    try:
        results = reproduce(args.only or None, smoke=args.smoke, dest=dest, limits=limits,
                            progress=not args.no_progress)
    except NotebookFailed as e:
        print(f"dora-num reproduce: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"dora-num reproduce: {e}", file=sys.stderr)
        return 2
    if args.smoke:
        return 0
    ran = [r.notebook for r in results if not r.skipped]
    if not args.check:
        if dest is None and not args.only:
            from .repro.results import write_readme

            changed = write_readme()
            print(f"README.md results section {'updated' if changed else 'unchanged'}")
        print(f"artifacts of {len(ran)} notebook(s) in {dest or paths.REPO_ROOT}")
        return 0
    subdirs = [f"{top}/{nb}" for nb in ran for top in ("data", "figures")]
    outcomes = chk.compare_trees(dest, paths.REPO_ROOT, subdirs)
    print(chk.format_table(outcomes, verbose=args.verbose))
    bad_sidecars = chk.sidecar_mismatches(paths.REPO_ROOT, subdirs)
    for line in bad_sidecars:
        print(f"sidecar: {line}")
    failed = [o for o in outcomes if o.failed]
    if keep or failed or bad_sidecars:  # a drift is looked at: its regenerated files stay
        print(f"regenerated tree kept in {dest} (compare: diff -r {dest}/data data)")
    else:
        shutil.rmtree(dest, ignore_errors=True)
    if failed or bad_sidecars:
        print(f"dora-num reproduce --check: {len(failed)} artifact(s) drifted beyond their declared tolerance",
              file=sys.stderr)
        return 1
    print("dora-num reproduce --check: every regenerated artifact matches the committed one")
    return 0


_COMMAND_MODULES = (
    "dora_num.adapters.cli",  # collapse
    "dora_num.studies.cli",  # record NAME, gpu-suite
    "dora_num.check",  # bounds check
)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="dora-num", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"dora-num {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    r = sub.add_parser(
        "reproduce", help="run the notebooks headless (papermill), regenerating data/ and figures/",
        description="Run every notebook in order through papermill. Artifacts are staged and moved into data/ and "
                    "figures/ only when the notebook succeeds; an artifact whose bytes did not change is left as "
                    "committed (sidecar included). Each notebook is also rendered to notebooks/rendered/NN.md, and "
                    "a full run rewrites the README's results section.",
        epilog="--check regenerates into a temporary folder and compares every artifact with the committed one "
               "(bytes equal, or within the tolerance declared in dora_num/repro/check.py); exit status 1 on drift.")
    r.add_argument("--smoke", action="store_true", help="tiny sizes, outputs to a temporary folder (what CI runs)")
    r.add_argument("--only", nargs="+", metavar="NB", help="notebooks to run, by number, stem or name: 00 03, overview")
    r.add_argument("--check", action="store_true",
                   help="regenerate into a temporary folder and compare with the committed artifacts")
    r.add_argument("--out", metavar="DIR", help="write the artifacts under DIR instead of the repository "
                                                 "(with --check: keep the regenerated tree there)")
    r.add_argument("--keep", action="store_true", help="with --check: keep the regenerated tree (kept anyway on a "
                                                       "drift; its folder is printed)")
    r.add_argument("-v", "--verbose", action="store_true", help="with --check: list identical artifacts too")
    from .repro.runner import Limits

    r.add_argument("--cell-timeout", type=float, default=Limits.cell_s, metavar="S",
                   help=f"seconds one cell may run (default {Limits.cell_s:.0f})")
    r.add_argument("--timeout", type=float, default=Limits.notebook_s, metavar="S",
                   help=f"seconds one notebook may run (default {Limits.notebook_s:.0f})")
    r.add_argument("--retries", type=int, default=Limits.retries, metavar="N",
                   help=f"runs again after a timeout or a dead kernel, N times (default {Limits.retries})")
    r.add_argument("--no-progress", action="store_true", help="no per-cell progress bar")
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
