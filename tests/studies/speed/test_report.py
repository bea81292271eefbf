"""The GPU suite's CPU-side parts: traffic model, recorded-data tables, ingest, CLI."""

import json
import re

import pandas as pd
import pytest
import torch

from dora_num.repro.paths import committed_data
from dora_num.studies import bench
from dora_num.studies.speed import report as br
from dora_num.studies import record_suite as gpu_suite

RECORDED = committed_data("gpu", "device.json").is_file()
needs_recorded = pytest.mark.skipif(not RECORDED, reason="no recorded GPU suite in data/gpu/")


def test_compose_traffic_model():
    n, cols = 8192 * 8192, 8192
    assert bench.compose_bytes("fwd", n, 2, cols) == 6 * n + 4 * cols
    assert bench.compose_bytes("fwd_inner", n, 2, cols) == 10 * n + 4 * cols
    nb = 8192 // 64
    assert bench.compose_bytes("bwd", n, 2, cols, bwd_block_m=64) == 10 * n + 8 * cols + 8 * nb * cols
    assert bench.compose_bytes("train", n, 2, cols, bwd_block_m=64) == (
        bench.compose_bytes("fwd", n, 2, cols) + bench.compose_bytes("bwd_recompute", n, 2, cols, bwd_block_m=64))
    with pytest.raises(ValueError, match="unknown traffic kind"):
        bench.compose_bytes("sideways", n, 2, cols)


def test_ulp_histogram_and_agreement():
    a = torch.tensor([1.0, 1.0, -2.0, 0.5], dtype=torch.float32)
    b = torch.nextafter(a, torch.full_like(a, 10.0))  # one ulp up (toward +10)
    b[0] = a[0]
    h = bench.ulp_histogram(a, b, max_ulp=2)
    assert h == {"0": 1, "1": 3, "2": 0, ">2": 0}
    assert bench.bitwise_agreement(a, b) == 0.25


@needs_recorded
def test_norm_memory_theory_matches_the_recorded_peaks():
    """The memory model predicts the allocator's peak of every recorded norm within 0.1 MB
    (the remainder is the [d_out] outputs and allocator rounding)."""
    nt = br.norm_table(br.load_recorded()["norm"])
    assert ((nt["peak_extra_bytes"] - nt["theory_bytes"]).abs() <= 100_000).all(), nt


@needs_recorded
def test_target_status_on_recorded_run():
    status = br.target_status(br.load_recorded())
    assert set(status["verdict"]) <= {"met", "out_of_reach", "missed"}
    oor = status[status["verdict"] == "out_of_reach"]
    assert (oor["best_possible"] < oor["threshold"]).all()


def _synthetic_status(compile_fwd=(1.0, 95.0)):
    return br.target_status(_synthetic_run(compile_fwd))


def _synthetic_run(compile_fwd=(1.0, 95.0), peft_ms=3.0):
    """A made-up run: compose rows at both target shapes (compile's forward at ``compile_fwd`` = (ms, % of
    copy)), a norm and a layer row (PEFT at ``peft_ms``, ours at 1 ms, two rounds each); the copy bandwidth
    puts the 8192-token training floor at 0.5 ms."""
    rows = []
    for tokens in (8192, 16384):
        n = tokens * 8192
        for op, impl, ms, pct, nbytes in (
            ("fwd", "fused", 1.0, 95.0, 6 * n), ("fwd", "compile", *compile_fwd, 6 * n),
            ("bwd", "fused", 1.0, 85.0, 10 * n), ("bwd_autograd", "eager_autograd", 7.0, 10.0, 10 * n),
            ("train", "fused", 1.0, 40.0, 16 * n), ("train", "compile", 1.2, 40.0, 16 * n)):
            rows.append({"dtype": "bfloat16", "tokens": tokens, "d_out": 8192, "op": op, "impl": impl, "ms": ms,
                         "pct_copy": pct, "bytes": nbytes})
    norm = pd.DataFrame([{"d_out": 8192, "d_in": 8192, "rank": 384, "w_dtype": "bfloat16", "method": m,
                          "peak_extra_bytes": p, "ms": t}
                         for m, p, t in (("dense_fp32", 800, 2.0), ("factored_cached", 40, 0.5))])
    layer = pd.DataFrame([{"impl": i, "d_in": 4096, "d_out": 4096, "rank": 384, "tokens": 4096, "mode": "fwd_bwd",
                           "ms": t, "peak_extra_bytes": p, "rounds_ms": f"{t};{1.1 * t}"}
                          for i, t, p in (("dora_num", 1.0, 1), ("peft_default", peft_ms, 2))])
    copy_gbps = 16 * 8192 * 8192 / 1e9 / 0.5e-3
    return {"compose": pd.DataFrame(rows), "norm": norm, "layer": layer, "copy_gbps": copy_gbps}


def test_target_status_verdicts_on_a_synthetic_run():
    """met / out_of_reach / missed follow from the numbers (not from the recorded run)."""
    st = _synthetic_status()
    v = dict(zip(st["target"] + "@" + st["shape"], st["verdict"]))
    assert v["fwd_pct_copy@8192x8192 bf16"] == "met"
    assert v["fwd_speedup_vs_compile@8192x8192 bf16"] == "out_of_reach"  # compile at 95%: at most 1.05x
    assert v["train_speedup_vs_compile@8192x8192 bf16"] == "missed"  # 1.2x, floor would allow 2.4x
    assert v["bwd_speedup_vs_eager_autograd@8192x8192 bf16"] == "met"
    assert v["norm_mem_fraction_inverse@8192x8192 r=384 bf16"] == "met"
    assert v["layer_fwd_bwd_speedup_vs_peft@4096->4096 r=384 T=4096"] == "met"


def test_a_verdict_over_two_sessions_is_the_one_both_give_else_split():
    """The layer target met in one session (PEFT 2.5x ours) and missed in the other (1.8x) is split; the rest
    agree; the range spans both sessions; the per-round ratios of each session are its own."""
    t = br.targets_over_sessions(_synthetic_run(peft_ms=2.5), _synthetic_run(peft_ms=1.8))
    row = t[t.target == "layer_fwd_bwd_speedup_vs_peft"].iloc[0]
    assert (row.verdict_1, row.verdict_2, row.over_sessions) == ("met", "missed", "split")
    assert (row.lo, row.hi) == pytest.approx((1.8, 2.5))
    assert (t[t.target != "layer_fwd_bwd_speedup_vs_peft"].over_sessions != "split").all()
    lay = br.layer_over_sessions(_synthetic_run(peft_ms=2.5), _synthetic_run(peft_ms=1.8))
    assert lay.set_index("session").ratio.to_dict() == pytest.approx({1: 2.5, 2: 1.8})
    assert (lay.round_lo == lay.round_hi).all() and (lay.rounds == 2).all()  # both rounds 1.1x: one ratio
    other = _synthetic_run()
    other["layer"] = other["layer"].assign(tokens=2048)  # another layer shape: not the same targets
    with pytest.raises(ValueError, match="do not hold the same targets"):
        br.targets_over_sessions(_synthetic_run(), other)


def test_no_floor_rests_on_a_ceiling_a_measured_path_exceeds():
    """A path faster than the copy kernel raises the ceiling the floors are drawn from: with compile's
    forward at 102% of copy, the forward's floor is 1.0x (not 100/102) and its verdict still out of reach,
    and every pct target's best possible is the 102% the run reached."""
    st = _synthetic_status(compile_fwd=(0.95, 102.0))
    fwd = st[(st.target == "fwd_speedup_vs_compile") & (st["shape"] == "8192x8192 bf16")].iloc[0]
    assert fwd.best_possible == pytest.approx(1.0) and fwd.verdict == "out_of_reach"
    assert (st[st.target.str.endswith("pct_copy")].best_possible == 102.0).all()
    train = st[(st.target == "train_speedup_vs_compile") & (st["shape"] == "8192x8192 bf16")].iloc[0]
    assert train.best_possible == pytest.approx(1.2 / (0.5 / 1.02))  # the floor at 102% of copy, not 100%


def test_ingest_writes_provenance_with_the_gpu_device(tmp_path):
    src = tmp_path / "suite"
    src.mkdir()
    device = {"name": "NVIDIA H200", "capability": "9.0", "driver": "580"}
    (src / "device.json").write_text(json.dumps({"device": device, "git_sha": "abc", "versions": {},
                                                 "copy": {"gbps": 4000.0}, "sections": ["norm"], "smoke": True}))
    (src / "norm_bench.csv").write_text("a,b\n1,2\n")
    dest = tmp_path / "out"
    written = gpu_suite.ingest(src, dest)
    assert sorted(p.name for p in written) == ["device.json", "norm_bench.csv"]
    side = json.loads((dest / "norm_bench.csv.provenance.json").read_text())
    assert side["device"] == device and side["extra"]["measured_at_git_sha"] == "abc"
    assert side["extra"]["measured_from"] == ["suite"] and side["parameters"]["sections"] == ["norm"]
    assert (dest / "norm_bench.csv").read_text() == "a,b\n1,2\n"


def test_a_repeat_session_is_ingested_beside_the_first_never_over_it(tmp_path, monkeypatch):
    from dora_num.repro.paths import OUTPUT_ROOT_ENV
    from dora_num.studies.speed.datasets import NORM, SPEED_REPEAT

    monkeypatch.setenv(OUTPUT_ROOT_ENV, str(tmp_path / "root"))
    src = tmp_path / "suite"
    src.mkdir()
    (src / "device.json").write_text(json.dumps({"device": {"name": "NVIDIA H200"}, "git_sha": "abc", "versions": {},
                                                 "copy": {"gbps": 4000.0}, "sections": ["norm"], "smoke": False,
                                                 "repeat": True}))
    (src / NORM.filename("bench")).write_text("a,b\n1,2\n")
    written = gpu_suite.ingest(src)
    assert {p.parent for p in written} == {tmp_path / "root" / "data" / SPEED_REPEAT.folder}
    assert not (tmp_path / "root" / "data" / NORM.file("bench")).exists()
    assert gpu_suite.build_parser("dora-num gpu-suite").parse_args(["--out", "x", "--repeat"]).repeat


def test_a_session_ingested_into_its_folder_keeps_only_its_declared_files(tmp_path, monkeypatch):
    """An H100 session ingested with --out .../gpu/sessions/h100_a is that data set: its layer profile, which
    the data set does not keep, stays behind; the same folder ingested elsewhere is the H200 repeat, which
    keeps it."""
    from dora_num.repro.paths import OUTPUT_ROOT_ENV
    from dora_num.studies.speed.datasets import NORM, SPEED_H100

    monkeypatch.setenv(OUTPUT_ROOT_ENV, str(tmp_path / "root"))
    src = tmp_path / "suite"
    src.mkdir()
    (src / "device.json").write_text(json.dumps({"device": {"name": "NVIDIA H100 80GB HBM3"}, "git_sha": "abc",
                                                 "versions": {}, "copy": {"gbps": 3000.0}, "sections": ["layer"],
                                                 "smoke": False, "repeat": True}))
    (src / NORM.filename("bench")).write_text("a,b\n1,2\n")
    (src / "layer_profile.txt").write_text("a profiler table\n")
    dest = tmp_path / "root" / "data" / SPEED_H100[0].folder
    written = gpu_suite.ingest(src, dest)
    assert sorted(p.name for p in written) == ["device.json", NORM.filename("bench")]
    assert not (dest / "layer_profile.txt").exists()
    elsewhere = gpu_suite.ingest(src, tmp_path / "other")
    assert "layer_profile.txt" in {p.name for p in elsewhere}


def test_cli_registers_gpu_suite_and_its_sections(capsys):
    from dora_num.__main__ import build_parser

    args = build_parser().parse_args(["gpu-suite", "--out", "x", "--only", "norm", "--smoke"])
    assert args.command == "gpu-suite" and args.args == ["--out", "x", "--only", "norm", "--smoke"]
    suite_args = gpu_suite.build_parser("dora-num gpu-suite").parse_args(args.args)
    assert suite_args.only == ["norm"] and suite_args.smoke and suite_args.sections == gpu_suite.SECTIONS
    assert gpu_suite.build_parser("dora-num record norm", "norm").parse_args([]).sections == ("norm",)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            gpu_suite.run_suite(__import__("pathlib").Path("unused"), sections=("norm",))


def test_the_two_session_figure_is_readable_and_marks_the_split_verdict():
    import matplotlib

    matplotlib.use("Agg")
    from dora_num.repro.layout import text_problems
    from dora_num.repro.plotting import set_theme
    from dora_num.studies.speed import plots

    set_theme()
    t = br.targets_over_sessions(_synthetic_run(peft_ms=2.5), _synthetic_run(peft_ms=1.8))
    fig = plots.targets_over_sessions(t, "H200")
    assert text_problems(fig) == []
    red = [lab.get_text() for lab in fig.axes[0].get_yticklabels() if lab.get_color() == "C3"]
    assert red == ["layer_fwd_bwd_speedup_vs_peft  4096->4096 r=384 T=4096"]


@needs_recorded
def test_the_repeat_session_loads_from_its_own_folder(tmp_path):
    """A repeat record is read from data/gpu/repeat (here a copy of the first session's files under the repeat's
    names), never from the first session's folder, and a folder without it names the command that records it."""
    import shutil

    from dora_num.repro.paths import RecordedDataMissing
    from dora_num.studies.speed import datasets as D

    with pytest.raises(RecordedDataMissing, match="--repeat"):
        br.load_session(folder=tmp_path)
    for role, src in (("device", D.SUITE.path("device")), ("compose", D.COMPOSE.path("bench")),
                      ("norm", D.NORM.path("bench")), ("layer", D.LAYER.path("bench")),
                      ("profile", D.LAYER.path("profile"))):  # the H200 repeat keeps the profile
        shutil.copy(src, D.SPEED_REPEAT.path(role, tmp_path))
    rep = br.load_session(folder=tmp_path)
    assert len(rep["compose"]) and len(rep["layer"]) and rep["train_graphs"].empty
    same = br.targets_over_sessions(br.load_recorded(), rep)
    assert (same.measured_1 == same.measured_2).all() and (same.over_sessions != "split").all()


def test_the_two_session_headline_counts_a_verdict_only_where_both_sessions_give_it(tmp_path):
    """The headline's two-session statistics from the two tables notebook 05 writes (synthetic sessions: the layer
    target met in one, missed in the other): the split counted apart, the layer's range over both sessions' rounds
    per PEFT setting."""
    from dora_num.studies.speed import headline

    first, repeat = _synthetic_run(peft_ms=2.5), _synthetic_run(peft_ms=1.8)
    bf16 = {"impl": "peft_bf16_adapters", "d_in": 4096, "d_out": 4096, "rank": 384, "tokens": 4096,
            "mode": "fwd_bwd", "ms": 0.9, "peak_extra_bytes": 2, "rounds_ms": "0.9;1.0"}
    for run in (first, repeat):
        run["layer"] = pd.concat([run["layer"], pd.DataFrame([bf16])], ignore_index=True)
    out = tmp_path / "05_memory_and_speed"
    out.mkdir()
    br.targets_over_sessions(first, repeat).to_csv(out / "targets_over_sessions.csv", index=False)
    br.layer_over_sessions(first, repeat).to_csv(out / "layer_over_sessions.csv", index=False)
    s = headline.sessions(tmp_path)
    assert s["sessions_split"] == s["sessions_split_met_first"] == 1
    assert s["sessions_met"] + s["sessions_missed"] + s["sessions_out_of_reach"] + 1 == s["sessions_targets"]
    # PEFT fp32: rounds 2.5/1, 2.75/1.1 in the first session, 1.8/1, 1.98/1.1 in the second
    assert (s["sessions_layer_fp32_lo"], s["sessions_layer_fp32_hi"]) == pytest.approx((1.8, 2.5))
    assert (s["sessions_layer_bf16_lo"], s["sessions_layer_bf16_hi"]) == pytest.approx((0.9, 10 / 11))
    assert s["sessions_layer_fp32_rounds"] == 4
    line = headline.sessions_sentence(s, "H200")
    assert "1 split (1 met in the first session only)" in line and "1.8x to 2.5x" in line


def test_a_target_row_carries_the_spread_of_its_rounds():
    """A verdict read from a median keeps the range of its interleaved rounds beside it: a median at the
    threshold can hide a round below it; without per-round values the range is NaN, never invented."""
    row = br.target_row("t", "s", 2.05, 2.0, None, per_round=[1.86, 2.05, 2.11])
    assert row["verdict"] == "met" and (row["round_lo"], row["round_hi"]) == (1.86, 2.11)
    bare = br.target_row("t", "s", 2.05, 2.0, None)
    assert bare["round_lo"] != bare["round_lo"] and bare["round_hi"] != bare["round_hi"]


@needs_recorded
def test_the_layer_targets_spread_is_its_rounds_ratios():
    """The layer target's round range is round i of PEFT over round i of ours, recomputed here from the raw
    rounds of the record."""
    data = br.load_recorded()
    t = br.target_status(data)
    lay = data["layer"][data["layer"]["mode"] == "fwd_bwd"]
    for _, r in t[t.target == "layer_fwd_bwd_speedup_vs_peft"].iterrows():
        d_in, d_out, rank, tokens = (int(x) for x in re.match(r"(\d+)->(\d+) r=(\d+) T=(\d+)", r["shape"]).groups())
        sel = lay[(lay.d_in == d_in) & (lay.d_out == d_out) & (lay["rank"] == rank) & (lay.tokens == tokens)]
        peft = [float(x) for x in sel[sel.impl == "peft_default"].rounds_ms.iloc[0].split(";")]
        ours = [float(x) for x in sel[sel.impl == "dora_num"].rounds_ms.iloc[0].split(";")]
        ratios = [p / o for p, o in zip(peft, ours)]
        assert r["round_lo"] == pytest.approx(min(ratios), rel=1e-12)
        assert r["round_hi"] == pytest.approx(max(ratios), rel=1e-12)


def test_round_ratios_pair_the_interleaved_rounds_or_refuse():
    from dora_num.studies.speed.released import round_ratios

    assert list(round_ratios("2;4;9", "1;2;3")) == [2.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="must pair up: 3 against 2"):
        round_ratios("2;4;9", "1;2")
