"""Benchmark helpers for the GPU suite: timing, copy bandwidth, traffic models, peak memory, logging.

Timing is ``triton.testing.do_bench`` (CUDA events, L2 flushed between
repetitions), reported as the median with p20/p80.  Bandwidth figures are
*useful* bytes from a stated traffic model (each input read once, each output
written once) over the median time, and a percentage of the device-to-device
copy bandwidth measured in the same process (bytes read + bytes written).
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from triton.testing import do_bench

QUANTILES = (0.5, 0.2, 0.8)


@dataclass
class Timing:
    ms: float
    p20: float
    p80: float

    def as_dict(self, prefix: str = "") -> dict:
        return {f"{prefix}ms": self.ms, f"{prefix}ms_p20": self.p20, f"{prefix}ms_p80": self.p80}


def time_ms(fn, *, warmup: int = 25, rep: int = 100) -> Timing:
    """Median (p20, p80) milliseconds of ``fn()`` by ``triton.testing.do_bench``."""
    med, p20, p80 = do_bench(fn, warmup=warmup, rep=rep, quantiles=list(QUANTILES))
    return Timing(float(med), float(p20), float(p80))


def lift_recompile_limits() -> None:
    """Let dynamo compile the same code for every variant a benchmark builds (each variant's modules
    are new guards on one code object; at the default limit of 8 it silently falls back to eager).
    For benchmark processes only (the setting is global and stays: every later compile there is one
    more variant)."""
    torch._dynamo.config.cache_size_limit = 4096
    for name, value in (("recompile_limit", 4096), ("accumulated_recompile_limit", 1 << 16)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)


def copy_bandwidth(nbytes: int = 2 * 2**30, device: str = "cuda", timer=time_ms) -> dict:
    """Device-to-device copy of ``nbytes`` (read, and as many written): GB/s counting bytes read +
    bytes written, timed by ``timer`` (:func:`time_ms`'s signature)."""
    src = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    moved = 2 * src.numel() * 4
    del src, dst
    return {"bytes": moved, **t.as_dict(), "gbps": moved / (t.ms * 1e-3) / 1e9}


def compose_bytes(kind: str, n_elems: int, itemsize: int, n_cols: int, *, n_rows: int | None = None,
                  bwd_block_m: int = 32) -> int:
    """Useful bytes of a compose kernel (traffic model).

    - ``fwd`` (inference): read base, lora; write out: ``3 b`` per element.
    - ``fwd_inner`` (training forward): also writes fp32 inner: ``3 b + 4``.
    - ``bwd``: read D (b) and inner (4); write dlora, dbase (2 b): ``3 b + 4``,
      plus the dg partials (write + read, ``2 * 4 * nb * N``) and dg.
    - ``bwd_recompute``: read D, base, lora (3 b); write dlora, dbase (2 b): ``5 b``
      (inner recomputed in registers), plus the partials.
    - ``train``: the least two-pass traffic, ``fwd + bwd_recompute`` (8 b); used
      for every implementation's training rows (useful bytes).
    - ``train_inner``: ``fwd_inner + bwd``.
    ``g`` (4 N bytes) is counted once per kernel.
    """
    b = itemsize
    if kind == "fwd":
        return 3 * b * n_elems + 4 * n_cols
    if kind == "fwd_inner":
        return (3 * b + 4) * n_elems + 4 * n_cols
    if kind == "bwd":
        rows = n_rows if n_rows is not None else n_elems // max(n_cols, 1)
        nb = -(-rows // bwd_block_m)
        return (3 * b + 4) * n_elems + 4 * n_cols + 2 * 4 * nb * n_cols + 4 * n_cols
    if kind == "bwd_recompute":
        rows = n_rows if n_rows is not None else n_elems // max(n_cols, 1)
        nb = -(-rows // bwd_block_m)
        return 5 * b * n_elems + 4 * n_cols + 2 * 4 * nb * n_cols + 4 * n_cols
    if kind == "train":
        return compose_bytes("fwd", n_elems, b, n_cols) + compose_bytes(
            "bwd_recompute", n_elems, b, n_cols, n_rows=n_rows, bwd_block_m=bwd_block_m)
    if kind == "train_inner":
        return compose_bytes("fwd_inner", n_elems, b, n_cols) + compose_bytes(
            "bwd", n_elems, b, n_cols, n_rows=n_rows, bwd_block_m=bwd_block_m)
    raise ValueError(f"unknown traffic kind {kind!r}")


def row_sumsq_bytes(d_out: int, d_in: int, itemsize: int) -> int:
    """Useful bytes of the row-sum kernel (:mod:`dora_num.ops.kernels.row_sumsq`): W read once, the fp32
    sums and the int8 zero-row mask written."""
    return d_out * d_in * itemsize + 5 * d_out


def norm_tail_bytes(d_out: int, r: int, b_itemsize: int, *, m_itemsize: int = 4, block_m: int = 32) -> int:
    """Useful bytes of the norm's tail kernel (:mod:`dora_num.ops.kernels.norm_tail`) with ``m``, the
    guard and the zero rows, as the layer launches it: ``U`` (fp32) and ``B`` read once, ``G`` once
    (every program reads it again, from L2), ``base_sq``, ``m`` and the zero rows read; ``wnorm``,
    ``den``, the guard's three rows (``aux``) and one flag per program written."""
    return d_out * r * (4 + b_itemsize) + 4 * r * r + d_out * (4 + m_itemsize + 1) + d_out * (4 + 4 + 12) \
        + 4 * -(-d_out // block_m)


def peak_extra_bytes(fn) -> tuple[int, object]:
    """Peak allocator bytes above what was allocated when ``fn`` started (and its result)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return int(peak), res


def max_rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|x - ref| / max|ref|`` in fp64 (0 for empty)."""
    if x.numel() == 0:
        return 0.0
    d = (x.double() - ref.double()).abs().max()
    return float(d / ref.double().abs().max().clamp_min(1e-300))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaN payloads included; +0 and -0 differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))


def bitwise_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of elements with identical bit patterns."""
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return float((a.contiguous().view(view) == b.contiguous().view(view)).double().mean())


def ulp_histogram(a: torch.Tensor, b: torch.Tensor, max_ulp: int = 4) -> dict[str, int]:
    """Counts of ``|ulp distance|`` 0..max_ulp and ``>max_ulp`` (same-sign finite fp32/fp16/bf16)."""
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    ia = a.contiguous().view(view).long()
    ib = b.contiguous().view(view).long()
    sign = torch.iinfo(view).min  # the sign bit as a signed integer
    # map to a monotone integer line: negative floats become -(magnitude)
    ia = torch.where(ia < 0, sign - ia, ia)
    ib = torch.where(ib < 0, sign - ib, ib)
    d = (ia - ib).abs()
    out = {str(k): int((d == k).sum()) for k in range(max_ulp + 1)}
    out[f">{max_ulp}"] = int((d > max_ulp).sum())
    return out


@contextlib.contextmanager
def host_path(norm_tail: str, fold: bool | None = None):
    """Within: the norm's tail (``OpConfig.norm_tail``: ``"auto"`` / ``"torch"``) and, if
    given, the layer's output-add fold (``OpConfig.fold_output_add``) set as asked, for
    this thread (:func:`dora_num.ops.config.override`); the same-run A/B switches of the
    layer's host path (GPU suite, host probe)."""
    from ..ops.config import override

    changes = {"norm_tail": norm_tail} if fold is None else {"norm_tail": norm_tail, "fold_output_add": fold}
    with override(**changes):
        yield


def log(msg: str) -> None:
    """A progress line of the GPU suite (flushed: the device tool shows the output's tail)."""
    print(f"[gpu-suite {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_csv(rows: list[dict], path: Path) -> None:
    """The rows of a suite section as a CSV in the recorder's output folder, written atomically (the
    whole table rendered first, then renamed into place: a section that fails while writing leaves
    the file it had, never a part of one)."""
    from ..repro.provenance import _atomic_write_bytes, _compressed

    text = pd.DataFrame(rows).to_csv(index=False, lineterminator="\n")
    _atomic_write_bytes(Path(path), _compressed(text.encode(), Path(path).name))  # .xz by the declared name
    log(f"wrote {Path(path).name} ({len(rows)} rows)")


def device_name(device) -> str:
    """The name of the device a measurement ran on: the GPU's, or ``"cpu"``."""
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type


def gpu_description(git_sha: str | None) -> dict:
    """A GPU recording's ``device.json`` (:func:`dora_num.repro.recording.describe_machine`) with the
    Triton runtime, where ``dg``'s second stage runs (it changes what the compose rows time) and the
    operator configuration every section ran under (``op_config``: :attr:`OpConfig.key
    <dora_num.ops.config.OpConfig.key>`, its tiles included; :meth:`OpConfig.from_key
    <dora_num.ops.config.OpConfig.from_key>` rebuilds it)."""
    import triton

    from ..ops.config import get_config
    from ..repro.recording import describe_machine

    cfg = get_config()
    return describe_machine(git_sha, triton_runtime=triton.__version__, dg_final_in_kernel=cfg.dg_stage2_in_kernel,
                            op_config=cfg.key)
