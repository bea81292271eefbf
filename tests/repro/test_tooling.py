"""The notebook tests skip where notebook tooling is absent (the GPU image: no nbformat, papermill or
websocket-client there), so that ``pytest -m gpu`` collects cleanly.  On the CPU CI, whose venv holds
every dependency of pyproject.toml and its test extra, such a skip would hide those tests: this test
fails there instead."""

import importlib.util

import pytest
import torch

NOTEBOOK_TOOLING = ("nbformat", "papermill", "websocket")  # websocket-client: the test extra


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU image is documented to lack notebook tooling")
def test_cpu_ci_has_the_notebook_tooling():
    missing = [m for m in NOTEBOOK_TOOLING if importlib.util.find_spec(m) is None]
    assert not missing, f"notebook tests would skip: {missing} not installed (make venv installs them)"
