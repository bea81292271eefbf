"""Test configuration.

Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must
be set before any module holding ``@triton.jit`` is imported (docs/platform.md), so
it is set here, at collection start.  ``gpu``-marked tests skip visibly without CUDA;
``interpreter``-marked cases (Triton kernels on CPU tensors) skip visibly where the
interpreter is off, i.e. on a CUDA machine, whose gpu-marked cases test the same kernels
on CUDA.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200: pytest -m gpu)")
    skip_cpu_triton = pytest.mark.skip(reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 (set here "
                                              "only without CUDA; the gpu-marked cases test these kernels on CUDA)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRETED:
            item.add_marker(skip_cpu_triton)


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


class Regimes:
    """Test inputs by named regime, drawn by :mod:`dora_num.studies.inputs` (the one source
    of the project's seeded random / realistic / adversarial inputs; docs/contract.md).

    ``compose(regime, n, fmt, seed)``: ``base``, ``lora`` (values of ``fmt``), ``g`` (fp32),
    ``s``; ``torch=True`` gives ``(base, lora, g)`` as tensors (``fmt``'s dtype, fp32 ``g``).
    ``assembly(regime, n, fmt, seed)``: fp32 ``base_sq``, ``cross``, ``ba``, ``s``.
    ``dg(T, N, dtype, seed, base_scale=...)``: ``(lora, base, grad)`` torch ``[T, N]``."""

    def compose(self, regime: str, n: int, fmt="fp32", seed: int = 0, *, torch: bool = False):
        from dora_num.numerics.formats import get_format
        from dora_num.studies import inputs

        d = inputs.compose(fmt, regime, n, seed)
        if not torch:
            return d
        import torch as t

        dt = get_format(fmt).torch_dtype
        return (t.from_numpy(d["base"]).to(dt), t.from_numpy(d["lora"]).to(dt), t.from_numpy(d["g"]).float())

    def assembly(self, regime: str, n: int, fmt="fp32", seed: int = 0) -> dict:
        from dora_num.studies import inputs

        return inputs.assembly(fmt, regime, n, seed)

    def dg(self, T: int, N: int, dtype: str, seed: int, **kw):
        from dora_num.studies import inputs

        return inputs.dg_operands(T, N, dtype, seed=seed, **kw)


@pytest.fixture(scope="session")
def regimes() -> Regimes:
    """The input fixture of every test that needs generated inputs (:class:`Regimes`)."""
    return Regimes()


@pytest.fixture(autouse=True)
def _no_deferred_flag_leaks():
    """A deferred finiteness flag (CUDA) left unread by a test would be raised in the next one: read
    them at teardown, and fail the test that left a set one (naming it), so errors stay attributed."""
    yield
    from dora_num.ops import finite

    if finite.pending_count():
        try:
            finite.check_pending()
        except ValueError as e:
            pytest.fail(f"this test left a deferred non-finite flag unread: {e}")
