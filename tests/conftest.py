"""Test configuration.

Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must
be set before any module holding ``@triton.jit`` is imported (docs/platform.md), so
it is set here, at collection start.  ``gpu``-marked tests skip visibly without CUDA;
``interpreter``-marked cases (Triton kernels on CPU tensors) skip visibly where the
interpreter is off, i.e. on a CUDA machine, whose gpu-marked cases test the same kernels
on CUDA.
"""

import math
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

    @staticmethod
    def full_significands(r: int, d: int, generator: torch.Generator) -> torch.Tensor:
        """Kaiming-uniform fp32 ``[r, d]`` with all 24 significand bits random, as trained adapters
        have (drawn in fp64, rounded once: ``torch.rand``'s fp32 values are multiples of ``2^-24``, so
        ``(rand * 2 - 1) / sqrt(d)`` has at most 23 bits, on which two fp16 pieces are exact)."""
        return ((torch.rand(r, d, device=generator.device, generator=generator, dtype=torch.float64) * 2 - 1)
                / math.sqrt(d)).float()


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


class SmallLayer:
    """The shared factory of small layers (the ``small_layer`` fixture).

    ``small_layer(d_in=40, d_out=24, rank=4, alpha=8.0, ...)``: a seeded ``DoRALinear`` on
    ``nn.Linear(d_in, d_out)`` (initialised in fp32, then cast to ``dtype``) with ``B ~ N(0, b_std)``
    and ``m`` moved off its init (times ``m_scale``, or ``1 + m_noise * N(0, 1)`` per row), so that
    ``g != 1``; ``adapter_dtype`` keeps A, B (and an fp32 m) in another dtype, as PEFT does; other
    keywords go to ``DoRALinear``.  ``small_layer.factors(...)``: the tensors ``W, A, B, m, x`` of a
    hand-made layer whose row 3 has an update that cancels half of its base row."""

    def __call__(self, d_in=40, d_out=24, rank=4, alpha=8.0, *, dtype=torch.float32, adapter_dtype=None,
                 bias=False, seed=3, b_std=0.1, m_scale=1.001, m_noise=None, device="cpu", **layer_kw):
        import dora_num as dn

        torch.manual_seed(seed)
        lin = torch.nn.Linear(d_in, d_out, bias=bias).to(dtype=dtype, device=device)
        layer = dn.DoRALinear(lin, rank=rank, alpha=alpha, **layer_kw)
        if adapter_dtype is not None:
            layer.lora_A = torch.nn.Parameter(layer.lora_A.detach().to(adapter_dtype))
            layer.lora_B = torch.nn.Parameter(layer.lora_B.detach().to(adapter_dtype))
            layer.magnitude = torch.nn.Parameter(layer.magnitude.detach().float())
        with torch.no_grad():
            layer.lora_B.normal_(0, b_std)
            if m_noise is not None:
                layer.magnitude.mul_(1 + m_noise * torch.randn(d_out, device=layer.magnitude.device))
            elif m_scale != 1:
                layer.magnitude.mul_(m_scale)
        return layer

    @staticmethod
    def factors(d_out=24, d_in=40, r=4, tokens=6, dtype=torch.float32, seed=0) -> dict:
        g = torch.Generator().manual_seed(seed)
        W = torch.randn(d_out, d_in, generator=g)
        A = torch.randn(r, d_in, generator=g) / d_in**0.5
        B = torch.randn(d_out, r, generator=g) * 0.05
        W[3] = -0.5 * (B[3] @ A)  # a row where the update cancels half of the base row
        m = torch.linalg.vector_norm(W, dim=1) * (1 + 1e-3 * torch.randn(d_out, generator=g))
        x = torch.randn(tokens, d_in, generator=g)
        return {k: v.to(dtype) for k, v in dict(W=W, A=A, B=B, m=m, x=x).items()}


@pytest.fixture
def small_layer() -> SmallLayer:
    return SmallLayer()
