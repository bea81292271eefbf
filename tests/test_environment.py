"""The lock: requirements.lock pins every dependency of pyproject.toml exactly, with hashes;
environment.yml (conda users) is generated from it and says the same."""

import tomllib

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from dora_num.repro.lockfile import ENVIRONMENT, LOCK, closure_problems, environment_yml, norm_name, parse_lock
from dora_num.repro.paths import REPO_ROOT

PINS = parse_lock(LOCK.read_text())


def _pyproject_requirements() -> list[Requirement]:
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in list(meta["dependencies"]) + list(meta["optional-dependencies"]["test"])]


def test_lock_pins_every_pyproject_requirement_within_its_range():
    for req in _pyproject_requirements():
        name = norm_name(req.name)
        assert name in PINS, f"{req.name} is in pyproject.toml but not in requirements.lock: run `make lock`"
        version = Version(PINS[name]["version"])
        assert req.specifier.contains(version, prereleases=True), \
            f"{req.name}: locked {version} outside pyproject's {req.specifier}: run `make lock`"


def test_every_locked_package_has_a_sha256():
    assert len(PINS) > 50  # the whole closure, not just the direct dependencies
    missing = [n for n, p in PINS.items() if not p["hashes"]]
    assert not missing, missing


def test_torch_and_triton_are_pinned():
    assert PINS["torch"]["version"] == "2.13.0+cpu"
    assert PINS["triton"]["version"] == "3.7.1"
    names = {norm_name(r.name): str(r.specifier) for r in _pyproject_requirements()}
    assert names["torch"] == "==2.13.0" and names["triton"] == "==3.7.1"


def test_no_cuda_wheels_in_the_lock():
    assert not [n for n in PINS if n.startswith("nvidia-")]


def test_environment_yml_is_generated_from_the_lock():
    assert ENVIRONMENT.read_text() == environment_yml(PINS), "environment.yml is stale: run `make lock`"


def test_environment_yml_parses_and_pins_python():
    env = yaml.safe_load(ENVIRONMENT.read_text())
    assert env["name"] == "dora-num"
    assert "python=3.11" in env["dependencies"]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    pinned = {norm_name(Requirement(s).name): str(Requirement(s).specifier) for s in pip if not s.startswith("-e")}
    assert pinned == {n: f"=={p['version']}" for n, p in PINS.items()}


def test_makefile_installs_from_the_lock_with_hashes():
    make = (REPO_ROOT / "Makefile").read_text()
    assert "dora_num/repro/venv.py $(VENV)" in make and "lock:" in make


def test_committed_data_and_figures_fit_the_budget():
    """The repository stays lean: everything committed under data/ and figures/ together under 15 MB
    (10^6 bytes, counted in 4 KiB disk blocks as ``du`` does: hundreds of small sidecars cost a block each;
    the recorded GPU data is summarised, raw records are regenerated, README says how)."""
    import subprocess

    files = subprocess.run(["git", "ls-files", "data", "figures"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    total = sum(-(-(REPO_ROOT / f).stat().st_size // 4096) * 4096 for f in files if (REPO_ROOT / f).exists())
    assert total < 15_000_000, f"data + figures = {total / 1e6:.2f} MB, over the 15 MB budget"


# ---------------------------------------------------------------------------------------------------------
# The install (dora_num/repro/venv.py): no resolution, so the lock must be closed
# ---------------------------------------------------------------------------------------------------------

def test_the_lock_is_closed_extras_included():
    """Starting from dora-num with its test extra, every requirement that applies here (the installed
    metadata), with every extra asked for along the way (pychop's ``dask[array]`` asks dask's ``array``
    extra), names a locked package at a locked version inside its range: an install with ``--no-deps``
    then lacks nothing."""
    from importlib.metadata import distributions

    requires = {norm_name(d.metadata["Name"]): list(d.requires or []) for d in distributions()}
    missing = sorted(n for n in PINS if n not in requires)
    assert not missing, f"locked but not installed here: {missing} (rebuild: make clean-venv venv)"
    problems = closure_problems(PINS, requires)
    assert not problems, "\n".join(problems)
    assert any(r.startswith("dask[array]") for r in requires["pychop"])  # the extra that once broke the install


def test_the_closure_check_finds_a_missing_extra_and_a_version_outside_its_range():
    pins = {"a": {"version": "1.0"}, "b": {"version": "2.0"}, "c": {"version": "0.5"}}
    requires = {"root": ["a", 'zz; extra == "never"'], "a": ["b[x]>=2"], "b": ['c>=1; extra == "x"', "d; python_version < '3'"]}
    assert closure_problems(pins, requires, root="root", extras=frozenset()) == \
        ["b needs c>=1; extra == \"x\": the lock has c==0.5"]
    del pins["c"]
    assert closure_problems(pins, requires, root="root", extras=frozenset()) == \
        ["b needs c>=1; extra == \"x\": not in requirements.lock"]


def test_the_install_resolves_nothing_and_cleans_up():
    from dora_num.repro import venv

    src = (REPO_ROOT / "dora_num" / "repro" / "venv.py").read_text()
    assert '"--no-deps", "--require-hashes"' in src and '"pip", "check"' in src
    rest, torch = venv.split_lock(LOCK.read_text())
    assert len(torch) == 1 and torch[0].startswith("torch==2.13.0+cpu") and "--hash=sha256:" in torch[0]
    assert len(rest) + 1 == len(PINS)
    assert sorted(norm_name(b.split("==")[0]) for b in rest) == sorted(n for n in PINS if n != "torch")


def test_another_python_is_told_in_one_line():
    from dora_num.repro import venv

    assert venv.python_mismatch((3, 11)) is None
    msg = venv.python_mismatch((3, 12))
    assert msg and "\n" not in msg and "Python 3.11" in msg and "3.12" in msg


def test_a_failed_build_leaves_no_venv(tmp_path):
    """A step that fails removes the half-built environment (the next make venv starts clean)."""
    from dora_num.repro import venv

    def fail(_venv):
        (_venv / "bin").mkdir(parents=True)
        raise venv.SetupError("installing the locked packages failed (exit 1)")

    target = tmp_path / ".venv"
    assert venv.main([str(target)], build_fn=fail) == 1
    assert not target.exists()
