"""How long the README's commands take on a fresh clone: recorded, then shown in the README.

``python -m dora_num.repro.durations`` clones the repository's HEAD into a temporary folder and runs
``make venv``, ``make test``, ``make reproduce`` and ``make check`` there in turn (each from a fresh clone's
state, as a newcomer would), timing each and keeping its exit status, then writes
``data/setup/durations.json`` with provenance (the CPU model and core count are in its sidecar). The
README's table between :data:`BEGIN` and :data:`END` is generated from it (:func:`table`), so no duration
in the README is typed by hand. A command that failed is recorded as failed, never as a duration.
``--provisional`` writes a record with no times (the README says "not recorded"): the committed record the
clone's tests need the first time, before one has been measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .paths import COMMITTED_DATA_DIR, REPO_ROOT, DataSet

# The README's commands timed on a fresh clone (read by the README, not by a notebook); gathered with
# every other data set by dora_num.studies.datasets.
DURATIONS = DataSet("durations", {"record": "setup/durations.json"}, recorder="python3 -m dora_num.repro.durations",
                    where="the CPU, a fresh clone: about 35 min on 2 cores", ingest=False)
RECORD = DURATIONS.files[0]  # under data/
BEGIN = f"<!-- durations:begin (generated from data/{RECORD}; do not edit) -->"
END = "<!-- durations:end -->"
COMMANDS = ("venv", "test", "reproduce", "check")  # in this order: each needs the one before
WHAT = {
    "venv": "`.venv` from `requirements.lock`: every file at its locked version and sha256, installed with no "
            "dependency resolution, then `pip check`; a failed install is removed",
    "test": "the test suite (CPU; GPU tests skip visibly)",
    "reproduce": "every notebook, headless: `data/`, `figures/`, `notebooks/rendered/` and this README",
    "check": "the same into a temporary folder, compared with the committed artifacts (kept on a drift, "
             "with the differing rows and values printed)",
}


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def table(data: Path = COMMITTED_DATA_DIR) -> str:
    """The README's table of the commands, what each does and how long it took on the recorded clone."""
    path = data / RECORD
    rec = json.loads(path.read_text()) if path.is_file() else None
    side = json.loads((data / (RECORD + ".provenance.json")).read_text()) if rec else {}
    cpu = side.get("device", {}).get("cpu", {})
    where = (f"{cpu.get('model', 'unknown CPU')}, {cpu.get('cores', '?')} cores, {rec['commit'][:12]}"
             if rec and rec["commands"] else "not recorded")
    lines = [f"| command | what it does | wall time on a fresh clone ({where}) |", "|---|---|---|"]
    for name in COMMANDS:
        r = (rec or {}).get("commands", {}).get(name)
        took = "not recorded" if r is None else (_minutes(r["seconds"]) if r["exit"] == 0
                                                  else f"failed (exit {r['exit']})")
        lines.append(f"| `make {name}` | {WHAT[name]} | {took} |")
    return "\n".join(lines)


def record(out: Path = COMMITTED_DATA_DIR / RECORD, log=print, provisional: bool = False) -> dict:
    """Time the README's commands on a fresh clone of HEAD; write ``out`` (with its sidecar)."""
    from .provenance import git_state, save_json

    commit = git_state()["sha"]
    results: dict[str, dict] = {}
    if provisional:
        rec = {"commit": commit, "commands": {}}
        save_json(rec, out, producer="python3 -m dora_num.repro.durations", params={"provisional": True})
        return rec
    with tempfile.TemporaryDirectory(prefix="dora-num-durations-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)
        for name in COMMANDS:
            log(f"make {name} ...")
            t0 = time.monotonic()
            done = subprocess.run(["make", name], cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            lines = done.stdout.strip().splitlines()
            results[name] = {"seconds": round(time.monotonic() - t0, 1), "exit": done.returncode,
                             "failed": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:20],
                             "last_lines": lines[-3:]}
            log(f"make {name}: exit {done.returncode} in {_minutes(results[name]['seconds'])}")
            if done.returncode != 0:
                break
    rec = {"commit": commit, "commands": results}
    save_json(rec, out, producer="python3 -m dora_num.repro.durations", params={"commands": list(COMMANDS)})
    return rec


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dora_num.repro.durations",
                                 description="Time make venv/test/reproduce/check on a fresh clone of HEAD "
                                             "(about 35 minutes on 2 cores) and record it for the README.")
    ap.add_argument("--provisional", action="store_true", help="write a record with no times (see the module doc)")
    args = ap.parse_args(argv)
    rec = record(provisional=args.provisional)
    return 0 if all(r["exit"] == 0 for r in rec["commands"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
