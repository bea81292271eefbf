"""The factored norm of a :class:`~dora_num.ops.layer.DoRALinear` replayed as a CUDA graph.

Why.  On CUDA the norm is about twenty eager calls (the split of A into 16-bit pieces, two tensor-core
products, their piece sums, the tail kernel and its buffers), and on the H200 host each call costs
5-80 us: about 0.85 ms of host time per training step and layer, while its GPU work is 0.1-0.3 ms.
A decoder with 28 such layers is then bound by the host (``data/gpu/layer_host.log``).  The
sequence is the same on every call with the same tensors (W frozen; A, B, m updated in place by
the optimizer): captured once as a CUDA graph it replays in one launch, reading the current values
of W, A, B and m.

What is graphed: :func:`~dora_num.ops.norm._factored_core` with the tail kernel (products, guard
and its float64 recompute, the denominator and the flag: no host decision depends on a value).
The replay's outputs are copied out of the graph at once (``den``, ``flag``, the guard's ``aux``),
so nothing outside holds the graph's memory: every graph of a device shares one memory pool, whose
size is about the largest single capture's intermediates (:func:`pool_bytes`; with fp32 adapters
``d_out * 3r * 8 + 3r * d_in * 2`` bytes and the Gram blocks, 0.1 GB at 4096->14336, r=384).

When (:func:`run`): a layer's call with the same key (data pointers, shapes, dtypes and strides of
W, A, B, m, the cached ``rowsum(W*W)`` and zero-row mask, the scale, the configuration, the current
device and stream, torch's TF32 switches) as its previous call is replayed; the first call with a
new key runs eagerly (it warms cuBLAS, Triton and the constant caches) and the second captures.
A layer whose key changed :data:`MAX_CAPTURES` times (parameters re-allocated every step, as
FSDP's unsharding does) runs eagerly from then on.  Not graphed: under ``torch.compile``, while
the caller itself captures a graph, ``OpConfig.norm_graph=False``, the torch tail, the CPU.  A
capture that fails is reported once (a warning) and the layer runs eagerly.  The replay is bitwise
the eager computation (same kernels on the same inputs; ``tests/ops/test_norm_graph.py`` on CUDA).
Replays of one device's graphs must not run concurrently on two streams (the stream is part of
the key, so a call on another stream captures its own graph, in the same pool; two such calls in
flight at once would share scratch memory): the layers of one model run on one stream.
"""

from __future__ import annotations

import collections
import warnings
import weakref

import torch

MAX_CAPTURES = 4

_STATE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # owner -> _State (not in its __dict__:
# a CUDA graph cannot be copied or pickled with the module)
_POOLS: dict = {}  # device index -> (the shared graph memory pool's handle, the graph that keeps it alive)
_POOL_BYTES: collections.Counter = collections.Counter()  # device index -> bytes reserved by captures


class _State:
    __slots__ = ("key", "seen", "graph", "out", "captures", "off")

    def __init__(self):
        self.key = self.seen = self.graph = self.out = None
        self.captures = 0
        self.off = False


def pool_bytes(device: int | torch.device | None = None) -> int:
    """Bytes the captures of ``device`` (default: every device) added to the allocator's reserved
    memory (the shared pool: not counted by ``torch.cuda.max_memory_allocated`` after the capture)."""
    if device is None:
        return sum(_POOL_BYTES.values())
    index = device.index if isinstance(device, torch.device) else device
    return _POOL_BYTES[index if index is not None else torch.cuda.current_device()]


def tensor_key(t: torch.Tensor | None) -> tuple:
    """What a captured graph depends on of ``t``: its storage address and layout (not its values)."""
    return (None,) if t is None else (t.data_ptr(), tuple(t.shape), t.dtype, tuple(t.stride()))


def run(owner, key: tuple, compute):
    """The outputs of ``compute()`` (a tuple of tensors or None) for ``owner`` (the layer), from a
    replay of its graph for ``key``, copied out; or None: the caller runs ``compute()`` eagerly
    (module docstring for when)."""
    st = _STATE.get(owner)
    if st is None:
        st = _STATE[owner] = _State()
    if st.off:
        return None
    key = key + (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream,
                 torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    if st.graph is None or st.key != key:
        if st.seen != key:  # first sight: eager (warms every cache the capture must find warm)
            st.seen = key
            return None
        st.graph = st.out = None  # the previous graph's memory goes back to the pool
        if st.captures >= MAX_CAPTURES:
            st.off = True
            return None
        st.captures += 1
        if not _capture(st, key, compute):
            return None
    st.graph.replay()
    return tuple(t.clone() if t is not None else None for t in st.out)


def _pool(device: int):
    """The device's shared pool, kept alive by a one-op graph of its own: a pool whose last graph is
    freed (a layer's graph replaced after its key changed) is released by the allocator, and a
    capture into a released pool's id fails an internal assertion of torch's caching allocator."""
    entry = _POOLS.get(device)
    if entry is None:
        handle = torch.cuda.graph_pool_handle()
        keeper = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            keeper.capture_begin(pool=handle, capture_error_mode="thread_local")
            torch.zeros(1, device="cuda").add_(1)
            keeper.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        entry = _POOLS[device] = (handle, keeper)
    return entry[0]


def _capture(st: _State, key: tuple, compute) -> bool:
    device = torch.cuda.current_device()
    current = torch.cuda.current_stream()
    before = torch.cuda.memory_reserved(device)
    try:
        pool = _pool(device)
    except Exception as e:  # noqa: BLE001 - as a failed capture below
        st.off = True
        warnings.warn(f"no CUDA graph pool for the factored norm ({type(e).__name__}: {e}); this layer computes "
                      "it eagerly", RuntimeWarning, stacklevel=4)
        return False
    side = torch.cuda.Stream()
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = compute()
            finally:
                graph.capture_end()
    except Exception as e:  # noqa: BLE001 - any failure: this layer runs eagerly, said once
        st.off = True
        warnings.warn(f"the factored norm could not be captured as a CUDA graph ({type(e).__name__}: {e}); "
                      "this layer computes it eagerly", RuntimeWarning, stacklevel=4)
        return False
    current.wait_stream(side)
    _POOL_BYTES[device] += max(0, torch.cuda.memory_reserved(device) - before)
    st.graph, st.out, st.key = graph, out, key
    return True
