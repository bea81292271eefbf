"""environment.yml (conda users) lists exactly the dependencies of pyproject.toml."""

import tomllib

import yaml
from packaging.requirements import Requirement

from dora_num.repro.paths import REPO_ROOT


def _pyproject_requirements() -> dict[str, str]:
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"]) + list(meta["optional-dependencies"]["test"])
    return {Requirement(r).name.lower(): str(Requirement(r).specifier) for r in reqs}


def _environment_requirements() -> dict[str, str]:
    env = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    out = {}
    for spec in pip:
        if spec.startswith("-e"):
            continue
        r = Requirement(spec)
        out[r.name.lower()] = str(r.specifier)
    return out


def test_environment_yml_parses_and_pins_python():
    env = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    assert env["name"] == "dora-num"
    assert "python=3.11" in env["dependencies"]


def test_environment_yml_matches_pyproject():
    assert _environment_requirements() == _pyproject_requirements()


def test_torch_and_triton_are_pinned():
    reqs = _pyproject_requirements()
    assert reqs["torch"] == "==2.13.0"
    assert reqs["triton"] == "==3.7.1"
