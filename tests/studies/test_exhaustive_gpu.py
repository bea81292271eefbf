"""The exhaustive GPU driver's ingest (CPU side): provenance from the run's device.json; smoke runs refused."""

import json

import pytest

from dora_num.repro.provenance import read_provenance
from dora_num.studies import exhaustive_gpu as G


def _run_dir(tmp_path, smoke):
    d = tmp_path / "run"
    d.mkdir()
    (d / "device.json").write_text(json.dumps({"device": {"name": "NVIDIA H200", "cuda": True}, "smoke": smoke,
                                               "sections": list(G.SECTIONS), "git_sha": "abc", "wall_s": {"total": 1}}))
    (d / "compose_exhaustive.csv").write_text("format,g\nbf16,1.0\n")
    return d


def test_ingest_writes_sidecars_with_the_gpu_device(tmp_path):
    out = G.ingest(_run_dir(tmp_path, smoke=False), tmp_path / "data")
    assert sorted(p.name for p in out) == ["compose_exhaustive.csv", "device.json"]
    prov = read_provenance(tmp_path / "data" / "compose_exhaustive.csv")
    assert prov["device"]["name"] == "NVIDIA H200" and prov["extra"]["gpu_git_sha"] == "abc"


def test_ingest_refuses_a_smoke_run(tmp_path):
    with pytest.raises(ValueError, match="--smoke run"):
        G.ingest(_run_dir(tmp_path, smoke=True), tmp_path / "data")


def test_run_needs_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        G.run(tmp_path / "out", smoke=True)
