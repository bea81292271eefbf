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


def _layer(device="cpu"):
    torch.manual_seed(1)
    lin = torch.nn.Linear(D_IN, D_OUT, bias=False, dtype=torch.bfloat16, device=device)
    layer = dn.DoRALinear(lin, R, 2.0 * R)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    return layer


@pytest.mark.parametrize("changes", [dict(compose_path="fused")])  # fused saves base and lora, eager inner
def test_checkpoint_recompute_on_another_thread_keeps_the_forward_config(changes):
    """The backward is run from another thread (on the CPU the engine runs it on the calling
    thread, as CUDA's runs it on its own), which sees no override of the forward's thread: a
    recompute under the process default would record another sequence of operations
    (checkpoint's CheckpointError: a different number of saved tensors) or other values."""
    layer = _layer()
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


@pytest.mark.gpu
def test_cached_norm_flag_read_once_cuda():
    """A reused norm (norm_cache="always") whose flag was read clean is not watched again: no new
    pending flag per forward (the host cost of a copy and an event), and the output is the same;
    a new version of m misses the cache and is checked again."""
    from dora_num.ops import finite

    layer = _layer("cuda")
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


def test_layer_with_a_reused_norm_copies_and_pickles():
    """The norm cache keeps where its flag's check is (a CUDA event on CUDA): a copy or a pickle of
    the layer forgets it and checks its first reuse again."""
    import copy
    import pickle

    layer = _layer()
    x = torch.randn(3, D_IN, dtype=torch.bfloat16)
    with override(norm_cache="always"), torch.no_grad():
        y = layer(x)
        layer(x)
        for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert torch.equal(other(x), y)
