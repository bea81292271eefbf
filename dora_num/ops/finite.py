"""Finiteness checks that do not drain the device.

The operator's public calls check the small ``[d_out]`` vectors they form (``g``, ``wnorm``) through a
device flag copied to pinned host memory behind a CUDA event and read by ``OpConfig.finite_check``:
``"deferred"`` (default: at a later call of the operator or at :func:`check_pending`, naming the call;
no host wait), ``"late"`` (at the end of the call), ``"sync"`` (at once) or ``"off"``.  Reading the flag
at once made ``compose``'s public call 2-3x slower than its kernel at 8192x8192 bf16 (H200).  On the CPU
every mode but ``"off"`` reads at once.  In full: docs/operator.md.
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch

MAX_PENDING = 4096
_local = threading.local()
_FREE: dict = {}  # (numel, dtype) -> list of pinned host buffers, reused after they were read
# every thread's pending deque, for check_pending(all_threads=True): a checkpointed forward's recompute runs on
# the autograd engine's device thread and registers its flags there, out of reach of the main thread's reads
_QUEUES: "weakref.WeakValueDictionary[int, collections.deque]" = weakref.WeakValueDictionary()


class NotFiniteError(ValueError):
    """A value checked by a deferred or late finiteness check was NaN or Inf."""


def _pending() -> collections.deque:
    q = getattr(_local, "pending", None)
    if q is None:
        q = _local.pending = collections.deque()
        _QUEUES[id(q)] = q
    return q


class Watched:
    """A device flag on its way to the host: ``flag`` (pinned), ``event`` (after the copy),
    ``what`` (the call, for the message) and ``on_fail`` (called with the host flag when it is
    set, before the generic error: it may raise a more precise one, or return True when the
    flag was not an error after all, e.g. a cancellation guard's code that it reports itself)."""

    __slots__ = ("flag", "event", "what", "on_fail", "is_ok", "clean")

    def __init__(self, flag, event, what, on_fail, is_ok=False):
        self.flag, self.event, self.what, self.on_fail, self.is_ok = flag, event, what, on_fail, is_ok
        self.clean = False  # read, and nothing was set (a caller that reuses the checked value may skip it)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def check(self) -> None:
        """Wait for the flag (the work queued up to it) and raise if it is set."""
        if self.event is not None:
            self.event.synchronize()
        self._read()

    def _read(self) -> None:
        bad = not bool(self.flag.all()) if self.is_ok else bool(self.flag.any())
        self.clean = not bad
        try:
            if bad and (self.on_fail is None or self.on_fail(self.flag) is not True):
                raise NotFiniteError(f"{self.what} produced non-finite values")
        finally:
            if self.event is not None:  # reusable once read (and once on_fail is done with it)
                _FREE.setdefault((self.flag.numel(), self.flag.dtype), []).append(self.flag)


class Checked:
    """Where a caller keeps the :class:`Watched` of a value it may reuse (``watched``; None before
    it is set): ``clean`` once that flag was read and nothing was set.  A copy or a pickle of it
    (of the module that holds it) forgets the flag: the copy's first reuse is checked again."""

    __slots__ = ("watched",)

    def __init__(self):
        self.watched = None

    @property
    def clean(self) -> bool:
        return self.watched is not None and self.watched.clean

    def __reduce__(self):
        return (Checked, ())


def _copy_to_host(bad: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    free = _FREE.get((bad.numel(), bad.dtype))
    host = free.pop() if free else torch.empty(bad.shape, dtype=bad.dtype, pin_memory=True)
    host = host.view(bad.shape)
    host.copy_(bad, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(bad.device))
    return host, event


def watch(bad: torch.Tensor, what: str, mode: str, on_fail=None, *, is_ok: bool = False,
          handle: bool = False) -> Watched | None:
    """Check the device flag ``bad`` (any shape; set where a value was not finite) by ``mode``
    (module docstring).  Returns a :class:`Watched` for ``"late"`` (the caller calls
    :meth:`Watched.check` at the end of its call), else None (checked already, registered, or
    not checked); with ``handle`` the :class:`Watched` in every mode that made one (its ``clean``
    turns true once it was read and nothing was set: a caller reusing the checked value may then
    skip checking it again).  ``on_fail(host_flag)`` runs before the generic
    :class:`NotFiniteError` and may raise a more precise error, or return True to mean "handled,
    no error" (:class:`Watched`).  ``is_ok``: ``bad`` is the opposite flag, set where all is
    finite (:func:`all_finite`: one launch fewer)."""
    if mode == "off":
        return None
    if bad.device.type != "cuda" or mode == "sync":
        w = Watched(bad, None, what, on_fail, is_ok)
        w._read()
        return w if handle else None
    if torch.cuda.is_current_stream_capturing():
        return None
    host, event = _copy_to_host(bad.detach())
    w = Watched(host, event, what, on_fail, is_ok)
    if mode == "late":
        return w
    register(w)
    return w if handle else None


def register(w: Watched) -> None:
    """Add ``w`` to this thread's pending flags (what :func:`watch` does in ``"deferred"``
    mode); beyond :data:`MAX_PENDING` the oldest is waited for and read."""
    q = _pending()
    q.append(w)
    if len(q) > MAX_PENDING:
        q.popleft().check()


def poll() -> None:
    """Read this thread's pending flags whose events have completed (never waits); raise for
    the first one that is set (it is removed, so the error is raised once)."""
    q = getattr(_local, "pending", None)
    while q and q[0].ready():
        q.popleft()._read()


def check_pending(*, all_threads: bool = False) -> None:
    """Wait for every pending flag of this thread and raise for the first one that is set (the
    end of a training step, or a test, calls it to have every deferred check done).

    ``all_threads``: every thread's pending flags, the autograd engine's device threads' included (where a
    checkpointed forward's recompute registers them).  A pending flag keeps its call's arguments alive (its
    report names them: a layer, W, A, B) until it is read, so a measurement of memory that builds and drops
    models one after another reads them all before its baseline (``record_memory.measure_peak``).  Call it
    where no other thread runs the operator (between steps)."""
    queues = list(_QUEUES.values()) if all_threads else [getattr(_local, "pending", None)]
    for q in queues:
        while q:
            q.popleft().check()


def pending_count() -> int:
    """How many flags of this thread are not read yet."""
    q = getattr(_local, "pending", None)
    return len(q) if q else 0


def any_not_finite(t: torch.Tensor) -> torch.Tensor:
    """0-dim device bool: some element of ``t`` is NaN or Inf (no sync)."""
    return ~all_finite(t)


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-dim device bool: every element of ``t`` is finite (no sync; two launches)."""
    return torch.isfinite(t.detach()).all()
