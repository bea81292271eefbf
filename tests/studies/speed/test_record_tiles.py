"""The ``tiles`` section's norm sweep end to end on the CPU (the kernels under the Triton interpreter,
tiny shapes, a host timer in place of ``do_bench``), its atomic writer, and the operator configuration
in the suite's ``device.json``."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pandas as pd
import pytest

from dora_num.ops.config import NormTailTiles, OpConfig, RowSumsqTiles, get_config
from dora_num.studies import record_suite
from dora_num.studies.bench import Timing, gpu_description, write_csv
from dora_num.studies.speed import datasets as D
from dora_num.studies.speed.record_norm import NORM_TILES_FULL, NORM_TILES_SMOKE


def host_timer(fn, *, warmup: int, rep: int) -> Timing:
    """:func:`dora_num.studies.bench.time_ms`'s signature on the host clock (one warm call, one timed)."""
    fn()
    t0 = time.perf_counter()
    fn()
    ms = 1e3 * (time.perf_counter() - t0)
    return Timing(ms, ms, ms)


@pytest.mark.interpreter
def test_norm_tile_sweep_runs_end_to_end_and_writes_a_well_formed_table(tmp_path):
    path = record_suite.tiles_section(tmp_path, None, smoke=True, device="cpu", timer=host_timer)
    assert path == D.TILES.path("sweep", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary file left beside it
    df = pd.read_csv(path)
    grid = NORM_TILES_SMOKE
    n_sumsq = len(grid["shapes"]) * len(grid["sumsq_grid"])
    n_tail = len(grid["shapes"]) * len(grid["ranks"]) * len(grid["tail_grid"])
    assert df["kernel"].value_counts().to_dict() == {"row_sumsq": n_sumsq, "norm_tail": n_tail}
    assert bool(df["check_ok"].all()) and float(df["err_over_bound"].max()) <= 1.0
    assert (df["gpu"] == "cpu").all() and (df["dtype"] == "bfloat16").all()
    for col in ("ms", "gbps", "copy_gbps", "pct_copy", "bytes"):
        assert df[col].map(lambda v: math.isfinite(v) and v > 0).all(), col
    sums, tails = df[df["kernel"] == "row_sumsq"], df[df["kernel"] == "norm_tail"]
    # every row names its tiles; the defaults are marked once per shape (and rank)
    got = {RowSumsqTiles(*map(int, t)) for t in sums[["block_m", "block_k", "num_warps"]].itertuples(index=False)}
    assert got == set(grid["sumsq_grid"])
    assert sums["default"].sum() == len(grid["shapes"]) and tails["default"].sum() == len(grid["shapes"]) * len(
        grid["ranks"])
    fields = [f.name for f in dataclasses.fields(NormTailTiles)]
    got = {NormTailTiles(**{k: int(v) for k, v in zip(fields, t)}) for t in tails[fields].itertuples(index=False)}
    assert got == set(grid["tail_grid"]) and (tails["rows_fired"] == 0).all()


def test_the_full_grids_hold_the_defaults_and_the_operators_shapes():
    assert RowSumsqTiles() in NORM_TILES_FULL["sumsq_grid"] and NormTailTiles() in NORM_TILES_FULL["tail_grid"]
    assert set(NORM_TILES_FULL["shapes"]) == {(4096, 4096), (14336, 4096), (4096, 14336)}
    assert set(NORM_TILES_FULL["ranks"]) == {64, 384}


class _Unprintable:
    def __str__(self):
        raise RuntimeError("cannot render this value")

    __repr__ = __str__


def test_write_csv_is_atomic(tmp_path):
    """A table that fails while it is rendered leaves the file it had, not a truncated one."""
    path = tmp_path / "t.csv"
    write_csv([{"a": 1, "b": 2.5}], path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="cannot render"):
        write_csv([{"a": 1, "b": _Unprintable()}], path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]
    assert pd.read_csv(path).to_dict("records") == [{"a": 1, "b": 2.5}]


def test_device_json_names_the_operator_configuration():
    desc = gpu_description("abc")
    assert OpConfig.from_key(desc["op_config"]) == get_config()
    assert json.loads(desc["op_config"])["row_sumsq_tiles"] == dataclasses.asdict(get_config().row_sumsq_tiles)
