"""The trained-adapter recorder without a model: plan, stopping rule, captures file, packing, prediction."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from dora_num.studies.cancellation import record_trained_launch as L
from dora_num.studies.cancellation import record_trained as G
from dora_num.studies.cancellation import ingest_trained as R
from dora_num.studies.cancellation import runs as P

# MiniLM's 36 encoder linears: (d_out, d_in) per type, 6 layers each
SHAPES = {"q": (384, 384), "k": (384, 384), "v": (384, 384), "o": (384, 384), "intermediate": (1536, 384),
          "output": (384, 1536)}


def test_full_plan_is_the_issue_s_grid():
    plan = P.full_plan()
    names = [s.name for s in plan]
    assert len(names) == len(set(names)) == 13
    grid = {(s.rank, s.lr) for s in plan if s.role == "grid" and not s.use_rslora}
    assert grid == {(r, lr) for r in (8, 16, 64, 128, 384) for lr in (1e-4, 1e-3)}
    (rs,) = [s for s in plan if s.use_rslora]
    assert (rs.rank, rs.lr, rs.alpha) == (384, 1e-4, 192.0)
    assert rs.scale == pytest.approx(192 / math.sqrt(384))
    assert abs(rs.scale * rs.lr / 1e-3 - 1) < 0.03  # s * lr = 9.8e-4: about that of the s = 1, lr = 1e-3 runs
    assert {s.role for s in plan} == {"grid", "peft_twin", "ulp_twin"}
    twins = [s for s in plan if s.role != "grid"]
    assert all((s.rank, s.lr) == P.CROSSCHECK for s in twins)
    assert {(s.rank, s.lr) for s in plan if s.export} == set(P.EXPORTS)
    assert all(s.backend == "dora_num" for s in plan if s.export)


@pytest.mark.parametrize("rank", [16, 64, 128, 384], ids=lambda r: f"r{r}")
def test_exported_adapter_fits_a_returned_file(rank):
    """An exported adapter (fp32 A, B, m of 36 modules) must fit one part (16 MiB returned per file):
    only the ranks planned for export have to."""
    n = sum(6 * 4 * (rank * (d_in + d_out) + d_out) for d_out, d_in in SHAPES.values())
    planned = rank in {r for r, _ in P.EXPORTS}
    assert (n < L.PART_BYTES) or not planned, (rank, n)


def test_train_config_of_a_run():
    spec = P.RunSpec(16, 1e-3, perturbed=True)
    tc = G.FULL.train_config(spec)
    assert (tc.steps, tc.batch_size, tc.max_len, tc.bf16_autocast, tc.compose_path) == (5000, 64, 128, True, "fused")
    assert tc.capture_steps == G.CAPTURE_STEPS and tc.eval_steps == tuple(range(0, 5001, 100))
    assert tc.perturb_seed is not None and G.FULL.train_config(P.RunSpec(16, 1e-3)).perturb_seed is None
    assert G.SMOKE_CPU.train_config(spec).compose_path == "eager"  # no Triton kernels on CPU
    assert all(s <= G.SMOKE_CPU.max_steps for s in G.SMOKE_CPU.train_config(spec).capture_steps)


def test_min_delta_is_the_recorded_chaos_floor():
    """MIN_DELTA: the largest MRR@10 difference between 1-ulp twins in the recorded convergence runs,
    rounded down to 3 decimals."""
    floor = P.chaos_floor_mrr()
    assert floor["n"] >= 27  # 3 seeds x 9 evaluations from step 200 on
    assert G.MIN_DELTA <= floor["max"] < G.MIN_DELTA + 0.001, floor


D = 2.0**-8  # min_delta of these cases: binary fractions, so every comparison below is exact


@pytest.mark.parametrize("scores,stops_at", [
    ([0.5, 0.5 + 2 * D, 0.5 + 4 * D, 0.5 + 6 * D], None),  # steady gains
    ([0.5, 0.5, 0.5], 2),  # flat: patience 2 exhausted at the third score
    ([0.5, 0.5 + D, 0.5 + D], 2),  # a gain of exactly min_delta is not a gain
    ([0.5, 0.5 + 2 * D, 0.5 + 2 * D, 0.5 + 4 * D, 0.5], None),  # a gain > min_delta resets the wait
    ([0.5, 0.49, 0.48], 2),  # decline
], ids=["gains", "flat", "exactly_min_delta", "reset", "decline"])
def test_plateau_rule(scores, stops_at):
    p = G.Plateau(patience=2, min_delta=D)
    hit = next((i for i, s in enumerate(scores) if p.update(i, s)), None)
    assert hit == stops_at


def _res(history_seconds, evals):
    return SimpleNamespace(history=[{"step": i + 1, "loss": 1.0, "seconds": s} for i, s in enumerate(history_seconds)],
                           evals=evals)


def test_stop_rule_deadline_reserves_for_the_final_work():
    now = [1000.0]
    cfg = G.StudyConfig(eval_every=100, patience=5)
    rule = G.StopRule(cfg, deadline_at=1000.0 + 20.0, clock=lambda: now[0])
    rule.capture_seconds = 1.0
    ev = [{"step": 0, "mrr10": 0.6, "val_loss": 1.0, "seconds": 2.0}]
    res = _res([0.1] * 10, ev)
    # reserve = 1.5 * (2 + 1) + FINAL_MARGIN_S; next step 0.1 s
    reserve = 1.5 * 3.0 + G.FINAL_MARGIN_S
    now[0] = 1020.0 - reserve - 0.1 - 0.01
    assert rule(res, 10) is None
    now[0] += 0.02
    assert rule(res, 10) == "deadline"
    # an evaluation due at the next step is reserved for too
    now[0] = 1020.0 - reserve - 0.1 - 0.01
    assert rule(res, 99) == "deadline"


def test_stop_rule_plateau_and_signal():
    cfg = G.StudyConfig(eval_every=2, patience=2)
    rule = G.StopRule(cfg)
    ev = [{"step": 0, "mrr10": 0.6, "seconds": 0.1}]
    res = _res([0.1, 0.1], ev)
    assert rule(res, 1) is None
    ev.append({"step": 2, "mrr10": 0.6, "seconds": 0.1})
    assert rule(res, 2) is None  # one evaluation without a gain
    ev.append({"step": 4, "mrr10": 0.601, "seconds": 0.1})
    assert rule(res, 4) == "plateau"
    rule2 = G.StopRule(cfg)
    rule2.terminated = True
    assert rule2(_res([0.1], [{"step": 0, "mrr10": 0.6}]), 1) == "signal"
    bad = _res([0.1], [{"step": 0, "mrr10": 0.6}])
    bad.history[-1]["loss"] = float("nan")
    rule3 = G.StopRule(cfg)
    assert rule3(bad, 1) == "diverged" and rule3.diverged


def test_captures_file_round_trip():
    rng = np.random.default_rng(0)
    names = ["encoder.layer.0.attention.self.query", "encoder.layer.0.intermediate.dense"]
    sizes = {names[0]: 5, names[1]: 7}
    caps = {}
    for step in (0, 10):
        w = {n: (1 + rng.random(k)).astype(np.float32) for n, k in sizes.items()}
        m = {n: (w[n] * (1 + 1e-3 * rng.standard_normal(sizes[n]) * (step > 0))).astype(np.float32) for n in names}
        caps[step] = {"m": m, "wnorm": w, "wnorm64": {n: w[n].astype(np.float64) * (1 + 1e-9) for n in names},
                      "g_is_quotient": True}
    path = P.captures_npz(caps, names)
    import io

    c = P.Captures.load(io.BytesIO(path))
    assert c.steps.tolist() == [0, 10] and c.modules == names and c.offsets.tolist() == [0, 5, 12]
    assert np.all(np.concatenate(list(c.g_layer(0).values())) == 1.0)  # fl32(w / w) = 1
    for n in names:
        np.testing.assert_array_equal(c.g_layer(10)[n], (caps[10]["m"][n] / caps[10]["wnorm"][n]).astype(np.float64))
        np.testing.assert_array_equal(c.g_params(10)[n], caps[10]["m"][n].astype(np.float64) / caps[10]["wnorm64"][n])
    with pytest.raises(KeyError, match="no capture at step 5"):
        c.g_layer(5)


def test_pack_splits_under_the_limit_and_unpacks(tmp_path):
    work = tmp_path / "work"
    (work / "runs" / "a").mkdir(parents=True)
    payload = {f"runs/a/f{i}.bin": bytes([i]) * (3000 + 7 * i) for i in range(5)}
    for rel, data in payload.items():
        (work / rel).write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    parts = L.pack(work, out, part_bytes=30_000, max_parts=5)
    assert len(parts) == 2 and all(p.stat().st_size <= 30_000 for p in parts)
    assert not work.exists()
    R.unpack(out, tmp_path / "back")
    for rel, data in payload.items():
        assert (tmp_path / "back" / rel).read_bytes() == data


def test_pack_refuses_what_cannot_come_back(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "big.bin").write_bytes(b"x" * 20_000)
    with pytest.raises(ValueError, match="more than a part may hold"):
        L.pack(work, tmp_path, part_bytes=30_000)
    (work / "big.bin").unlink()
    for i in range(3):
        (work / f"f{i}.bin").write_bytes(b"x" * 15_000)
    with pytest.raises(ValueError, match="3 parts needed, at most 2"):
        L.pack(work, tmp_path, part_bytes=30_000, max_parts=2)


def test_prediction_of_the_full_plan():
    p = L.predict(P.full_plan(), G.FULL, 540.0)
    assert p["processes"] == 13
    assert 0 < p["steps_gpu_bound"] <= p["steps_host_bound"] < G.FULL.max_steps
    assert not p["reaches_max_steps"] and "deadline" in p["note"]


def test_plan_command_prints(capsys):
    from dora_num.studies import cli

    assert cli.run("adapters-gpu", ["--plan-only", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "r384_lr0.0001_rslora" in out and "steps_host_bound" in out


@pytest.mark.parametrize("seeds", [["0"], ["1", "1"], ["-2"]])
def test_bad_seeds_are_a_usage_error_in_one_line(capsys, seeds):
    """Seed 0 is the full plan's record and seeds are distinct: anything else exits 2, no traceback."""
    from dora_num.studies import cli

    assert cli.run("adapters-gpu", ["--plan", "seeds", "--seeds", *seeds, "--plan-only", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dora-num record adapters-gpu: seeds must be distinct integers >= 1") and "\n" not in err


def test_plan_through_dora_num_record(capsys):
    """``dora-num record adapters-gpu ...`` reaches the recorder with its arguments passed through."""
    from dora_num.__main__ import main

    assert main(["record", "adapters-gpu", "--plan-only", "--smoke", "--device", "cpu"]) == 0
    assert [s.name for s in P.smoke_plan()][0] in capsys.readouterr().out


def test_launcher_command_line_is_the_recorder_s():
    """Each run's process (``python -m dora_num record adapters-gpu --run NAME ...``) parses with the
    recorder's parser."""
    cmd = L.run_command(P.smoke_plan()[1], "smoke", G.SMOKE_CPU, "W", deadline_at=123.5, base_path="B", python="py")
    assert cmd[:5] == ["py", "-m", "dora_num", "record", "adapters-gpu"]
    a = G.build_parser().parse_args(cmd[5:])
    assert (a.run, a.work, a.smoke, a.device, a.deadline_at, a.base) == (
        P.smoke_plan()[1].name, "W", True, "cpu", 123.5, "B")


def test_unknown_run_is_named():
    with pytest.raises(ValueError, match=r"runs \['r7_lr0.1'\] are not in the plan"):
        P.select(P.full_plan(), ["r7_lr0.1"])


@pytest.mark.slow
def test_a_failing_run_keeps_what_it_recorded(tmp_path):
    """An exception in training (here: a training text that is not a string, met at the first step)
    ends the run as ``error: ...``, and what was recorded before it (the step-0 capture and evaluation)
    is written all the same; nothing is exported."""
    import json

    from dora_num.adapters.corpus import load_corpus

    c = load_corpus()
    cfg = G.SMOKE_CPU
    train = [dict(p) for p in c if p["split"] == "train"][: cfg.batch_size]
    train[1]["summary"] = None
    corpus = train + [p for p in c if p["split"] == "validation"][: cfg.eval_limit]
    G.run_one(P.RunSpec(4, 1e-3, export=True), cfg, tmp_path, corpus=corpus, log=lambda m: None)
    d = tmp_path / "runs" / "r4_lr0.001"
    info = json.loads((d / "run.json").read_text())
    assert info["stop_reason"].startswith("error: ") and info["steps"] == 0 and info["capture_steps"] == [0]
    assert P.Captures.load(d / "captures.npz").steps.tolist() == [0]
    assert not (d / "adapter").exists()


@pytest.mark.gpu
def test_gpu_smoke_trio(tmp_path):
    """On CUDA (the H200 image; base from .carry/minilm when present): the cross-check trio at GPU smoke
    sizes through the fused path; every DoRALinear capture's g is the fp32 quotient m / wnorm, the fused
    training tier ran, step 0 is shared, and PEFT's norm is bf16-valued exactly where its input is bf16."""
    import dataclasses

    import torch

    from dora_num.repro.paths import REPO_ROOT

    base = REPO_ROOT / ".carry" / "minilm"
    cfg = dataclasses.replace(G.SMOKE_GPU, max_steps=12, eval_every=6, capture_steps=(0, 10))
    files = G.record_inline(P.smoke_plan()[:3], "smoke", cfg, tmp_path / "launch",
                            base_path=base if base.is_dir() else None, log=lambda m: None)
    raw = R.load_raw(R.unpack(files, tmp_path / "full"))
    assert not raw.missing
    by_role = {r.info["role"]: r for r in raw.runs.values()}
    for role in ("grid", "ulp_twin"):
        info = by_role[role].info
        assert info["g_is_quotient"] is True and info["compose_path"] == "fused"
        assert info["dispatch_counts"]["fused_training"] > 0
    ours, peft = by_role["grid"].captures, by_role["peft_twin"].captures
    np.testing.assert_array_equal(ours.m[0], ours.wnorm[0])
    np.testing.assert_array_equal(peft.m[0], ours.m[0])
    dt = by_role["peft_twin"].info["input_dtypes"]
    for n, v in peft.split(peft.wnorm[0]).items():
        bf = torch.from_numpy(v).to(torch.bfloat16).float().numpy()
        assert np.array_equal(bf, v) == (dt[n] == "bfloat16"), n
