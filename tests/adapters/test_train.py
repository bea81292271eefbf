"""A small real training run on CPU (a few steps), both backends, same init and data order."""

import numpy as np
import pytest
import torch

from dora_num.adapters import train as T
from dora_num.adapters.corpus import load_corpus
from dora_num.adapters.model import load_base_model, mrr_at_k

pytestmark = pytest.mark.slow  # ~4 MiniLM builds + a few steps: ~60 s on the free 2-core CI machine

SMALL = dict(rank=2, batch_size=4, max_len=16, lr=1e-3, warmup_steps=1, eval_limit=8, progress=False)


@pytest.fixture(scope="module")
def small_corpus():
    c = load_corpus()
    return [r for r in c if r["split"] == "train"][:24] + [r for r in c if r["split"] == "validation"][:8]


@pytest.fixture(scope="module")
def ours(small_corpus):
    cfg = T.TrainConfig(steps=3, capture_steps=(0, 3), eval_steps=(0, 3), **SMALL)
    return T.train(cfg, corpus=small_corpus)


def test_runs_and_records(ours):
    assert [h["step"] for h in ours.history] == [1, 2, 3]
    assert all(np.isfinite(h["loss"]) and h["grad_norm"] > 0 for h in ours.history)
    assert [e["step"] for e in ours.evals] == [0, 3]
    assert ours.seconds_per_step > 0
    assert len(ours.module_names) == 36 and set(ours.g_minus_1) == {0, 3}
    g0 = np.concatenate(list(ours.g_minus_1[0].values()))
    g3 = np.concatenate(list(ours.g_minus_1[3].values()))
    assert g0.size == 6 * (5 * 384 + 1536)
    assert np.abs(g3).max() > np.abs(g0).max()  # training moved g away from its init


def test_init_is_the_base_model_exactly(ours, small_corpus):
    """B = 0 and g = m / wnorm = 1 exactly at init: delta = 0*base + 1*0 added to the base output
    formed as nn.Linear forms it, so the DoRA model's step-0 evaluation equals the plain base
    model's bit for bit."""
    base, tok = load_base_model()
    cfg = T.TrainConfig(**SMALL)
    want = T.evaluate(base, tok, [r for r in small_corpus if r["split"] == "validation"], cfg)
    assert ours.evals[0]["mrr10"] == want["mrr10"] and ours.evals[0]["val_loss"] == want["val_loss"]


def test_peft_backend_same_init_and_outputs(ours, small_corpus):
    """PEFT gets our A, B, m bit for bit (so g at step 0, computed from them, is identical).
    Its sentence embeddings at init are held to the float64 base model (what both compute
    at init, B = 0) by the same-dtype baseline: PEFT's max and mean errors at most twice
    ours (measured 2026-11-29 on 64 texts: max 1.45e-7 vs 1.38e-7, mean 2.4e-8 vs 2.3e-8)."""
    from dora_num.adapters.model import embed, tokenize

    peft_model, tok, names = T.build_model(T.TrainConfig(backend="peft", **SMALL))
    ref_model, _, _ = T.build_model(T.TrainConfig(**SMALL))
    theirs = T.adapter_tensors(peft_model, "peft", names)
    mine = T.adapter_tensors(ref_model, "dora_num", names)
    assert set(theirs) == set(mine) == set(names)
    for n in names:
        for i in (0, 1, 2, 3):  # W, A, B, m bit for bit
            assert torch.equal(theirs[n][i], mine[n][i]), (n, i)
        assert theirs[n][4] == mine[n][4]  # scale
    peft_model.eval()
    ref_model.eval()
    base64, _ = load_base_model(dtype=torch.float64)
    batch = tokenize(tok, [r["summary"] for r in small_corpus], 16)
    with torch.no_grad():
        e64 = embed(base64, batch).double()
        d_ours = (embed(ref_model, batch).double() - e64).abs()
        d_peft = (embed(peft_model, batch).double() - e64).abs()
    assert d_peft.max() <= 2 * d_ours.max() and d_peft.mean() <= 2 * d_ours.mean(), (d_peft.max(), d_ours.max())


def test_peft_backend_trains(ours, small_corpus):
    res = T.train(T.TrainConfig(backend="peft", steps=2, capture_steps=(0,), **SMALL), corpus=small_corpus)
    assert len(res.history) == 2 and all(np.isfinite(h["loss"]) for h in res.history)
    for n, g in res.g_minus_1[0].items():  # identical init: identical g at step 0
        assert np.array_equal(g, ours.g_minus_1[0][n]), n
    assert [h["lr"] for h in res.history] == [h["lr"] for h in ours.history[:2]]


def test_batch_order_seeded():
    a, b, c = T.batch_order(10, 3, 7, seed=0), T.batch_order(10, 3, 7, seed=0), T.batch_order(10, 3, 7, seed=1)
    assert a == b and a != c and len(a) == 7 and all(len(x) == 3 for x in a)
    assert sorted(sum(a[:3], [])) == sorted(set(sum(a[:3], [])))  # no repeats within an epoch
    with pytest.raises(ValueError, match="at least batch_size"):
        T.batch_order(2, 3, 1, seed=0)


def test_mrr_at_k_known_values():
    q = torch.eye(3)
    assert mrr_at_k(q, q) == 1.0
    d = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])  # rows 0, 1 rank their doc 2nd
    assert mrr_at_k(q, d) == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert mrr_at_k(q, d, k=1) == pytest.approx(1 / 3)


@pytest.mark.parametrize("bad, msg", [(dict(backend="jax"), "backend"), (dict(batch_size=1), "batch_size"),
                                      (dict(lr=0.0), "lr"), (dict(steps=2, capture_steps=(3,)), "capture_steps")])
def test_config_validation(bad, msg):
    with pytest.raises(ValueError, match=msg):
        T.TrainConfig(**{**SMALL, **bad}).validate()


def test_bf16_autocast_step(small_corpus):
    """The optional bf16 autocast path runs (fp32 master weights, finite loss, g still fp32)."""
    res = T.train(T.TrainConfig(steps=1, bf16_autocast=True, capture_steps=(1,), **SMALL), corpus=small_corpus)
    assert np.isfinite(res.history[0]["loss"])
    assert all(p.dtype == torch.float32 for p in res.model.parameters())
    assert all(g.dtype == np.float32 for g in res.g_minus_1[1].values())


def test_stop_and_capture_hooks(small_corpus):
    """``should_stop`` ends training at the step it names; the state training ended in is then
    evaluated and captured once, by the ``capture`` hook (the default g - 1 snapshot is not taken)."""
    seen = []

    def capture(res, step):
        seen.append(step)
        return {"step": step, "m0": res.model.get_submodule(res.module_names[0]).magnitude.detach().clone()}

    hooks = T.TrainHooks(capture=capture, should_stop=lambda res, step: "enough" if step == 2 else None)
    cfg = T.TrainConfig(steps=5, capture_steps=(0, 1, 4), eval_steps=(0, 4), **SMALL)
    res = T.train(cfg, corpus=small_corpus, hooks=hooks)
    assert res.stop_reason == "enough" and [h["step"] for h in res.history] == [1, 2]
    assert seen == [0, 1, 2] and sorted(res.captures) == [0, 1, 2] and not res.g_minus_1
    assert [e["step"] for e in res.evals] == [0, 2] and all(e["seconds"] > 0 for e in res.evals)
    assert not torch.equal(res.captures[0]["m0"], res.captures[2]["m0"])  # captures are snapshots, not views
    full = T.train(T.TrainConfig(steps=2, capture_steps=(2,), eval_steps=(2,), **SMALL), corpus=small_corpus,
                   hooks=T.TrainHooks(should_stop=lambda res, step: None))
    assert full.stop_reason == "max_steps" and sorted(full.g_minus_1) == [2] and [e["step"] for e in full.evals] == [2]
