"""``dora-num record sqrt-census``: the exhaustive fp32 sqrt census on the CPU it runs on, into ``data/exhaustive/``.

All 2^32 patterns through numpy's and torch's CPU square roots (:func:`.census.census`, about 25 min
on 2 cores), against the exact integer reference; the per-chunk counts let a SMOKE run recompute
a few chunks and require them to agree (:func:`.census.check_against_record`).
"""

from __future__ import annotations

from pathlib import Path

from ...repro.recording import parser as recorder_parser
from .census import CHUNK, SUB_BLOCK, census, cpu_capability
from .datasets import SQRT_CENSUS_CPU


def record_census(out_dir=None, *, workers: int = 2) -> list:
    """Run the full CPU census and write it (with provenance) under ``data/exhaustive/``."""
    import platform
    import time

    from ...repro.provenance import save_dataframe

    out = SQRT_CENSUS_CPU.dest() if out_dir is None else Path(out_dir)
    t0 = time.time()
    counts, per = census(workers=workers, progress=True)
    secs = time.time() - t0
    params = {"chunk": CHUNK, "sub_block": SUB_BLOCK, "workers": workers, "wall_s": round(secs, 1),
              "torch_cpu_capability": cpu_capability(), "cpu": platform.processor() or platform.machine()}
    prov = {"params": params, "producer": SQRT_CENSUS_CPU.producer}
    paths = [save_dataframe(t, p, **prov) for t, p in zip((counts, per), SQRT_CENSUS_CPU.paths(out))]
    print(f"[census] {counts['count'].sum():,} inputs x {counts['implementation'].nunique()} implementations "
          f"in {secs:.0f} s with {workers} workers")
    return paths


def build_parser(prog: str = "dora-num record sqrt-census", name: str = "sqrt-census"):
    p = recorder_parser(prog, __doc__, ingest=None, smoke=None, out="output folder (default data/exhaustive/)",
                        out_required=False)
    p.add_argument("--workers", type=int, default=2)
    return p


def record(a) -> int:
    record_census(a.out, workers=a.workers)
    return 0
