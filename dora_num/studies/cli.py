"""``dora-num record NAME ...``: every recorder of the project behind one command.

A recorder measures what ``make reproduce`` cannot (GPU runs, long CPU training)
into an output folder, and ingests such a folder into ``data/`` with provenance
(:mod:`dora_num.repro.recording`)::

    dora-num record NAME --out DIR [options]     # measure (on the machine it needs)
    dora-num record NAME --ingest DIR ...        # here: DIR -> data/ with sidecars
    dora-num record NAME --help                  # its options

Each recorder module provides ``build_parser(prog, name)`` and ``record(args)``;
its ``python -m dora_num.studies...`` entry point delegates here.  The modules are
imported only when their recorder runs, so ``dora-num --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple


class Recorder(NamedTuple):
    module: str
    help: str


RECORDERS = {
    "suite": Recorder("dora_num.studies.record_suite", "GPU: every section of the GPU suite in one process (notebooks 02, 05)"),
    "fma": Recorder("dora_num.studies.record_suite", "GPU: FMA / sqrt variants of the norm assembly and the compose (02)"),
    "tiles": Recorder("dora_num.studies.record_suite", "GPU: tile sweep of the fused compose kernels (05)"),
    "compose": Recorder("dora_num.studies.record_suite", "GPU: compose kernels vs eager and torch.compile (05)"),
    "norm": Recorder("dora_num.studies.record_suite", "GPU: row-norm time and memory (05)"),
    "layer": Recorder("dora_num.studies.record_suite", "GPU: DoRALinear vs PEFT's DoRA layer (05)"),
    "model": Recorder("dora_num.studies.record_suite", "GPU: a Llama-architecture decoder at 8B layer shapes, PEFT vs this operator (05)"),
    "train-graphs": Recorder("dora_num.studies.speed.record_train_graphs",
                             "GPU: the training compose on the device alone, under CUDA graphs (05)"),
    "overhead": Recorder("dora_num.studies.speed.record_overhead", "GPU: host (CPU) cost of the fused tier per call (05)"),
    "convergence": Recorder("dora_num.studies.convergence.record_convergence", "GPU: fused vs eager training, 2000 steps x 3 seeds (04)"),
    "memory": Recorder("dora_num.studies.gradient.record_memory",
                       "GPU: peak memory of training steps against the memory model (06)"),
    "adapters": Recorder("dora_num.studies.cancellation.record_adapters",
                         "CPU: the early-training MiniLM DoRA adapters (50 steps) and the PEFT agreement runs (01)"),
    "adapters-gpu": Recorder("dora_num.studies.cancellation.record_trained",
                             "GPU: MiniLM DoRA trained until MRR@10 plateaus, g captured over training; "
                             "launch | plan | ingest (01)"),
    "exhaustive": Recorder("dora_num.studies.record_exhaustive",
                           "GPU: exhaustive sqrt census, tensor-core accumulation probe, 16-bit compose checks (01-03)"),
    "carry": Recorder("dora_num.studies.record_carry", "CPU: the bf16 copy of MiniLM carried to the GPU machine"),
}


_HELP = """A recorder measures what `make reproduce` cannot (GPU runs, long CPU training) into an
output folder, and ingests such a folder into data/ with provenance sidecars:

    dora-num record NAME --out DIR [options]     # measure (on the machine it needs)
    dora-num record NAME --ingest DIR ...        # here: DIR -> data/ with sidecars
    dora-num record NAME --help                  # its options"""


def _description() -> str:
    width = max(map(len, RECORDERS))
    return (_HELP + "\n\nrecorders:\n"
            + "\n".join(f"  {name:<{width}}  {r.help}" for name, r in RECORDERS.items()))


def run(name: str, argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) with recorder ``name``'s parser and run it."""
    if name not in RECORDERS:
        raise SystemExit(f"dora-num record: unknown recorder {name!r}; have {', '.join(RECORDERS)}")
    mod = importlib.import_module(RECORDERS[name].module)
    parser = mod.build_parser(prog or f"dora-num record {name}", name)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return int(mod.record(args) or 0)


def register(sub) -> None:
    """Add ``record`` (and ``gpu-suite``, the suite's original name) to the CLI's subparsers."""
    p = sub.add_parser("record", help="run a recorder (GPU measurements, training runs) or ingest its output",
                       description=_description(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=list(RECORDERS), metavar="NAME", help="the recorder (see the list above)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the recorder's own options (NAME --help)")
    p.set_defaults(func=lambda a: run(a.name, a.args))
    # The suite's options are parsed by the suite's own parser: prefix_chars="+" keeps this
    # subparser from reading "--out" or "--help" itself, so they reach that parser whole.
    g = sub.add_parser("gpu-suite", help="all GPU measurements in one process (= dora-num record suite)",
                       add_help=False, prefix_chars="+")
    g.add_argument("args", nargs=argparse.REMAINDER)
    g.set_defaults(func=lambda a: run("suite", a.args, prog="dora-num gpu-suite"))
