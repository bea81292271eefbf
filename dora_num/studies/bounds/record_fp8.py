"""``dora-num record compose-fp8``: the exhaustive fp8 compose check on the CPU it runs on, into ``data/exhaustive/``.

Every (base, lora) pair of e4m3fn and e5m2 at every configuration of :func:`.exhaustive.configurations`
(:func:`.exhaustive.fp8_exhaustive`, about 3 min on 2 cores).
"""

from __future__ import annotations

import time
from pathlib import Path

from ...repro.recording import parser as recorder_parser
from .datasets import COMPOSE_FP8
from .exhaustive import fp8_exhaustive


def record_fp8(out_dir=None):
    """The fp8 exhaustive check (every configuration) into ``data/exhaustive/compose_fp8.csv.gz``;
    returns its path."""
    from ...repro.provenance import save_dataframe

    t0 = time.time()
    df = fp8_exhaustive()
    out = COMPOSE_FP8.path(folder=COMPOSE_FP8.dest() if out_dir is None else Path(out_dir))
    save_dataframe(df, out, float_format="%.17g", params={"wall_s": round(time.time() - t0, 1), "rows": len(df)},
                   producer=COMPOSE_FP8.producer)
    print(f"[exhaustive] fp8: {len(df)} rows in {time.time() - t0:.0f} s -> {out}")
    return out


def build_parser(prog: str = "dora-num record compose-fp8", name: str = "compose-fp8"):
    return recorder_parser(prog, __doc__, ingest=None, smoke=None, out="output folder (default data/exhaustive/)",
                           out_required=False)


def record(a) -> int:
    record_fp8(a.out)
    return 0
