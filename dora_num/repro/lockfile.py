"""The dependency lock: ``requirements.lock`` (exact versions + sha256 of every file) and
``environment.yml`` generated from it.

``make lock`` resolves ``pyproject.toml`` (with the ``test`` extra) for CPython 3.11 on
x86-64 Linux with a pinned ``uv`` (``uv pip compile --generate-hashes``), taking the
CPU build of torch (``torch==2.13.0+cpu``) from ``TORCH_WHEELS`` (a folder or the
PyTorch CPU index page), then runs ``python dora_num/repro/lockfile.py`` to write
``environment.yml`` with the same pins.  ``make venv`` installs the lock with
``pip install --require-hashes`` and the package itself with ``--no-deps``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # no package import: `make lock` runs this without torch
LOCK = REPO_ROOT / "requirements.lock"
ENVIRONMENT = REPO_ROOT / "environment.yml"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def parse_lock(text: str) -> dict[str, dict]:
    """``{name: {"version": ..., "hashes": [...]}}`` from a pip-style hashed lock."""
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _PIN.match(line)
        if m:
            current = norm_name(m.group(1))
            out[current] = {"version": m.group(2), "hashes": []}
        for h in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
            if current is None:
                raise ValueError(f"hash before any requirement: {line!r}")
            out[current]["hashes"].append(h)
    return out


def norm_name(name: str) -> str:
    """A distribution name as the lock keys it (PEP 503: lower case, ``-`` for ``_`` and ``.``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def closure_problems(pins: dict[str, dict], requires: dict[str, list[str]], root: str = "dora-num",
                     extras: frozenset = frozenset({"test"}), environment: dict | None = None) -> list[str]:
    """What an install of ``pins`` with ``--no-deps`` would lack: starting from ``root[extras]``, each
    requirement that applies (its marker, with every extra asked for along the way) must name a pinned
    package whose pinned version is inside its range.  ``requires``: ``{name: [requirement strings]}``,
    e.g. the installed metadata.  Empty when the lock is closed."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.version import Version

    env = default_environment() if environment is None else environment
    todo, seen, problems = [(norm_name(root), frozenset(extras))], set(), []
    while todo:
        name, asked = todo.pop()
        if (name, asked) in seen:
            continue
        seen.add((name, asked))
        for text in requires.get(name, []):
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e}) for e in asked | {""}):
                continue
            dep = norm_name(req.name)
            if dep not in pins:
                problems.append(f"{name} needs {req}: not in requirements.lock")
            elif not req.specifier.contains(Version(pins[dep]["version"]), prereleases=True):
                problems.append(f"{name} needs {req}: the lock has {dep}=={pins[dep]['version']}")
            else:
                todo.append((dep, frozenset(req.extras)))
    return problems


def environment_yml(pins: dict[str, dict]) -> str:
    lines = ["# Generated from requirements.lock by `make lock` (python -m dora_num.repro.lockfile); do not edit.",
             "# Conda users: `conda env create -f environment.yml`. The tested route is the Makefile's",
             "# venv (pip install --require-hashes -r requirements.lock); these are the same exact versions.",
             "# torch is the CPU build (+cpu), published on PyTorch's own index: where pip does not already",
             "# find it, add PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.",
             "name: dora-num", "channels:", "  - conda-forge", "dependencies:", "  - python=3.11", "  - pip",
             "  - pip:"]
    lines += [f"      - {name}=={p['version']}" for name, p in sorted(pins.items())]
    lines.append("      - -e .")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python dora_num/repro/lockfile.py",
                                 description="Write environment.yml from requirements.lock (same exact versions).")
    ap.add_argument("--check", action="store_true", help="only check that environment.yml agrees with the lock")
    args = ap.parse_args(argv)
    want = environment_yml(parse_lock(LOCK.read_text()))
    if args.check:
        ok = ENVIRONMENT.is_file() and ENVIRONMENT.read_text() == want
        print("environment.yml agrees with requirements.lock" if ok else "environment.yml is stale: run make lock")
        return 0 if ok else 1
    ENVIRONMENT.write_text(want)
    print(f"wrote {ENVIRONMENT.name} ({want.count('==')} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
