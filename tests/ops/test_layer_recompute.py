"""DoRALinear where a forward is run again or reused: the recompute of a checkpointed forward on
another thread (the autograd engine's, for CUDA tensors) takes the configuration of the layer's
last forward; a reused norm whose finiteness flag was read clean is not watched again."""

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import dora_num as dn
from dora_num.ops.config import override

D_IN, D_OUT, R = 16, 24, 4


@pytest.mark.parametrize("changes", [dict(compose_path="fused")])  # fused saves base and lora, eager inner
def test_checkpoint_recompute_on_another_thread_keeps_the_forward_config(changes, small_layer):
    """The backward is run from another thread (on the CPU the engine runs it on the calling
    thread, as CUDA's runs it on its own), which sees no override of the forward's thread: a
    recompute under the process default would record another sequence of operations
    (checkpoint's CheckpointError: a different number of saved tensors) or other values."""
    layer = small_layer(D_IN, D_OUT, R, 2.0 * R, dtype=torch.bfloat16, seed=1, m_scale=1.0)
    x = torch.randn(2, 5, D_IN, dtype=torch.bfloat16, requires_grad=True)
    with override(**changes), torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint(layer, x, use_reentrant=False)
        y_ref = layer(x)
    ref = torch.autograd.grad(y_ref.float().sum(), [layer.lora_A, layer.lora_B, x])
    errors = []

    def backward():
        try:
            y.float().sum().backward()
        except Exception as e:  # noqa: BLE001 - reported to the test thread
            errors.append(e)

    t = threading.Thread(target=backward)
    t.start()
    t.join()
    assert not errors, errors
    for u, v in zip([layer.lora_A.grad, layer.lora_B.grad, x.grad], ref):
        assert torch.equal(u, v)


def test_checkpoint_recompute_under_another_override_keeps_the_forward_config(small_layer):
    """A backward run under another override than its forward's (here on the forward's own thread):
    the recompute still replays the forward's configuration."""
    layer = small_layer(D_IN, D_OUT, R, 2.0 * R, dtype=torch.bfloat16, seed=1, m_scale=1.0)
    x = torch.randn(2, 5, D_IN, dtype=torch.bfloat16, requires_grad=True)
    with override(compose_path="fused"), torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint(layer, x, use_reentrant=False)
        y_ref = layer(x)
    ref = torch.autograd.grad(y_ref.float().sum(), [layer.lora_A, layer.lora_B, x])
    with override(finite_check="sync"):
        y.float().sum().backward()
    for u, v in zip([layer.lora_A.grad, layer.lora_B.grad, x.grad], ref):
        assert torch.equal(u, v)


def test_compose_under_forward_mode_ad_is_not_silent():
    """Under forward-mode AD with nothing recording a gradient, compose does not drop the tangent:
    the eager tier's reference gives it, the fused tier (no jvp) raises."""
    import torch.autograd.forward_ad as fwAD

    base, lora, t = (torch.randn(4, 8) for _ in range(3))
    g = 1 + 0.01 * torch.randn(8)
    with fwAD.dual_level():
        dual = fwAD.make_dual(base, t)
        with pytest.raises(RuntimeError, match="jvp"):
            dn.compose(dual, lora, g, 0.5, path="fused")


@pytest.mark.gpu
def test_cached_norm_flag_read_once_cuda(small_layer):
    """A reused norm (norm_cache="always") whose flag was read clean is not watched again: no new
    pending flag per forward (the host cost of a copy and an event), and the output is the same;
    a new version of m misses the cache and is checked again."""
    from dora_num.ops import finite

    layer = small_layer(D_IN, D_OUT, R, 2.0 * R, dtype=torch.bfloat16, seed=1, m_scale=1.0, device="cuda")
    x = torch.randn(8, D_IN, dtype=torch.bfloat16, device="cuda")
    with override(norm_cache="always"), torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        y0 = layer(x)
        finite.check_pending()
        y1 = layer(x)
        assert finite.pending_count() == 0
        layer.magnitude[0] = float("nan")
        layer(x)
        with pytest.raises(ValueError):
            finite.check_pending()
    assert torch.equal(y0, y1)


def test_layer_with_a_reused_norm_copies_and_pickles(small_layer):
    """The norm cache keeps where its flag's check is (a CUDA event on CUDA): a copy or a pickle of
    the layer forgets it and checks its first reuse again."""
    import copy
    import pickle

    layer = small_layer(D_IN, D_OUT, R, 2.0 * R, dtype=torch.bfloat16, seed=1, m_scale=1.0)
    x = torch.randn(3, D_IN, dtype=torch.bfloat16)
    with override(norm_cache="always"), torch.no_grad():
        y = layer(x)
        layer(x)
        for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert torch.equal(other(x), y)


def test_reused_norm_is_not_watched_again_once_clean(small_layer):
    """CPU: the flag of a reused norm read clean is not watched again (the cache entry keeps the
    first Watched); a new version of m misses the cache and is checked, and raises."""
    layer = small_layer(D_IN, D_OUT, R, 2.0 * R, dtype=torch.bfloat16, seed=1, m_scale=1.0)
    x = torch.randn(3, D_IN, dtype=torch.bfloat16)
    with override(norm_cache="always"), torch.no_grad():
        y0 = layer(x)
        first = layer.__dict__["_norm_cache"][4].watched
        assert first is not None and first.clean
        y1 = layer(x)
        assert layer.__dict__["_norm_cache"][4].watched is first
        assert torch.equal(y0, y1)
        layer.magnitude[0] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            layer(x)
