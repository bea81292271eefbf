"""The recorded-data contract: one ingest with one vocabulary of provenance keys, one way
to say data is missing, and every data set a notebook reads present in the repository."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from dora_num.repro.provenance import read_provenance
from dora_num.repro import recording as recorded
from dora_num.studies.bounds import exhaustive_report
from dora_num.studies.cancellation import analysis as cancellation
from dora_num.studies.cancellation import trained
from dora_num.studies.convergence import recorded as convergence
from dora_num.studies.fma import census
from dora_num.studies.fma import gpu_vs_emulation as fma
from dora_num.studies.gradient import record_memory
from dora_num.studies.speed import report

DATA_SETS = {"agreement": cancellation.AGREEMENT, "compose_adapter": cancellation.COMPOSE_ADAPTER,
             "trained_adapters": trained.TRAINED, "paper_shape": cancellation.PAPER_SHAPE, "fma": fma.RECORDED,
             "convergence": convergence.RECORDED, "memory": record_memory.RECORDED, "suite": report.RECORDED,
             "sqrt_census_cpu": census.RECORDED_CPU, "compose_fp8": exhaustive_report.RECORDED_FP8}


@pytest.mark.parametrize("name", list(DATA_SETS))
def test_every_recorded_data_set_is_committed(name):
    data = DATA_SETS[name]
    assert data.missing() == [] and len(data.require()) == len(data.files)
    assert "record" in data.how_to_record or "notebook" in data.how_to_record


def test_ingest_writes_one_vocabulary_of_provenance_keys(tmp_path):
    src = tmp_path / "run"
    machine = recorded.describe_machine("abc123", smoke=True)
    recorded.write_machine(src, machine)
    (src / "table.csv").write_text("a,b\n1,2\n")
    written = recorded.ingest_folder(src, tmp_path / "data", producer="dora-num record x", names=("table.csv",),
                                     params={"k": 1})
    assert [p.name for p in written] == ["table.csv"]
    assert (tmp_path / "data" / "table.csv").read_text() == "a,b\n1,2\n"  # copied byte for byte
    side = read_provenance(tmp_path / "data" / "table.csv")
    assert side["producer"] == "dora-num record x" and side["parameters"] == {"k": 1}
    assert side["device"] == json.loads(json.dumps(machine["device"]))
    assert set(side["extra"]) == {"measured_at_git_sha", "measured_versions", "measured_argv", "measured_from"}
    assert side["extra"]["measured_at_git_sha"] == "abc123" and side["extra"]["measured_from"] == ["run"]
    frames = recorded.ingest({"t.csv": pd.DataFrame({"x": [0.1]}), "s.json": {"a": 1}}, tmp_path / "d2",
                             machine=machine, producer="p", git_sha="def", float_formats={"t.csv": "%.3g"})
    assert (tmp_path / "d2" / "t.csv").read_text() == "x\n0.1\n"
    assert read_provenance(frames[1])["extra"]["measured_at_git_sha"] == "def"


def test_ingest_refuses_a_folder_that_is_not_a_recorders(tmp_path):
    with pytest.raises(FileNotFoundError, match="device.json"):
        recorded.ingest_folder(tmp_path, tmp_path / "d", producer="p")
    recorded.write_machine(tmp_path, {"device": {}})
    with pytest.raises(FileNotFoundError, match="lacks"):
        recorded.ingest_folder(tmp_path, tmp_path / "d", producer="p", names=("table.csv",))


def test_require_names_every_missing_file(tmp_path):
    with pytest.raises(recorded.RecordedDataMissing, match="a.csv, .*b.csv; record it with: do X"):
        recorded.require([tmp_path / "a.csv", tmp_path / "b.csv"], "do X")
