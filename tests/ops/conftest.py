"""Shared fixtures of the foundation tests: a session-wide measurement record.

Tests that measure something the lead reports (largest error/tolerance ratio of
the PEFT oracle, factored-norm memory) add rows with ``record(topic, **row)``.
At the end of the session each topic is written to
``build/test-reports/foundation_<topic>.json`` (git-ignored) and summarised in
the terminal output (tests/_report.py): the largest of every ``ratio*`` column
and the rows' ``summary`` texts.
"""

from __future__ import annotations

from _report import records

from dora_num.repro.paths import REPO_ROOT


def _summarise(topic: str, rows: list[dict], path) -> list[str]:
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
    return parts


record, pytest_terminal_summary = records("foundation", "foundation measurements", summarise=_summarise)
