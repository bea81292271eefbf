"""``dora-num record products --ingest DIR``: what a device call returned goes into data/ only when
every file is a full run naming its commit (the recorder itself needs CUDA)."""

from __future__ import annotations

import pandas as pd
import pytest

from dora_num.repro.provenance import save_dataframe
from dora_num.studies.cli import run


def _part(folder, name, *, smoke=False, git_sha="a" * 40, x=1.0):
    save_dataframe(pd.DataFrame({"x": [x]}), folder / name, params={"smoke": smoke, "git_sha": git_sha},
                   producer="dora-num record products")


def test_ingest_checks_every_file_before_writing_any(tmp_path):
    src, dest = tmp_path / "out", tmp_path / "data"
    src.mkdir()
    with pytest.raises(SystemExit, match="holds none of tf32.csv"):
        run("products", ["--ingest", str(src), "--out", str(dest)])
    _part(src, "tf32.csv")
    _part(src, "bf16_base.csv", smoke=True)
    with pytest.raises(SystemExit, match="bf16_base.csv is a --smoke run; nothing was recorded"):
        run("products", ["--ingest", str(src), "--out", str(dest)])
    assert not dest.exists()
    _part(src, "bf16_base.csv", git_sha=None, x=2.0)
    with pytest.raises(SystemExit, match="names no commit; give --git-sha"):
        run("products", ["--ingest", str(src), "--out", str(dest)])
    assert run("products", ["--ingest", str(src), "--out", str(dest), "--git-sha", "b" * 40]) == 0
    import json

    side = json.loads((dest / "tf32.csv.provenance.json").read_text())
    assert side["parameters"]["git_sha"] == "b" * 40 and side["extra"]["git_sha_given_on_device"] == "a" * 40
    assert (dest / "tf32.csv").read_bytes() == (src / "tf32.csv").read_bytes()
