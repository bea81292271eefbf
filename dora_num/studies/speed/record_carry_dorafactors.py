"""``dora-num record carry-dorafactors [DIR] --from GIT_DIR``: the released dorafactors kernels the GPU machine
imports (default ``.carry/dorafactors``, git-ignored; never committed).

The paper's release, ``github.com/sockeye44/dorafactors`` at tag ``v1.0``, is read from a clone of it (a
bare mirror will do; nothing is fetched here) and only the two files the recorder imports are written
(``dora_fused.py`` and ``dora.py`` of ``code/peft_patched/src/peft/tuners/lora/``, 0.13 MiB: the device
carry holds 64 MiB in all, MiniLM takes 45 MB), byte for byte, with a ``VERSION`` (JSON: repository, tag,
commit, each file's path and sha256) that the recorder checks and records::

    git clone --bare https://github.com/sockeye44/dorafactors /tmp/dorafactors.git   # or any clone of it
    dora-num record carry-dorafactors .carry/dorafactors --from /tmp/dorafactors.git
    # then, on the GPU machine with .carry/dorafactors carried: dora-num record dorafactors (its docstring)
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from .record_dorafactors import CARRY_DIR, RELEASE_DIR, RELEASE_MODULES, RELEASE_REPO, RELEASE_TAG, VERSION_FILE, sha256


def _git(src: Path, *args: str) -> bytes:
    try:
        res = subprocess.run(["git", "-C", str(src), *args], capture_output=True, check=False)
    except OSError as e:
        raise RuntimeError(f"git is needed to read {src}: {e}") from None
    if res.returncode != 0:
        raise ValueError(f"git {' '.join(args)} in {src} failed: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout


def carry(src, dst=CARRY_DIR, rev: str = RELEASE_TAG) -> Path:
    """Write the release's files at ``rev`` of the git repository ``src`` (a clone of
    ``github.com/sockeye44/dorafactors``) into ``dst`` with their ``VERSION``; returns ``dst``."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"--from {src}: no such folder (a clone of {RELEASE_REPO})")
    try:
        commit = _git(src, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").decode().strip()
    except ValueError:
        raise ValueError(f"{src} has no commit {rev!r}: not a clone of {RELEASE_REPO} with its tags?") from None
    files = {}
    dst.mkdir(parents=True, exist_ok=True)
    for name in RELEASE_MODULES:
        path = f"{RELEASE_DIR}/{name}"
        data = _git(src, "show", f"{commit}:{path}")
        tmp = dst / (name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(dst / name)
        files[name] = {"path": path, "sha256": sha256(dst / name), "bytes": len(data)}
    version = {"repo": RELEASE_REPO, "tag": rev, "commit": commit, "files": files}
    (dst / VERSION_FILE).write_text(json.dumps(version, indent=2) + "\n")
    return dst


def build_parser(prog: str = "dora-num record carry-dorafactors", name: str = "carry-dorafactors"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dst", nargs="?", type=Path, default=CARRY_DIR,
                   help=f"output folder (default {CARRY_DIR}, git-ignored)")
    p.add_argument("--from", dest="src", type=Path, required=True, metavar="GIT_DIR",
                   help=f"a clone (or bare mirror) of {RELEASE_REPO}")
    p.add_argument("--rev", default=RELEASE_TAG, help=f"the tag or commit to carry (default {RELEASE_TAG})")
    return p


def record(args) -> int:
    try:
        out = carry(args.src, args.dst, args.rev)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        raise SystemExit(f"dora-num record carry-dorafactors: {e}") from None
    version = json.loads((out / VERSION_FILE).read_text())
    size = sum(f["bytes"] for f in version["files"].values())
    print(f"wrote {out}: {RELEASE_REPO} {version['tag']} = {version['commit']} ({size / 2**20:.2f} MiB)")
    return 0
