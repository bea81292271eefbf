"""The exhaustive GPU recorder's CPU side: ``dora-num record exhaustive --ingest`` writes sidecars with
the measuring machine from the run's device.json (one provenance vocabulary); smoke runs refused."""

import json
import lzma

import pytest

from dora_num.repro.provenance import read_provenance
from dora_num.studies import cli
from dora_num.studies import record_exhaustive as G


def _run_dir(tmp_path, smoke):
    d = tmp_path / "run"
    d.mkdir()
    (d / "device.json").write_text(json.dumps({
        "device": {"name": "NVIDIA H200", "cuda": True}, "smoke": smoke, "sections": list(G.SECTIONS), "git_sha": "abc",
        "versions": {"torch": "2.11.0+cu130"}, "argv": ["x"], "wall_s": {"total": 1}, "compose_launches": 150,
        "compose_planned": 150, "compose_stopped_early": False}))
    (d / G.X.RESULT_FILE).write_bytes(lzma.compress(b"format,g\nbf16,1.0\n"))
    return d


def test_ingest_writes_sidecars_with_the_gpu_device(tmp_path):
    out = G.ingest(_run_dir(tmp_path, smoke=False), tmp_path / "data")
    assert sorted(p.name for p in out) == [G.X.RESULT_FILE, "device.json"]
    prov = read_provenance(tmp_path / "data" / G.X.RESULT_FILE)
    assert prov["device"]["name"] == "NVIDIA H200" and prov["producer"] == "dora-num record exhaustive"
    assert prov["extra"]["measured_at_git_sha"] == "abc" and prov["extra"]["measured_versions"]["torch"] == "2.11.0+cu130"
    assert prov["extra"]["measured_from"] == ["run"]
    assert prov["parameters"]["compose_launches"] == 150 and prov["parameters"]["compose_stopped_early"] is False


def test_ingest_through_the_record_command(tmp_path, capsys):
    src = _run_dir(tmp_path, smoke=False)
    assert cli.run("exhaustive", ["--ingest", str(src), "--out", str(tmp_path / "data"), "--git-sha", "def"]) == 0
    prov = read_provenance(tmp_path / "data" / G.X.RESULT_FILE)
    assert prov["extra"]["measured_at_git_sha"] == "def"  # --git-sha names the commit the GPU ran
    assert G.X.RESULT_FILE in capsys.readouterr().out


def test_ingest_refuses_a_smoke_run(tmp_path):
    with pytest.raises(ValueError, match="--smoke run"):
        G.ingest(_run_dir(tmp_path, smoke=True), tmp_path / "data")


def test_ingest_refuses_a_folder_without_device_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="device.json"):
        G.ingest(tmp_path, tmp_path / "data")


def test_run_needs_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("tests the refusal of a machine without CUDA; with a GPU the run would start measuring")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        G.run(tmp_path / "out", smoke=True)
    with pytest.raises(SystemExit) as e:
        cli.run("exhaustive", [])  # no --out: refused before anything runs
    assert e.value.code == 2
