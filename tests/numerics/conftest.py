"""Measured tightness (error / bound) per input class: ``record(topic, **row)`` rows go to
``build/test-reports/numerics_<topic>.json`` and the terminal summary (tests/_report.py)."""

from _report import records

record, pytest_terminal_summary = records("numerics", "numerics: measured tightness per class")
