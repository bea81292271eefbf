"""Measured rates of notebook 01's claims: rows go to
``build/test-reports/cancellation_<topic>.json`` and the terminal summary (tests/_report.py)."""

from _report import records

record, pytest_terminal_summary = records("cancellation", "cancellation: the 1-ulp claim with its precondition")
