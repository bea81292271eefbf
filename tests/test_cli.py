"""The command line: --version, user-facing help, and every ``python -m`` entry point
parses its arguments (``--help`` prints help and writes nothing)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import dora_num
from dora_num.__main__ import build_parser
from dora_num.repro.paths import REPO_ROOT

RST = re.compile(r"``|:func:|:mod:|:class:|:data:|:meth:")
ENTRY_POINTS = sorted(
    ".".join(p.relative_to(REPO_ROOT).with_suffix("").parts)
    for p in (REPO_ROOT / "dora_num").rglob("*.py")
    if 'if __name__ == "__main__":' in p.read_text())


def _run(args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=180,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)})


def test_version(tmp_path):
    proc = _run(["-m", "dora_num", "--version"], tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"dora-num {dora_num.__version__}"


def test_every_command_has_help_without_markup(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert {"reproduce", "collapse", "gpu-suite"} <= set(sub.choices)
    for name, p in [("dora-num", parser), *sub.choices.items()]:
        text = p.format_help()
        assert not RST.search(text), f"{name} --help shows RST markup:\n{text}"
        for action in p._actions:
            if action.dest not in ("help", "version") and action.option_strings:
                assert action.help, f"{name} {action.option_strings} has no help"


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_point_help_writes_nothing(module, tmp_path, monkeypatch, capsys):
    """In-process: ``main(["--help"])`` of every module with a ``__main__`` block (a fresh process
    is tested once, by :func:`test_version`)."""
    import importlib

    monkeypatch.chdir(tmp_path)
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [], f"{module} --help wrote {list(tmp_path.iterdir())}"


def test_the_package_docstring_names_every_public_name():
    doc = dora_num.__doc__
    assert [n for n in dora_num.__all__ if not re.search(rf"\b{n}\b", doc)] == []


@pytest.mark.parametrize("name", ["memory", "suite", "exhaustive", "train-graphs", "overhead", "guard-cost", "products"])
def test_gpu_only_recorders_refuse_on_cpu_in_one_line(name, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("tests the refusal of a machine without CUDA; with a GPU the recorder would start measuring")
    proc = subprocess.run([sys.executable, "-m", "dora_num", "record", name, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line, no traceback
    assert f"dora-num record {name} needs a CUDA GPU" in proc.stderr, proc.stderr
