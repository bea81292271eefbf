"""A session-wide record of measured tightness (error / bound) per input class.

Tests add rows with ``record(topic, **row)``; at the end of the session each topic is
written to ``build/test-reports/numerics_<topic>.json`` (git-ignored) and summarised in
the terminal output (the largest ``ratio*`` per topic, with its ``case``).
"""

from __future__ import annotations

import json
import math

import pytest

from dora_num.repro.paths import REPO_ROOT

REPORT_DIR = REPO_ROOT / "build" / "test-reports"
_RECORDS: dict[str, list[dict]] = {}
_LINES: list[str] = []


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


@pytest.fixture(scope="session")
def record():
    def add(topic: str, **row):
        _RECORDS.setdefault(topic, []).append({k: _finite(v) for k, v in row.items()})

    yield add
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    for topic, rows in _RECORDS.items():
        path = REPORT_DIR / f"numerics_{topic}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(path)
        _LINES.append(f"{topic}: {len(rows)} rows -> {path.relative_to(REPO_ROOT)}")
        for r in rows:
            parts = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()]
            _LINES.append("  " + ", ".join(parts))


def pytest_terminal_summary(terminalreporter):
    if _LINES:
        terminalreporter.section("numerics: measured tightness per class")
        for line in _LINES:
            terminalreporter.write_line(line)
