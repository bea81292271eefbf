"""Session-wide measurement records for tests that report a number (tightness, rates).

``records(prefix)`` returns a ``record`` fixture and a terminal-summary hook: tests add
rows with ``record(topic, **row)``; at the end of the session each topic is written to
``build/test-reports/<prefix>_<topic>.json`` (git-ignored) and printed.
"""

from __future__ import annotations

import json
import math

import pytest

from dora_num.repro.paths import REPO_ROOT

REPORT_DIR = REPO_ROOT / "build" / "test-reports"


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def records(prefix: str, title: str):
    store: dict[str, list[dict]] = {}
    lines: list[str] = []

    @pytest.fixture(scope="session")
    def record():
        def add(topic: str, **row):
            store.setdefault(topic, []).append({k: _finite(v) for k, v in row.items()})

        yield add
        REPORT_DIR.mkdir(parents=True, exist_ok=True)
        for topic, rows in store.items():
            path = REPORT_DIR / f"{prefix}_{topic}.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(rows, indent=1))
            tmp.replace(path)
            lines.append(f"{topic}: {len(rows)} rows -> {path.relative_to(REPO_ROOT)}")
            for r in rows:
                lines.append("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in r.items()))

    def pytest_terminal_summary(terminalreporter):
        if lines:
            terminalreporter.section(title)
            for line in lines:
                terminalreporter.write_line(line)

    return record, pytest_terminal_summary
