"""``make venv``: the project's virtual environment from ``requirements.lock``, with no dependency resolution.

Run with the system Python and no package import (``python3 dora_num/repro/venv.py .venv``). Every locked
file is installed with ``pip install --no-deps --require-hashes``: pip never asks the index what a package
needs, so a release published after the lock (a newer ``dask`` reached through ``pychop``'s ``dask[array]``
extra broke the resolving install once) cannot change or break the environment. That the lock is closed
(every requirement of every locked package, extras included, met by a locked version) is checked by
``tests/test_environment.py`` on the installed metadata, and ``pip check`` runs here after the install.

torch is the CPU build ``2.13.0+cpu``, published on PyTorch's own index, not on PyPI. It is installed on its
own: first from whatever pip is configured to find (a wheel folder or a mirror: no extra request), then, only
where that finds nothing, from ``TORCH_INDEX``. A failed install removes the half-built environment, so the
next ``make venv`` starts clean.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

try:  # run as a script before anything is installed (make venv), or imported as part of the package
    from .lockfile import parse_lock
except ImportError:
    from lockfile import parse_lock

REPO_ROOT = Path(__file__).resolve().parents[2]  # no package import: this runs before anything is installed
LOCK = REPO_ROOT / "requirements.lock"
LOCK_PYTHON = (3, 11)  # the lock's interpreter (`make lock`: --python-version 3.11)
TORCH_INDEX = os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")


class SetupError(RuntimeError):
    """A step of the set-up failed; the message says which and what to do."""


def python_mismatch(version: tuple[int, ...] = tuple(sys.version_info[:2])) -> str | None:
    """One line when ``version`` is not the lock's Python, else ``None``."""
    if tuple(version[:2]) == LOCK_PYTHON:
        return None
    want = ".".join(map(str, LOCK_PYTHON))
    return (f"make venv: requirements.lock is for Python {want}, this is Python {version[0]}.{version[1]} "
            f"({sys.executable}); run with PYTHON=python{want} (e.g. `make test PYTHON=python{want}`)")


def split_lock(text: str) -> tuple[list[str], list[str]]:
    """The lock's pins as hashed requirement lines (:func:`lockfile.parse_lock`), torch's apart."""
    lines = {name: f"{name}=={p['version']} " + " ".join(f"--hash=sha256:{h}" for h in p["hashes"])
             for name, p in parse_lock(text).items()}
    torch = [lines.pop("torch")] if "torch" in lines else []
    if len(torch) != 1:
        raise SetupError("requirements.lock holds no torch pin (run `make lock`)")
    return list(lines.values()), torch


def _run(args: list[str], what: str, quiet_fail: bool = False) -> bool:
    done = subprocess.run(args, capture_output=quiet_fail, text=True)
    if done.returncode == 0:
        return True
    if quiet_fail:
        return False
    raise SetupError(f"{what} failed (exit {done.returncode}): {' '.join(args)}")


def _pip(py: Path, *args: str) -> list[str]:
    return [str(py), "-m", "pip", "install", "-q", "--no-deps", "--require-hashes", "--no-cache-dir", *args]


def build(venv: Path) -> None:
    """Create ``venv`` and install the lock, the package (editable) and its Jupyter kernel into it."""
    t0 = time.monotonic()
    rest, torch = split_lock(LOCK.read_text())
    build_dir = REPO_ROOT / "build"
    build_dir.mkdir(exist_ok=True)
    rest_file, torch_file = build_dir / "lock-rest.txt", build_dir / "lock-torch.txt"
    rest_file.write_text("\n".join(rest) + "\n")
    torch_file.write_text("\n".join(torch) + "\n")
    py = venv / "bin" / "python"
    print(f"make venv: {venv} from {LOCK.name} ({len(rest) + 1} locked packages, no resolution; ~1.5 min)",
          flush=True)
    _run([sys.executable, "-m", "venv", str(venv)], "creating the venv")
    print("make venv: torch 2.13.0+cpu", flush=True)
    if not _run(_pip(py, "-r", str(torch_file)), "torch", quiet_fail=True):
        print(f"make venv: torch 2.13.0+cpu is not where pip looks by default; trying {TORCH_INDEX}", flush=True)
        _run(_pip(py, "--extra-index-url", TORCH_INDEX, "-r", str(torch_file)),
             f"installing torch 2.13.0+cpu from PyTorch's index ({TORCH_INDEX}; set TORCH_INDEX to a mirror)")
    print("make venv: the other locked packages", flush=True)
    _run(_pip(py, "-r", str(rest_file)), "installing the locked packages")
    _run([str(py), "-m", "pip", "check"], "pip check (a locked package's requirement is not met by the lock)")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(REPO_ROOT)],
         "installing dora-num (editable)")
    _run([str(py), "-m", "ipykernel", "install", "--sys-prefix", "--name", "dora-num",
          "--display-name", "Python (dora-num)"], "installing the Jupyter kernel")
    print(f"make venv: done in {time.monotonic() - t0:.0f} s", flush=True)


def main(argv: list[str] | None = None, build_fn=build) -> int:
    """``build_fn``: the build step (a seam for the tests)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python3 dora_num/repro/venv.py",
                                 description="Build the project's virtual environment from requirements.lock with no "
                                             "dependency resolution (what `make venv` runs).")
    ap.add_argument("venv", nargs="?", default=".venv", help="the folder to build (default .venv; removed first)")
    venv = Path(ap.parse_args(argv).venv).resolve()
    msg = python_mismatch()
    if msg:
        print(msg, file=sys.stderr)
        return 2
    # A leftover from an interrupted or failed build is never reused: the stamp is written only on success.
    if venv.exists():
        shutil.rmtree(venv)
    try:
        build_fn(venv)
    except BaseException as exc:  # KeyboardInterrupt too: never leave a half-built venv behind
        shutil.rmtree(venv, ignore_errors=True)
        if isinstance(exc, SetupError):
            print(f"make venv: {exc}; the half-built {venv.name} was removed", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
