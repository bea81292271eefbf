"""reproduce --check: the comparison of regenerated and committed artifacts, and the
provenance rule that an artifact whose bytes did not change keeps its sidecar."""

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from dora_num.repro import check as chk
from dora_num.repro.paths import REPO_ROOT
from dora_num.repro.provenance import save_dataframe, save_json, write_artifact
from dora_num.repro.runner import _promote


def _csv(path: Path, df: pd.DataFrame) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    return path


def test_identical_and_drift_with_sizes(tmp_path):
    old = _csv(tmp_path / "old/data/x/t.csv", pd.DataFrame({"a": [1.0, 2.0], "b": ["u", "v"]}))
    same = _csv(tmp_path / "new/data/x/t.csv", pd.DataFrame({"a": [1.0, 2.0], "b": ["u", "v"]}))
    assert chk.compare_file("data/x/t.csv", same, old).status == "identical"
    moved = _csv(tmp_path / "new2/data/x/t.csv", pd.DataFrame({"a": [1.0, 2.0 + 1e-9], "b": ["u", "v"]}))
    o = chk.compare_file("data/x/t.csv", moved, old)
    assert o.status == "drift" and o.failed
    assert o.max_abs == pytest.approx(1e-9, rel=1e-6) and o.max_rel == pytest.approx(5e-10, rel=1e-6)


def test_a_drift_names_its_rows_columns_and_values(tmp_path):
    old = _csv(tmp_path / "old/t.csv", pd.DataFrame({"a": [1.0, 2.0, 3.0], "n": [4, 5, 6]}))
    new = _csv(tmp_path / "new/t.csv", pd.DataFrame({"a": [1.0, 2.5, 3.0], "n": [4, 5, 7]}))
    o = chk.compare_file("data/x/t.csv", new, old)
    assert o.details == ("row 1 a: 2.5 vs 2.0", "row 2 n: 7 vs 6"), o.details
    table = chk.format_table([o])
    assert "row 1 a: 2.5 vs 2.0  (new vs committed)" in table and "2 value(s) differ" in table


def test_text_mismatch_is_named(tmp_path):
    old = _csv(tmp_path / "old.csv", pd.DataFrame({"a": [1.0], "b": ["u"]}))
    new = _csv(tmp_path / "new.csv", pd.DataFrame({"a": [1.0], "b": ["w"]}))
    o = chk.compare_file("data/x/t.csv", new, old)
    assert o.status == "drift" and "row 0 b" in o.note


def test_declared_numeric_tolerance_and_timing(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"t": {"s": 1.0}, "n": 3}))
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"t": {"s": 1.05}, "n": 3}))
    rules = (chk.Rule("data/a.json", "numeric", "test: 10% allowed", rtol=0.1),
             chk.Rule("data/b.json", "timing", "test: wall clock"))
    assert chk.compare_file("data/a.json", new, old, rules).status == "within"
    assert chk.compare_file("data/b.json", new, old, rules).status == "timing"
    assert not chk.compare_file("data/b.json", new, old, rules).failed
    assert chk.compare_file("data/c.json", new, old, rules).status == "drift"  # default: bytes equal
    tight = (chk.Rule("data/a.json", "numeric", "test: 1% allowed", rtol=0.01),)
    assert chk.compare_file("data/a.json", new, old, tight).status == "drift"


def test_gzip_tables_compare_by_value(tmp_path):
    def write(p, v, mtime):
        p.parent.mkdir(parents=True, exist_ok=True)
        with gzip.GzipFile(p, "wb", mtime=mtime) as f:
            f.write(pd.DataFrame({"a": [v]}).to_csv(index=False).encode())
    write(tmp_path / "o/t.csv.gz", 1.5, 0)
    write(tmp_path / "n/t.csv.gz", 1.5, 1)  # other header bytes, same values
    o = chk.compare_file("data/t.csv.gz", tmp_path / "n/t.csv.gz", tmp_path / "o/t.csv.gz")
    assert o.status == "drift" and o.max_abs == 0.0 and "formatting" in o.note


def test_trees_report_new_and_missing(tmp_path):
    _csv(tmp_path / "new/data/n/a.csv", pd.DataFrame({"a": [1]}))
    _csv(tmp_path / "new/data/n/fresh.csv", pd.DataFrame({"a": [1]}))
    _csv(tmp_path / "old/data/n/a.csv", pd.DataFrame({"a": [1]}))
    _csv(tmp_path / "old/data/n/gone.csv", pd.DataFrame({"a": [1]}))
    out = {o.path: o.status for o in chk.compare_trees(tmp_path / "new", tmp_path / "old", ["data/n"])}
    assert out == {"data/n/a.csv": "identical", "data/n/fresh.csv": "new", "data/n/gone.csv": "missing"}
    assert "1 identical" in chk.format_table(chk.compare_trees(tmp_path / "new", tmp_path / "old", ["data/n"]))


def test_sidecar_kept_when_bytes_unchanged(tmp_path):
    p = tmp_path / "data" / "t.json"
    save_json({"a": 1}, p, params={"run": 1})
    side = Path(str(p) + ".provenance.json")
    first = side.read_text()
    save_json({"a": 1}, p, params={"run": 2})  # same bytes: nothing rewritten
    assert side.read_text() == first
    save_json({"a": 2}, p, params={"run": 3})  # new bytes: new sidecar
    assert json.loads(side.read_text())["parameters"] == {"run": 3}
    assert chk.sidecar_mismatches(tmp_path, ["data"]) == []
    p.write_text("tampered")
    assert chk.sidecar_mismatches(tmp_path, ["data"]) == ["data/t.json: sidecar sha256 does not match the file"]


def test_promote_leaves_unchanged_artifacts_and_their_sidecars(tmp_path):
    dest, staging = tmp_path / "repo", tmp_path / "staging"
    df = pd.DataFrame({"a": [1.0]})
    save_dataframe(df, dest / "data/n/same.csv", params={"who": "committed"})
    save_dataframe(df, staging / "data/n/same.csv", params={"who": "rerun"})
    save_dataframe(df.assign(a=2.0), staging / "data/n/changed.csv", params={"who": "rerun"})
    committed_side = (dest / "data/n/same.csv.provenance.json").read_text()
    out = _promote(staging, dest)
    assert sorted(p.name for p in out) == ["changed.csv", "same.csv"]
    assert (dest / "data/n/same.csv.provenance.json").read_text() == committed_side
    assert json.loads((dest / "data/n/changed.csv.provenance.json").read_text())["parameters"] == {"who": "rerun"}
    assert not list(staging.rglob("*.csv*"))


def test_provenance_records_cpu_and_lock(tmp_path):
    p = write_artifact(tmp_path / "x.bin", b"x")
    side = json.loads(Path(str(p) + ".provenance.json").read_text())
    cpu = side["device"]["cpu"]
    assert cpu["model"] and cpu["torch_capability"] and "blas" in cpu
    assert len(side["lock_sha256"]) == 64


def test_recorded_artifacts_may_be_absent_but_not_different(tmp_path):
    _csv(tmp_path / "old/data/n/rec.csv", pd.DataFrame({"a": [1]}))
    rules = (chk.Rule("data/n/rec.csv", "recorded", "test: recomputed only on request"),)
    (absent,) = chk.compare_trees(tmp_path / "new", tmp_path / "old", ["data/n"], rules)
    assert absent.status == "recorded" and not absent.failed
    _csv(tmp_path / "new/data/n/rec.csv", pd.DataFrame({"a": [2]}))
    (other,) = chk.compare_trees(tmp_path / "new", tmp_path / "old", ["data/n"], rules)
    assert other.status == "drift"


def test_every_declared_rule_has_a_reason():
    for r in chk.RULES:
        assert r.kind in ("exact", "numeric", "timing", "recorded") and len(r.reason) > 20, r
        if "*" not in r.pattern:
            assert (REPO_ROOT / r.pattern).is_file(), f"rule for a file that does not exist: {r.pattern}"
