"""pytest plugin for device runs (``-p instafail``, ``.ci/gpu`` on PYTHONPATH): each failure's report is
printed the moment it arrives, so a run cut short by the device call's limit still names what failed."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n[FAILED] {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n", flush=True)
