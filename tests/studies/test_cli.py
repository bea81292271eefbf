"""``dora-num record NAME``: every recorder behind one command; ``--help`` prints and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dora_num.__main__ import build_parser
from dora_num.repro.paths import REPO_ROOT
from dora_num.studies import cli


@pytest.mark.parametrize("name", list(cli.RECORDERS))
def test_every_recorder_prints_help_and_writes_nothing(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a recorder that wrote anything would write here
    with pytest.raises(SystemExit) as e:
        cli.run(name, ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"dora-num record {name}" in out and ("--git-sha" in out or name in cli.TOOLS)
    assert list(tmp_path.iterdir()) == []


def test_record_is_a_subcommand_and_lists_the_recorders(capsys):
    args = build_parser().parse_args(["record", "convergence", "--out", "x", "--smoke"])
    assert args.command == "record" and args.name == "convergence" and args.args == ["--out", "x", "--smoke"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["record", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in cli.RECORDERS)
    with pytest.raises(SystemExit, match="unknown recorder"):
        cli.run("no-such-recorder", [])


def test_a_recorder_asks_for_out_or_ingest(capsys):
    with pytest.raises(SystemExit) as e:
        cli.run("memory", [])
    assert e.value.code == 2 and "--out DIR is required (or --ingest DIR)" in capsys.readouterr().err


def test_dora_num_record_runs_in_a_fresh_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    res = subprocess.run([sys.executable, "-m", "dora_num", "record", "carry", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "dora-num record carry" in res.stdout
    assert list(tmp_path.iterdir()) == []
