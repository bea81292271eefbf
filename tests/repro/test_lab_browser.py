"""JupyterLab in a real browser: notebook 00 opened, run through the UI, a figure rendered.

Setup installs Debian's ``chromium`` and ``chromium-driver`` with apt-get when they are
missing (CI runs as root); the test skips, naming the reason, only if that fails.
``jupyter lab`` starts as ``make lab`` starts it (``--no-browser``, ``--allow-root`` as
root) on a free loopback port with a random token, at the root of a temporary copy of
the repository layout (``notebooks/00_overview.ipynb`` copied, so JupyterLab's autosave
cannot write outputs into the committed notebook); the kernel's artifacts go to a
temporary folder (``DORA_NUM_OUTPUT_ROOT``).  Headless Chromium (selenium, the Debian
driver: nothing is downloaded) opens the notebook, checks it started on the project
kernel without asking, clicks Run > Run All Cells, waits for the last cell's success
line, and checks that a figure output is an image that decoded (``naturalWidth > 0``).
Every wait is bounded; server, driver and browser are stopped whatever happens.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from dora_num.repro.paths import NOTEBOOKS_DIR

from . import lab

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
NOTEBOOK = "00_overview.ipynb"
DONE_TEXT = "factored == dense within the a-priori bounds"  # printed by notebook 00's last cell
RUN_TIMEOUT_S = 300  # notebook 00 in full: ~30 s alone on 2 cores, several times that on a loaded CI machine
# Chromium as root in a container, on a machine with no outside network (its background
# connections are refused, many at a time, without these flags).
CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1400,1000")


def _install_browser() -> str | None:
    """``None`` when chromium + chromedriver are there (installing them if need be), else why not."""
    if Path(CHROMIUM).exists() and Path(DRIVER).exists():
        return None
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "chromium/chromium-driver missing and apt-get unavailable or not root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"{' '.join(cmd)} timed out"
        if proc.returncode != 0:
            return f"{' '.join(cmd)} failed: {proc.stderr.strip()[-300:]}"
    return None if Path(CHROMIUM).exists() and Path(DRIVER).exists() else "apt-get installed no chromium binary"


@pytest.fixture(scope="module")
def browser_ready():
    why = _install_browser()
    if why:
        pytest.skip(f"no headless browser: {why}")
    try:
        import selenium  # noqa: F401 - a declared test dependency
    except ImportError as e:
        pytest.fail(f"selenium missing (a test dependency in pyproject.toml): {e}")


def _wait_http(url: str, proc, deadline: float, log: Path) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"jupyter lab did not answer at {url}")


@pytest.mark.slow
def test_notebook_00_runs_in_jupyterlab_and_renders_a_figure(browser_ready, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    shutil.copy(NOTEBOOKS_DIR / NOTEBOOK, root / "notebooks" / NOTEBOOK)
    port, token = lab.free_port(), secrets.token_hex(16)
    env = lab.lab_env(tmp_path, DORA_NUM_OUTPUT_ROOT=str(tmp_path / "artifacts"))
    cmd = lab.lab_command(port, token, root)
    log = tmp_path / "server.log"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=root)
    driver = None
    try:
        _wait_http(f"http://127.0.0.1:{port}/api/status?token={token}", proc, time.monotonic() + 120, log)
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for flag in (*CHROME_FLAGS, f"--user-data-dir={tmp_path / 'chrome-profile'}"):
            opts.add_argument(flag)
        driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
        driver.set_page_load_timeout(120)
        driver.get(f"http://127.0.0.1:{port}/lab/tree/notebooks/{NOTEBOOK}?token={token}")
        wait = WebDriverWait(driver, 180)
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell")))
        # the notebook's own kernelspec (dora-num) starts without a kernel-selection dialog
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Toolbar-kernelName").text
                   == "Python (dora-num)")
        assert not driver.find_elements(By.CSS_SELECTOR, ".jp-Dialog"), "JupyterLab asked for a kernel"
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-Notebook-ExecutionIndicator[data-status='idle']"))
        # Run > Run All Cells, through the menu
        run_menu = next(e for e in driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-itemLabel") if e.text == "Run")
        run_menu.click()
        wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, "li[data-command='runmenu:run-all']"))).click()
        def prompts(d):
            return [e.text for e in d.find_elements(By.CSS_SELECTOR, ".jp-CodeCell .jp-InputPrompt")]

        wait.until(lambda d: "[*]:" in prompts(d))  # the cells are queued
        WebDriverWait(driver, RUN_TIMEOUT_S, poll_frequency=1).until(lambda d: "[*]:" not in prompts(d))
        driver.save_screenshot(str(tmp_path / "lab.png"))
        outputs = driver.find_elements(By.CSS_SELECTOR, ".jp-CodeCell")[-1].find_elements(By.CSS_SELECTOR,
                                                                                             ".jp-OutputArea")
        last = outputs[0].text if outputs else ""
        assert DONE_TEXT in last, (f"notebook 00 did not finish in the UI; prompts {prompts(driver)}; last output:\n"
                                   f"{last[-2000:]}")
        images = driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output.jp-RenderedImage img")
        assert images, "no figure output rendered"
        widths = [driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth", im) for im in images]
        assert all(w and w > 100 for w in widths), widths
        # the run wrote its artifacts to the temporary folder, not to the repository
        assert (tmp_path / "artifacts" / "figures" / "00_overview" / "norm_errors.png").is_file()
        print(f"notebook 00 through the JupyterLab UI: {len(images)} figures, {time.monotonic() - t0:.0f} s")
    finally:
        if driver is not None:
            driver.quit()
        lab.stop(proc)
