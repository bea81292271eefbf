"""The recorded-data ingest: one vocabulary of provenance keys, the measuring machine's description."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from dora_num.repro import recording as recorded
from dora_num.repro.paths import RecordedDataMissing, require
from dora_num.repro.provenance import read_provenance


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
    with pytest.raises(RecordedDataMissing, match="a.csv, .*b.csv; record it with: do X"):
        require([tmp_path / "a.csv", tmp_path / "b.csv"], "do X")
