"""What the two JupyterLab tests share: a free loopback port, the ``make lab`` server command
on it (random token, no browser, ``--allow-root`` as root, read-only extension manager), an
environment isolated from the user's Jupyter config, and stopping the server whatever happens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jupyter() -> Path:
    """This environment's ``jupyter`` (JupyterLab is a project dependency)."""
    return Path(sys.executable).parent / "jupyter"


def lab_command(port: int, token: str, root: Path) -> list[str]:
    """``jupyter lab`` as ``make lab`` starts it, on ``127.0.0.1:port`` with ``token``, rooted at ``root``."""
    cmd = [str(jupyter()), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.extension_manager=readonly"]  # no PyPI look-ups from the extension manager
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI runs as root
        cmd.append("--allow-root")
    return cmd


def lab_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """``os.environ`` isolated from the user's Jupyter config/runtime/data (kernelspecs still
    come from ``sys.prefix``), plus ``extra``."""
    return {**os.environ, **extra, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
            "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
            "JUPYTER_PLATFORM_DIRS": "1"}


def stop(proc: subprocess.Popen, wait_s: float = 20) -> None:
    """Terminate ``proc`` if it still runs; kill it after ``wait_s`` seconds (then wait 10 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
