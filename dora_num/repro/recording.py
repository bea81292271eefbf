"""What a recorder writes about the machine it ran on, and the one ingest of its output into ``data/``.

A recorder (``dora-num record NAME --out DIR``, on the machine it needs) writes its files and a
``device.json`` (:func:`describe_machine`: device, library versions, git sha, argv) under ``DIR``,
never into ``data/``.  ``dora-num record NAME --ingest DIR`` copies or merges them into ``data/``
through :func:`ingest`, whose sidecars share one vocabulary: the *measuring* machine's ``device``,
``producer``, ``parameters``, ``seed``, and under ``extra`` ``measured_at_git_sha`` (the GPU
machine's copy of the tree has no ``.git``), ``measured_versions``, ``measured_argv``,
``measured_from``.  :func:`parser` and :func:`require_cuda` are the options and the refusal every
recorder shares.  The data sets themselves are declared in :mod:`dora_num.studies.datasets`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pandas as pd

from .provenance import device_info, read_provenance, save_dataframe, save_json, versions, write_artifact

MACHINE_FILE = "device.json"  # what every recorder writes about its machine, beside its files


# --------------------------------------------------------------------------
# A recorder's command line (every ``dora-num record`` subcommand builds on these)
# --------------------------------------------------------------------------

def require_cuda(name: str, available: bool, why: str | None = None) -> None:
    """The one way a GPU-only recorder refuses on a machine without CUDA: a one-line message on
    stderr and exit status 1 (``SystemExit`` with the message), no traceback.  ``available`` is the
    recorder's own ``torch.cuda.is_available()``: producers ask the device, this module does not
    (tests/studies/test_layout.py)."""
    if not available:
        raise SystemExit(f"dora-num record {name} needs a CUDA GPU{f' ({why})' if why else ''}; this machine has none")


def parser(prog: str, description: str | None, *, ingest: str | None = "DIR", many: bool = False,
           smoke: str | None = "tiny sizes (a check of the recorder)", out: str = "output folder",
           out_required: bool = True) -> argparse.ArgumentParser:
    """A recorder's parser with the options every recorder shares: ``--out``, ``--ingest``
    (``None``: it writes into ``data/`` itself), ``--git-sha`` and ``--smoke`` (``None``: none)."""
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help=out + (" (with --ingest: the data folder, default its folder under data/)"
                                                   if ingest else ""))
    if ingest:
        p.add_argument("--ingest", type=Path, nargs="+" if many else None, metavar=ingest,
                       help="instead of measuring: record this output folder into data/ with provenance")
    p.add_argument("--git-sha", default=None, help="the commit that ran (the GPU machine's copy of the tree has no .git)")
    if smoke:
        p.add_argument("--smoke", action="store_true", help=smoke)
    p.set_defaults(_out_required=out_required)
    return p


# --------------------------------------------------------------------------
# The measuring machine
# --------------------------------------------------------------------------

def checkout_git_sha() -> str | None:
    """``git rev-parse HEAD`` in the current directory; None where there is no checkout (the
    GPU machine's copy of the tree has no ``.git``) or no git."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def measured_git_sha(explicit: str | None = None) -> str | None:
    """The commit a recorder measures: ``explicit`` (its ``--git-sha``), else the environment's
    ``DORA_NUM_GIT_SHA`` (set by the ``.ci/gpu`` scripts), else :func:`checkout_git_sha`."""
    sha = explicit or os.environ.get("DORA_NUM_GIT_SHA")
    return checkout_git_sha() if sha is None else sha


def describe_machine(git_sha: str | None = None, **fields) -> dict:
    """What a recorder writes as ``device.json``: the device (GPU name, capability,
    driver, memory), library versions, the git sha of the code and the argv, plus
    ``fields`` (e.g. the copy bandwidth, the sections run)."""
    info = device_info()
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(sm_count=p.multi_processor_count, total_memory=p.total_memory)
            fields.setdefault("torch_cuda", torch.version.cuda)
    except Exception as e:  # noqa: BLE001 - a description must never break a recording
        info["error"] = repr(e)
    return {"device": info, "versions": versions(), "git_sha": git_sha, "python": platform.python_version(),
            "argv": sys.argv, **fields}


def write_machine(out: Path, desc: dict) -> Path:
    """``desc`` as ``out/device.json`` (a recorder's own output folder, not ``data/``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MACHINE_FILE).write_text(json.dumps(desc, indent=2, default=str) + "\n")
    return out / MACHINE_FILE


def read_machine(src: Path) -> dict:
    """The ``device.json`` a recorder wrote in ``src``; a clear error if there is none."""
    f = Path(src) / MACHINE_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{src} has no device.json: not the output folder of a recorder")
    return json.loads(f.read_text())


def machine_from_sidecar(path: Path) -> dict:
    """The measuring machine as the provenance sidecar of ``path`` describes it (for
    recorders that write their tables through :mod:`dora_num.repro.provenance` on the
    measuring machine)."""
    side = read_provenance(path)
    return {"device": side.get("device"), "versions": side.get("versions"), "argv": side.get("argv"),
            "git_sha": (side.get("git") or {}).get("sha")}


# --------------------------------------------------------------------------
# Ingest
# --------------------------------------------------------------------------

def ingest(artifacts: dict, dest: Path, *, machine: dict, producer: str, git_sha: str | None = None,
           params: dict | None = None, seed: int | None = None, extra: dict | None = None,
           sources=(), inputs: dict | None = None, float_formats: dict[str, str] | None = None) -> list[Path]:
    """Write recorded ``artifacts`` into ``dest`` (under ``data/``), each with a sidecar.

    ``artifacts``: ``{file name: content}``, content a ``Path`` or ``bytes`` (copied
    byte for byte), a pandas ``DataFrame`` (:func:`~dora_num.repro.provenance.save_dataframe`,
    ``float_formats[name]`` if given) or a JSON-able ``dict``.  ``machine``: the
    measuring machine (:func:`read_machine` / :func:`machine_from_sidecar`).
    ``git_sha``: the commit that ran, when ``machine`` does not know it.  ``inputs``:
    ``{name: file}`` the artifacts were derived from (e.g. the archives a GPU machine
    returned), hashed into every sidecar.  Sidecar keys: see the module docstring."""
    dest = Path(dest)
    prov = dict(device=machine.get("device"), producer=producer, params=params or {}, seed=seed, inputs=inputs,
                extra={"measured_at_git_sha": git_sha or machine.get("git_sha"),
                       "measured_versions": machine.get("versions"), "measured_argv": machine.get("argv"),
                       "measured_from": [Path(s).name for s in sources], **(extra or {})})
    written = []
    for name, content in artifacts.items():
        path = dest / name
        if isinstance(content, pd.DataFrame):
            written.append(save_dataframe(content, path, float_format=(float_formats or {}).get(name), **prov))
        elif isinstance(content, dict):
            written.append(save_json(content, path, **prov))
        elif isinstance(content, (bytes, bytearray)):
            written.append(write_artifact(path, bytes(content), **prov))
        else:
            written.append(write_artifact(path, Path(content).read_bytes(), **prov))
    return written


def ingest_folder(src: Path, dest: Path, *, producer: str, names=None, git_sha: str | None = None,
                  params: dict | None = None, seed: int | None = None, extra: dict | None = None) -> list[Path]:
    """:func:`ingest` of the files of a recorder's folder ``src`` (all of them, its
    ``device.json`` included, or those in ``names``), the machine from its
    ``device.json``; refuses a folder without one of the ``names`` asked for."""
    src = Path(src)
    machine = read_machine(src)
    files = sorted(p for p in src.iterdir() if p.is_file() and (names is None or p.name in names))
    if names is not None:
        absent = sorted(set(names) - {p.name for p in files})
        if absent:
            raise FileNotFoundError(f"{src} lacks {absent}")
    return ingest({p.name: p for p in files}, dest, machine=machine, producer=producer, git_sha=git_sha,
                  params=params, seed=seed, extra=extra, sources=[src])
