"""The guard-cost benchmark's CPU-side parts: its pre-timing checks on a small realistic adapter
(the Triton tail under the interpreter), the on/off summary and the ingest with provenance."""

import json

import pandas as pd
import pytest

from dora_num.ops.config import override
from dora_num.repro.provenance import read_provenance
from dora_num.studies.speed import record_guard_cost as gc


@pytest.mark.interpreter
@pytest.mark.parametrize("ab_dtype", ["bfloat16", "float32"])
def test_prepare_checks_pass_on_the_benchmarked_adapter(ab_dtype):
    with override(norm_tail="triton"):
        fns, info = gc.prepare(64, 256, 16, ab_dtype, device="cpu")
    assert info["checks_ok"] and info["rows_fired"] == 0, info
    assert info["rel_err_fp64"] < 1e-5 and info["rel_bound_max"] < 2.0**-6
    assert set(fns) == {"tail", "tail_guard_only", "layer_g", "public"} and all(set(v) == {"on", "off"} for v in fns.values())


def test_summary_and_ingest(tmp_path):
    src = tmp_path / "run"
    src.mkdir()
    rows = [dict(d_out=8, d_in=8, rank=2, ab_dtype="bfloat16", measure="tail", variant=v, round=k, ms=ms)
            for k in range(3) for v, ms in (("on", 1.01), ("off", 1.0), ("ratio_on_over_off", 1.01 + 0.01 * k))]
    pd.DataFrame(rows).to_csv(src / "guard_cost.csv", index=False)
    (src / "device.json").write_text(json.dumps({"device": {"cuda": True, "name": "NVIDIA H200"}, "smoke": True,
                                                 "rounds": 3, "git_sha": "abc"}))
    s = gc.summary(pd.read_csv(src / "guard_cost.csv"))
    assert s["on_over_off"].tolist() == [pytest.approx(1.02)]
    out = gc.ingest(src, tmp_path / "data")
    prov = read_provenance(out)
    assert prov["device"]["name"] == "NVIDIA H200" and prov["extra"]["measured_at_git_sha"] == "abc"
    assert pd.read_csv(out).shape == (9, 8)
