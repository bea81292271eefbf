"""Finiteness checks without a device sync (:mod:`dora_num.ops.finite`).

On the CPU the pending-flag machinery is driven with a stand-in for a CUDA event (its
``query`` says whether the device got there); on the GPU the real path runs under
``torch.cuda.set_sync_debug_mode("error")`` (gpu-marked tests below and in
``tests/studies/speed/test_model_bench.py``).
"""

from __future__ import annotations

import pytest
import torch

import dora_num as dn
from dora_num.ops import finite
from dora_num.ops.config import override


class _Event:
    """A CUDA event stand-in: completed once ``done`` is set."""

    def __init__(self):
        self.done = False
        self.waited = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True
        self.done = True


@pytest.fixture(autouse=True)
def _empty_queue():
    finite.check_pending()
    yield
    try:
        finite.check_pending()
    except finite.NotFiniteError:
        pass


def _watched(bad: bool, what="call"):
    ev = _Event()
    return finite.Watched(torch.tensor([bad]), ev, what, None), ev


def test_poll_reads_only_completed_flags_and_never_waits():
    ok, ev_ok = _watched(False)
    bad, ev_bad = _watched(True, "second call")
    finite.register(ok)
    finite.register(bad)
    finite.poll()  # nothing completed: nothing read, nothing waited for
    assert finite.pending_count() == 2 and not ev_ok.waited
    ev_ok.done = True
    finite.poll()
    assert finite.pending_count() == 1
    ev_bad.done = True
    with pytest.raises(finite.NotFiniteError, match="second call produced non-finite"):
        finite.poll()
    assert finite.pending_count() == 0  # raised once, then gone
    finite.poll()


def test_check_pending_waits_and_names_the_call_and_its_input():
    def name_input(host_flag):
        raise ValueError("A contains non-finite values (1 NaN, 0 Inf)")

    w = finite.Watched(torch.tensor([0, 3], dtype=torch.int32), _Event(), "DoRALinear(4->4, r=2): g", name_input)
    finite.register(w)
    with pytest.raises(ValueError, match="A contains non-finite"):
        finite.check_pending()
    assert w.event.waited


def test_the_queue_is_bounded(monkeypatch):
    events = []
    for _ in range(finite.MAX_PENDING + 3):
        w, ev = _watched(False)
        events.append(ev)
        finite.register(w)
    assert finite.pending_count() == finite.MAX_PENDING
    assert [e.waited for e in events[:3]] == [True] * 3 and not events[3].waited


@pytest.mark.parametrize("mode", ["deferred", "late", "sync"])
def test_public_calls_raise_at_once_on_the_cpu(mode):
    """No device on the CPU: every mode but "off" reads the flag in the call itself."""
    base, lora = torch.randn(3, 8), torch.randn(3, 8)
    g = torch.ones(8)
    g[2] = float("inf")
    W, A, B = torch.randn(8, 5), torch.randn(2, 5), torch.randn(8, 2)
    A[0, 0] = float("nan")
    with override(finite_check=mode):
        with pytest.raises(ValueError, match="g contains non-finite"):
            dn.compose(base, lora, g, 0.5)
        with pytest.raises(ValueError, match="A contains non-finite"):
            dn.factored_row_norm(W, A, B, 0.5)
    with override(finite_check="off"):
        assert not bool(torch.isfinite(dn.compose(base, lora, g, 0.5)).all())


def test_return_flag_checks_nothing_and_returns_the_flag():
    base, lora = torch.randn(3, 8), torch.randn(3, 8)
    g = torch.ones(8)
    out, bad = dn.compose(base, lora, g, 0.5, return_flag=True)
    assert bad.dim() == 0 and not bool(bad)
    torch.testing.assert_close(out, dn.compose(base, lora, g, 0.5), rtol=0, atol=0)
    g[1] = float("nan")
    out, bad = dn.compose(base, lora, g, 0.5, return_flag=True)
    assert bool(bad) and not bool(torch.isfinite(out).all())
    W, A, B = torch.randn(8, 5), torch.randn(2, 5), torch.randn(8, 2)
    w, bad = dn.factored_row_norm(W, A, B, 0.5, return_flag=True)
    assert not bool(bad) and torch.equal(w, dn.factored_row_norm(W, A, B, 0.5))
    B[3, 1] = float("inf")
    w, bad = dn.factored_row_norm(W, A, B, 0.5, return_flag=True)
    assert bool(bad)


@pytest.mark.gpu
def test_public_compose_and_norm_queue_no_sync_and_raise_later():
    """On CUDA, compose and factored_row_norm run under the sync debug mode's "error"; a
    non-finite g is queued, not read, and reported by the next public call once the device got
    there (and only once: check_pending then finds nothing), naming g.  The bad g is made before
    the debug mode is entered (writing a Python scalar into a device tensor is itself a host-to-
    device copy that syncs); the mode's reach is checked on that very write (a control)."""
    dev = "cuda"
    base = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
    lora = torch.randn_like(base)
    g = 1 + 1e-3 * torch.randn(1024, device=dev)
    g_bad = g.clone()
    g_bad[7] = float("nan")
    probe = g.clone()
    W = torch.randn(1024, 256, device=dev, dtype=torch.bfloat16)
    A, B = torch.randn(16, 256, device=dev), 1e-2 * torch.randn(1024, 16, device=dev)
    dn.compose(base, lora, g, 0.5, path="fused")
    dn.factored_row_norm(W, A, B, 0.5)
    finite.check_pending()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchronizing"):  # control: the mode sees a sync
            probe[7] = float("nan")
        for _ in range(3):
            dn.compose(base, lora, g, 0.5, path="fused")
            dn.factored_row_norm(W, A, B, 0.5)
        dn.compose(base, lora, g_bad, 0.5, path="fused")  # returns; the flag is pending
        assert finite.pending_count() >= 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # the device got there: the next call's poll reads the flag
    with pytest.raises(ValueError, match="g contains non-finite"):
        dn.factored_row_norm(W, A, B, 0.5)
    finite.check_pending()  # reported once


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_compose_writes_the_flag_of_g_in_its_own_pass(device):
    """The fused forward fills g's finiteness flag (one entry per column block, written by the
    first row block: no launch of its own); the output is bitwise that of the unflagged kernel."""
    from dora_num.ops.config import get_config
    from dora_num.ops.kernels import compose as kc

    if device == "cpu" and not get_config().interpret:
        pytest.skip("the CPU case runs the kernel under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    base = torch.randn(5, 3000, device=device)
    lora = torch.randn_like(base)
    for bad_col, expect_bad in ((None, False), (2999, True), (0, True)):
        g = 1 + 1e-3 * torch.randn(3000, device=device)
        if bad_col is not None:
            g[bad_col] = float("inf") if bad_col else float("nan")
        n = kc.g_flag_size(3000)
        assert n > 1
        flag = torch.full((n,), -1, dtype=torch.int32, device=device)
        out, _ = kc.compose_fwd(base, lora, g, 0.5, g_flag=flag)
        assert (flag >= 0).all() and bool(flag.any()) == expect_bad
        if bad_col is not None:  # the first or the last column block, and only it
            assert flag.nonzero().flatten().tolist() == [0 if bad_col == 0 else n - 1]
        ref, _ = kc.compose_fwd(base, lora, g, 0.5)
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
        res, bad = dn.compose(base, lora, g, 0.5, path="fused", return_flag=True)
        assert bool(bad) == expect_bad


def test_check_pending_of_every_thread_reads_another_threads_flags():
    """A checkpointed forward's recompute registers its flag on the autograd engine's thread, which this
    thread's check_pending never reaches; ``all_threads=True`` does, and what the flag kept alive is freed."""
    import gc
    import threading
    import weakref

    class Held:  # what a pending flag's report keeps (a layer, in the operator)
        pass

    registered, done = threading.Event(), threading.Event()
    refs = []

    def other_thread():
        held = Held()
        refs.append(weakref.ref(held))
        finite.register(finite.Watched(torch.tensor([False]), _Event(), "recompute", lambda _f, h=held: None))
        del held
        registered.set()
        done.wait(30)  # alive, as the autograd engine's thread is, while the main thread reads

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        assert registered.wait(30)
        finite.check_pending()  # this thread's: the other's flag stays, and with it what it holds
        gc.collect()
        assert refs[0]() is not None
        finite.check_pending(all_threads=True)
        gc.collect()
        assert refs[0]() is None
    finally:
        done.set()
        t.join()
