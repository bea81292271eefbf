"""Test configuration.

Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must
be set before any module holding ``@triton.jit`` is imported (PLATFORM.md), so
it is set here, at collection start.  ``gpu``-marked tests skip visibly.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Reset torch's RNG, default dtype and mpmath's precision after each test."""
    import mpmath

    dps = mpmath.mp.dps
    dtype = torch.get_default_dtype()
    state = torch.random.get_rng_state()
    yield
    mpmath.mp.dps = dps
    torch.set_default_dtype(dtype)
    torch.random.set_rng_state(state)
