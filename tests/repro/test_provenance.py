"""Provenance sidecars and atomic writes."""

import hashlib
import json
import os

import pandas as pd
import pytest

from dora_num.repro import paths
from dora_num.repro.provenance import read_provenance, recompress, save_dataframe, write_artifact


def test_sidecar_records_hashes_and_parameters(tmp_path):
    src = tmp_path / "input.bin"
    src.write_bytes(b"abc")
    out = write_artifact(tmp_path / "a.txt", b"hello\n", params={"n": 3}, seed=7, inputs={"src": src})
    side = read_provenance(out)
    assert side["sha256"] == hashlib.sha256(b"hello\n").hexdigest()
    assert side["parameters"] == {"n": 3} and side["seed"] == 7
    assert side["inputs"]["src"]["sha256"] == hashlib.sha256(b"abc").hexdigest()
    assert {"sha", "dirty"} <= set(side["git"])
    assert side["versions"]["torch"] == "2.13.0" or side["versions"]["torch"].startswith("2.")


def test_failed_writer_leaves_previous_file_intact(tmp_path):
    target = tmp_path / "t.csv"
    write_artifact(target, b"old\n")

    def broken(buf):
        buf.write(b"partial")
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        write_artifact(target, broken)
    assert target.read_bytes() == b"old\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_missing_input_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="provenance input 'w' is not a file"):
        write_artifact(tmp_path / "x", b"", inputs={"w": tmp_path / "nope"})


def test_dataframe_roundtrip_and_deterministic_gzip(tmp_path):
    df = pd.DataFrame({"a": [1, 2], "b": [0.5, 0.25]})
    p1 = save_dataframe(df, tmp_path / "t.csv.gz")
    b1 = p1.read_bytes()
    p2 = save_dataframe(df, tmp_path / "t.csv.gz")
    assert p2.read_bytes() == b1
    pd.testing.assert_frame_equal(pd.read_csv(p1), df)
    with pytest.raises(ValueError, match="unsupported table format"):
        save_dataframe(df, tmp_path / "t.xlsx")


def test_xz_tables_roundtrip_deterministically(tmp_path):
    df = pd.DataFrame({"a": [1, 2], "b": [0.5, 0.25]})
    p1 = save_dataframe(df, tmp_path / "t.csv.xz")
    assert p1.read_bytes()[:6] == b"\xfd7zXZ\x00"  # the xz magic: written compressed, not merely named so
    (tmp_path / "t.csv.xz").rename(tmp_path / "u.csv.xz")
    assert save_dataframe(df, tmp_path / "t.csv.xz").read_bytes() == (tmp_path / "u.csv.xz").read_bytes()
    pd.testing.assert_frame_equal(pd.read_csv(p1), df)


def test_recompress_keeps_the_content_and_the_record(tmp_path):
    df = pd.DataFrame({"x": range(50), "y": [k / 7 for k in range(50)]})
    src = save_dataframe(df, tmp_path / "r.csv.gz", params={"n": 50}, seed=3)
    before = read_provenance(src)
    dst = recompress(src, tmp_path / "r.csv.xz")
    side = read_provenance(dst)
    assert not src.exists() and not (tmp_path / "r.csv.gz.provenance.json").exists()
    pd.testing.assert_frame_equal(pd.read_csv(dst), df)
    assert side["sha256"] == hashlib.sha256(dst.read_bytes()).hexdigest() and side["bytes"] == dst.stat().st_size
    assert side["artifact"] == "r.csv.xz" and side["parameters"] == {"n": 50} and side["seed"] == 3
    assert side["created_utc"] == before["created_utc"] and side["git"] == before["git"]
    assert side["extra"]["recompressed_from"] == {
        "artifact": "r.csv.gz", "sha256": before["sha256"], "bytes": before["bytes"],
        "content_sha256": hashlib.sha256(df.to_csv(index=False, lineterminator="\n").encode()).hexdigest()}


def test_recompress_refuses_a_file_its_sidecar_does_not_describe(tmp_path):
    src = save_dataframe(pd.DataFrame({"a": [1]}), tmp_path / "r.csv")
    src.write_text("a\n2\n")
    with pytest.raises(ValueError, match="does not describe"):
        recompress(src, tmp_path / "r.csv.xz")
    assert src.exists() and not (tmp_path / "r.csv.xz").exists()
    src2 = save_dataframe(pd.DataFrame({"a": [1]}), tmp_path / "s.csv")
    (tmp_path / "s.csv.xz").write_bytes(b"")
    with pytest.raises(FileExistsError, match="writes a new file only"):
        recompress(src2, tmp_path / "s.csv.xz")


def test_output_root_redirects_writes(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.OUTPUT_ROOT_ENV, str(tmp_path))
    assert paths.data_dir("x") == tmp_path / "data" / "x"
    assert paths.figures_dir("y").is_dir()
    assert paths.committed_data("z") == paths.REPO_ROOT / "data" / "z"


def test_dirty_flag_ignores_artifacts(tmp_path):
    """A reproduce run rewrites data/ and figures/ as it goes; that must not mark the code dirty."""
    import subprocess

    from dora_num.repro.provenance import git_state

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@example.invalid")
    git("config", "user.name", "t")
    for rel in ("code.py", "data/x.csv", "figures/f.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("0\n")
    git("add", "-A")
    git("commit", "-qm", "init")
    (tmp_path / "data/x.csv").write_text("1\n")
    (tmp_path / "figures/f.png").write_text("1\n")
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("1\n")
    assert git_state(tmp_path)["dirty"] is True
