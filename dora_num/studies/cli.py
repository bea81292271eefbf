"""``dora-num record NAME ...``: every recorder of the project behind one command.

A recorder (a ``record_*.py`` module) measures what ``make reproduce`` cannot into ``--out DIR``
and ingests such a folder into ``data/`` with provenance (:mod:`dora_num.repro.recording`)::

    dora-num record NAME --out DIR [options]     # measure (on the machine it needs)
    dora-num record NAME --ingest DIR ...        # here: DIR -> data/ with sidecars
    dora-num record --list                       # every recorded data set and its last recording

Each recorder module provides ``build_parser(prog, name)`` (built on
:func:`dora_num.repro.recording.parser`), ``record(args)`` and, where it ingests, ``ingest_args(args)``;
it is imported only when it runs, so ``dora-num --help`` stays fast.  The subcommands are not listed
here: each is declared with its data set (:data:`dora_num.studies.datasets.RECORDERS`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import datasets


RECORDERS = datasets.RECORDERS  # derived from the data sets' declarations (and datasets.TOOLS)
TOOLS = tuple(datasets.TOOLS)


def run(name: str, argv: list[str] | None = None, *, prog: str | None = None,
        recorders: dict[str, datasets.Recorder] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) with recorder ``name``'s parser and run it; ``recorders``:
    the registry to look ``name`` up in (default :data:`RECORDERS`)."""
    recorders = RECORDERS if recorders is None else recorders
    if name not in recorders:
        raise SystemExit(f"dora-num record: unknown recorder {name!r}; have {', '.join(recorders)}")
    mod = importlib.import_module(recorders[name].module)
    p = mod.build_parser(prog or f"dora-num record {name}", name)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "ingest", None):
        for path in mod.ingest_args(args):
            print(path)
        return 0
    if getattr(args, "_out_required", False) and args.out is None:
        p.error("--out DIR is required" + (" (or --ingest DIR)" if hasattr(args, "ingest") else ""))
    return int(mod.record(args) or 0)


def list_datasets(width: int = 100) -> str:
    """``dora-num record --list``: every recorded data set (:func:`dora_num.studies.datasets.table`), two lines
    each (what and when; where and how), within ``width`` columns, with a legend."""
    import textwrap

    t = datasets.table()
    head = f"{'data set':<20} {'files':>5}  {'read by':<10} {'recorded':<10}  {'machine':<16} commit"
    lines = [head, "-" * len(head)]
    for r in t.itertuples(index=False):
        lines.append(f"{r.name:<20} {r.files:>5}  {r.notebooks:<10} {r.recorded:<10}  {r.machine:<16} {r.commit}")
        how = f"data/{r.folder}  <-  " + (r.recorder if r.recorder.startswith(("python", "bash", "notebook"))
                                          else f"dora-num record {r.recorder}")
        lines += textwrap.wrap(how, width, initial_indent="    ", subsequent_indent="        ")
    lines += ["", *textwrap.wrap(
        "Legend. read by: the notebooks that read the data set (01 = notebooks/01_*.ipynb); (02): read when "
        "present, the notebook runs without it; -: read by no notebook, kept as the record that docs/ cites. "
        "Second line: the folder under data/ and the command that records it (GPU recorders run on the GPU "
        "machine: docs/recording.md). commit, machine, recorded: the last recording's, from its provenance.",
        width)]
    return "\n".join(lines)


_HELP = """A recorder measures what `make reproduce` cannot (GPU runs, long CPU training) into an
output folder, and ingests such a folder into data/ with provenance sidecars:

    dora-num record NAME --out DIR [options]     # measure (on the machine it needs)
    dora-num record NAME --ingest DIR ...        # here: DIR -> data/ with sidecars
    dora-num record NAME --help                  # its options
    dora-num record --list                       # every recorded data set and its last recording"""


def _description() -> str:
    width = max(map(len, RECORDERS))
    return _HELP + "\n\nrecorders:\n" + "\n".join(f"  {n:<{width}}  {r.help}" for n, r in RECORDERS.items())


def _record(a) -> int:
    if a.list:
        print(list_datasets())
        return 0
    if a.name is None:
        raise SystemExit("dora-num record: name a recorder (dora-num record --help) or give --list")
    return run(a.name, a.args)


def register(sub) -> None:
    """Add ``record`` (and ``gpu-suite``, the suite's original name) to the CLI's subparsers."""
    p = sub.add_parser("record", help="run a recorder (GPU measurements, training runs) or ingest its output",
                       description=_description(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print every recorded data set and its last recording")
    p.add_argument("name", nargs="?", choices=list(RECORDERS), metavar="NAME", help="the recorder (see the list above)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the recorder's own options (NAME --help)")
    p.set_defaults(func=_record)
    # The suite's options are parsed by the suite's own parser: prefix_chars="+" keeps this
    # subparser from reading "--out" or "--help" itself, so they reach that parser whole.
    g = sub.add_parser("gpu-suite", help="all GPU measurements in one process (= dora-num record suite)",
                       add_help=False, prefix_chars="+")
    g.add_argument("args", nargs=argparse.REMAINDER)
    g.set_defaults(func=lambda a: run("suite", a.args, prog="dora-num gpu-suite"))
