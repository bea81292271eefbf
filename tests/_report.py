"""Session-wide measurement records for tests that report a number (tightness, rates).

``records(prefix, title)`` returns a ``record`` fixture and a terminal-summary hook: tests
add rows with ``record(topic, **row)``; at the end of the session each topic is written to
``build/test-reports/<prefix>_<topic>.json`` (git-ignored) and summarised under ``title``
(by default every row; ``summarise(topic, rows, path)`` returns the lines instead).
"""

from __future__ import annotations

import json
import math
from typing import Callable

import pytest

from dora_num.repro.paths import REPO_ROOT

REPORT_DIR = REPO_ROOT / "build" / "test-reports"


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def every_row(topic: str, rows: list[dict], path) -> list[str]:
    """The default summary: the topic's file, then each row."""
    lines = [f"{topic}: {len(rows)} rows -> {path.relative_to(REPO_ROOT)}"]
    for r in rows:
        lines.append("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in r.items()))
    return lines


def records(prefix: str, title: str, summarise: Callable[[str, list[dict], object], list[str]] = every_row):
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
            lines.extend(summarise(topic, rows, path))

    def pytest_terminal_summary(terminalreporter):
        if lines:
            terminalreporter.section(title)
            for line in lines:
                terminalreporter.write_line(line)

    return record, pytest_terminal_summary
