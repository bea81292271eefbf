"""CPU-independent artifacts: the pinned kernel choice, and what the provenance records of the CPU.

Which CPU kernels torch runs depends on the host: ATen's vectorised kernels
dispatch on the instruction set (``ATEN_CPU_CAPABILITY``: default / avx2 / avx512),
MKL picks its GEMM code path by CPU vendor and ISA, oneDNN (bf16 matmul) likewise,
and the split of a parallel reduction depends on the thread count.  Each changes
the order of floating-point additions, hence the last bits of an fp32 MiniLM
forward or training step.  MKL's conditional numerical reproducibility holds a
branch fixed across CPUs only for ``AUTO`` and ``COMPATIBLE`` on non-Intel
processors: on an AMD CPU ``MKL_CBWR=AVX2`` silently falls back to ``AUTO`` (MKL's
developer guide, "Specifying code branches"), which is why the artifacts recorded on
an AMD EPYC under ``MKL_CBWR=AVX2`` drifted on an Intel Xeon (24 of 98 artifacts:
every one downstream of an fp32 GEMM).  ``MKL_CBWR=COMPATIBLE`` (SSE2 without the
approximate ``rcpps``/``rsqrtps``) is the one branch both vendors run; it costs
about 1.7x in MKL's fp32 GEMM (MiniLM forward on 16 texts: 1.2 s vs 0.7 s, 2 cores).
Measured on an Intel Xeon under the pins: fp32 MiniLM hidden states identical with
``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL as on an AVX2-only CPU) and under ATen avx2 /
avx512; different under ATen ``default`` and under every other ``MKL_CBWR`` branch.

What each platform does: docs/platform.md, repro/determinism.py.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

PINNED_ENV: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's vectorised kernels at AVX2 width, AVX-512 hosts included
    "MKL_CBWR": "COMPATIBLE",  # MKL's one reproducible branch on Intel and AMD alike (AVX2 is Intel-only)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (bf16/fp16 matmul on CPU): no AVX-512 / AMX kernels
    # numpy's AVX-512 kernels (float64 log/exp/... among them) round differently from its AVX2
    # ones: matplotlib's log-scale transforms moved a PDF coordinate in its 6th decimal.
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
    "OMP_NUM_THREADS": "2",  # parallel reductions split by thread count
    "MKL_NUM_THREADS": "2",
}
NATIVE_ENV = "DORA_NUM_NATIVE_KERNELS"


def pinned_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables to set for a reproducible run (empty when ``DORA_NUM_NATIVE_KERNELS=1``)."""
    environ = os.environ if environ is None else environ
    return {} if environ.get(NATIVE_ENV) == "1" else dict(PINNED_ENV)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _blas() -> list[dict]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keep = ("internal_api", "version", "architecture", "num_threads", "threading_layer")
    return [{k: i.get(k) for k in keep if i.get(k) is not None} | {"library": Path(i["filepath"]).name}
            for i in threadpool_info()]


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """What decides the CPU kernels: model, torch's capability and BLAS, numpy's BLAS, the pinned variables."""
    info: dict = {"model": _cpu_model(), "machine": platform.machine(), "cores": os.cpu_count()}
    try:
        import torch

        info["torch_capability"] = torch.backends.cpu.get_cpu_capability()
        info["torch_threads"] = torch.get_num_threads()
        cfg = torch.__config__.show()
        info["torch_blas"] = next((s.strip() for s in cfg.split(",") if "BLAS_INFO" in s), None)
        info["torch_math_libs"] = [ln.strip(" -") for ln in cfg.splitlines() if "Math Kernel" in ln or "DNN" in ln]
    except Exception as e:  # noqa: BLE001 - provenance must never break a write
        info["torch_error"] = repr(e)
    info["blas"] = _blas()
    info["env"] = {k: os.environ.get(k) for k in (*PINNED_ENV, "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE",
                                                  NATIVE_ENV) if os.environ.get(k)}
    return info


@functools.lru_cache(maxsize=1)
def lock_hash() -> str | None:
    """sha256 of the committed lock file (``requirements.lock``), or ``None`` without one."""
    from .paths import REPO_ROOT

    p = REPO_ROOT / "requirements.lock"
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
