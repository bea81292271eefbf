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
            current = m.group(1).lower().replace("_", "-")
            out[current] = {"version": m.group(2), "hashes": []}
        for h in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
            if current is None:
                raise ValueError(f"hash before any requirement: {line!r}")
            out[current]["hashes"].append(h)
    return out


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
