"""JupyterLab for real: the notebooks open, run and save in a live JupyterLab server.

Starts ``jupyter lab`` from this environment on a free 127.0.0.1 port with a
random token and the repository as its root (as ``make lab`` does: data/, figures/
and the package can be browsed), then through the REST API checks
that the repository's notebooks and the project kernel ``dora-num`` (installed
into the venv by ``make venv``: ``ipykernel install --sys-prefix --name dora-num``)
are listed, starts a ``dora-num`` kernel, runs ``import dora_num`` over the
kernel's websocket (Jupyter messaging protocol, JSON frames), checks the output,
and shuts kernel and server down.  Every wait is bounded; the server process is
terminated (by its pid) whatever happens.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest

# websocket-client: the test extra (and a dependency of jupyter_server)
websocket = pytest.importorskip("websocket", reason="websocket-client not installed (notebook tooling, absent on the GPU image)")

import dora_num
from dora_num.repro.paths import NOTEBOOKS_DIR, REPO_ROOT

from . import lab

KERNEL_NAME = "dora-num"
START_TIMEOUT_S = 90  # server start on a loaded 2-core CI machine
KERNEL_TIMEOUT_S = 90  # kernel start + `import dora_num` (imports torch)


class _Api:
    def __init__(self, port: int, token: str):
        self.base = f"http://127.0.0.1:{port}"
        self.token = token

    def request(self, method: str, path: str, body=None, timeout: float = 10.0):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", f"token {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw else None)


def _execute_request(code: str, session: str) -> dict:
    return {
        "header": {"msg_id": uuid.uuid4().hex, "username": "pytest", "session": session,
                   "msg_type": "execute_request", "version": "5.3",
                   "date": datetime.now(timezone.utc).isoformat()},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True},
    }


def _run_on_kernel(url: str, code: str, timeout: float) -> tuple[str, dict]:
    """Send ``code`` to the kernel's websocket; return (stdout, execute_reply content)."""
    deadline = time.monotonic() + timeout
    ws = websocket.create_connection(url, timeout=timeout)
    try:
        msg = _execute_request(code, uuid.uuid4().hex)
        ws.send(json.dumps(msg))
        out, reply, idle = [], None, False
        while reply is None or not idle:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no execute_reply/idle within {timeout} s; stdout so far: {''.join(out)!r}")
            ws.settimeout(left)
            frame = json.loads(ws.recv())
            if frame.get("parent_header", {}).get("msg_id") != msg["header"]["msg_id"]:
                continue
            kind = frame["msg_type"]
            if kind == "stream" and frame["content"]["name"] == "stdout":
                out.append(frame["content"]["text"])
            elif kind == "error":
                raise AssertionError("kernel error: " + "\n".join(frame["content"]["traceback"]))
            elif kind == "execute_reply":
                reply = frame["content"]
            elif kind == "status" and frame["content"]["execution_state"] == "idle":
                idle = True
        return "".join(out), reply
    finally:
        ws.close()


def test_jupyter_lab_lists_notebooks_and_runs_project_kernel(tmp_path):
    if not lab.jupyter().exists():
        pytest.fail(f"{lab.jupyter()} missing: JupyterLab is a project dependency (make venv)")
    port, token = lab.free_port(), secrets.token_hex(16)
    log = open(tmp_path / "server.log", "w+b")
    proc = subprocess.Popen(lab.lab_command(port, token, REPO_ROOT), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=lab.lab_env(tmp_path), cwd=tmp_path)
    api = _Api(port, token)
    kernel_id = None
    try:
        # 1. wait for the server
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{log.read().decode(errors='replace')}")
            try:
                if api.request("GET", "/api/status", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter lab did not answer on 127.0.0.1:{port} within {START_TIMEOUT_S} s")
            time.sleep(0.5)

        # the token is enforced (so the checks below go through authentication)
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(api.base + "/api/contents", timeout=10)
        assert denied.value.code == 403

        # JupyterLab itself is served, not only the bare server
        status, _ = api.request("GET", "/lab/api/settings", timeout=30)
        assert status == 200

        # 2. the repository root is browsable, and the notebooks directory's notebooks are listed
        _, top = api.request("GET", "/api/contents")
        assert {"data", "figures", "dora_num", "notebooks"} <= {i["name"] for i in top["content"]}
        on_disk = sorted(p.name for p in NOTEBOOKS_DIR.glob("*.ipynb"))
        assert on_disk, f"no notebooks in {NOTEBOOKS_DIR}"
        _, listing = api.request("GET", "/api/contents/notebooks")
        listed = sorted(item["name"] for item in listing["content"] if item["type"] == "notebook")
        assert listed == on_disk
        _, nb = api.request("GET", f"/api/contents/notebooks/{on_disk[0]}", timeout=30)
        assert nb["type"] == "notebook" and nb["content"]["cells"], on_disk[0]
        assert nb["content"]["metadata"]["kernelspec"]["name"] == KERNEL_NAME

        # 3. the project kernel is listed, and is this environment's python
        _, specs = api.request("GET", "/api/kernelspecs")
        assert KERNEL_NAME in specs["kernelspecs"], (
            f"kernel {KERNEL_NAME!r} not installed (make venv runs `python -m ipykernel install --sys-prefix "
            f"--name {KERNEL_NAME}`); listed: {sorted(specs['kernelspecs'])}")
        argv = specs["kernelspecs"][KERNEL_NAME]["spec"]["argv"]
        assert Path(argv[0]).parent.absolute() == Path(sys.executable).parent.absolute(), argv

        # 4. start a kernel and run a cell over the websocket
        status, kernel = api.request("POST", "/api/kernels", {"name": KERNEL_NAME}, timeout=KERNEL_TIMEOUT_S)
        assert status == 201 and kernel["name"] == KERNEL_NAME
        kernel_id = kernel["id"]
        url = f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels?token={token}"
        code = "import dora_num\nprint(dora_num.__version__)\nprint(dora_num.__file__)"
        out, reply = _run_on_kernel(url, code, KERNEL_TIMEOUT_S)
        assert reply["status"] == "ok", reply
        version, path = out.strip().splitlines()
        assert version == dora_num.__version__
        assert Path(path).resolve().is_relative_to(REPO_ROOT)  # this checkout's package, not another copy

        # 5. shut the kernel down through the API
        status, _ = api.request("DELETE", f"/api/kernels/{kernel_id}", timeout=30)
        assert status == 204
        kernel_id = None
        _, kernels = api.request("GET", "/api/kernels")
        assert kernels == []
    finally:
        if kernel_id is not None:
            try:
                api.request("DELETE", f"/api/kernels/{kernel_id}", timeout=10)
            except Exception:  # the server may already be gone; it is terminated below
                pass
        if proc.poll() is None:
            try:
                api.request("POST", "/api/shutdown", timeout=10)
            except Exception:
                pass
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                lab.stop(proc, wait_s=10)
        log.close()
    assert proc.returncode is not None


def test_make_lab_command():
    """``make lab``: the repository root, no browser, --allow-root as root, LAB_ARGS passed on."""
    out = subprocess.run(["make", "-n", "lab", "LAB_ARGS=--port=8899 --ip=0.0.0.0", f"STAMP={__file__}"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60).stdout
    cmd = next(line for line in out.splitlines() if "jupyter lab" in line)
    assert "--no-browser" in cmd and "--ServerApp.root_dir=." in cmd and "--port=8899 --ip=0.0.0.0" in cmd
    assert ("--allow-root" in cmd) == (os.geteuid() == 0)
