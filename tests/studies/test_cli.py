"""``dora-num record NAME``: every recorder behind one command; ``--help`` prints and writes
nothing; each module's ``python -m`` entry point delegates to it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from dora_num.__main__ import build_parser
from dora_num.repro.paths import REPO_ROOT
from dora_num.studies import cli

MODULE_MAINS = {  # python -m entry points that must keep working
    "dora_num.studies.record_suite": "suite", "dora_num.studies.convergence.record_convergence": "convergence",
    "dora_num.studies.gradient.memory_model": "memory", "dora_num.studies.gradient.record_memory": "memory",
    "dora_num.studies.cancellation.record_adapters": "adapters",
    "dora_num.studies.cancellation.record_trained": "adapters-gpu", "dora_num.studies.speed.record_train_graphs": "train-graphs",
    "dora_num.studies.speed.record_overhead": "overhead", "dora_num.studies.record_carry": "carry",
    "dora_num.studies.record_exhaustive": "exhaustive",
}


@pytest.mark.parametrize("name", list(cli.RECORDERS))
def test_every_recorder_prints_help_and_writes_nothing(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a recorder that wrote anything would write here
    with pytest.raises(SystemExit) as e:
        cli.run(name, ["--help"])
    assert e.value.code == 0
    assert f"dora-num record {name}" in capsys.readouterr().out
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


@pytest.mark.parametrize("module", list(MODULE_MAINS))
def test_module_entry_points_delegate_to_the_recorder(module, capsys):
    """``python -m <module> --help`` is the recorder's own help (``dora-num record NAME``), through cli.run."""
    try:
        rc = importlib.import_module(module).main(["--help"])
    except SystemExit as e:
        rc = e.code
    assert rc in (0, None)
    assert f"dora-num record {MODULE_MAINS[module]}" in capsys.readouterr().out


def test_python_m_help_runs_in_a_fresh_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    res = subprocess.run([sys.executable, "-m", "dora_num.studies.record_carry", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "dora-num record carry" in res.stdout
    assert list(tmp_path.iterdir()) == []
