"""Shared fixtures of the foundation tests: a session-wide measurement record.

Tests that measure something the lead reports (largest error/tolerance ratio of
the PEFT oracle, factored-norm memory) add rows with ``record(topic, **row)``.
At the end of the session each topic is written to
``build/test-reports/foundation_<topic>.json`` (git-ignored) and summarised in
the terminal output.
"""

from __future__ import annotations

import json
import math

import pytest

from dora_num.repro.paths import REPO_ROOT

REPORT_DIR = REPO_ROOT / "build" / "test-reports"
_RECORDS: dict[str, list[dict]] = {}
_SUMMARIES: dict[str, str] = {}


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
        path = REPORT_DIR / f"foundation_{topic}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(path)
        _SUMMARIES[topic] = _summarise(topic, rows, path)


def _summarise(topic: str, rows: list[dict], path) -> str:
    ratio_keys = sorted({k for r in rows for k in r if k.startswith("ratio")})
    parts = [f"{topic}: {len(rows)} rows -> {path.relative_to(REPO_ROOT)}"]
    for k in ratio_keys:
        vals = [(r[k], r) for r in rows if isinstance(r.get(k), (int, float))]
        if vals:
            v, row = max(vals, key=lambda t: t[0])
            where = row.get("case", "?"), row.get("tensor", "")
            parts.append(f"  max {k} = {v:.3g} at {where}")
    for r in rows:
        if "summary" in r:
            parts.append(f"  {r['summary']}")
    return "\n".join(parts)


def pytest_terminal_summary(terminalreporter):
    if _SUMMARIES:
        terminalreporter.section("foundation measurements")
        for text in _SUMMARIES.values():
            terminalreporter.write_line(text)
