"""The model-level section (:mod:`dora_num.studies.speed.record_model`) on the CPU at tiny sizes:
its files and columns, the adapter shim, the fidelity check (and that it can fail), the
prediction model's ordering; on the GPU a training step of the accelerated model through the
public API under ``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from dora_num.studies.speed import model_variants as mv
from dora_num.studies.speed import record_model as mb

TINY = mv.Shape(hidden=32, intermediate=64, heads=2, kv_heads=1, layers=1, tokens=16, vocab=64)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    summary = mb.run(out, smoke=True, device="cpu", ranks=(4,), rounds=1, reps=1, shape=TINY, checkpointing=(False,))
    import json

    (out / "device.json").write_text(json.dumps(mb.describe("cpu", True), default=str))
    return out, summary


def test_smoke_run_writes_tidy_tables(smoke_run):
    out, summary = smoke_run
    bench = pd.read_csv(out / "model_bench.csv")
    assert set(bench.variant) == set(mv.VARIANTS)
    assert len(bench) == len(mv.VARIANTS) * len(mv.MODES)  # (checkpointing: test below)
    assert (bench.ms > 0).all() and bench.rounds_ms.notna().all()
    preds = pd.read_csv(out / "model_predictions.csv")
    assert {"rank", "checkpointing", "variant", "predicted_ms"} <= set(preds.columns)
    probe = pd.read_csv(out / "model_probe.csv")
    assert set(probe.what) >= {"dora_linear_fwd_bwd", "lora_linear_fwd_bwd"}
    assert summary["shape"]["hidden"] == TINY.hidden


def test_checkpointed_rows_are_the_training_modes():
    rows, _ = mb.bench_rank(TINY, 4, "cpu", rounds=1, reps=1, variants=("dora_num_fp32", "peft_fp32"),
                            checkpointing=(True,))
    assert {(r["variant"], r["mode"]) for r in rows} == {(v, m) for v in ("dora_num_fp32", "peft_fp32")
                                                         for m in ("train", "train_opt")}
    assert all(r["checkpointing"] for r in rows)


def test_dora_num_is_faithful_and_the_check_can_fail(smoke_run):
    out, _ = smoke_run
    fid = pd.read_csv(out / "model_agreement.csv")
    small = fid[fid.scope == "small_vs_fp64"].set_index("variant")
    assert bool(small.loc["dora_num_fp32", "faithful"]) and bool(small.loc["dora_num_bf16", "faithful"])
    assert not bool(small.loc["no_adapter", "faithful"])  # ignoring the adapter is detected
    full = fid[fid.scope == "full_vs_peft"].set_index("variant")
    assert full.loc["dora_num_fp32", "logits_rms_rel_err"] < full.loc["frozen", "logits_rms_rel_err"]


def test_accelerate_shares_peft_parameters_and_their_dtypes():
    from dora_num.peft import DoRAKernelVariant

    base = mv.build_base(TINY, "cpu")
    state = mv.adapter_state(base, 4)
    peft = mv.make_variant("peft_fp32", base, 4, state)
    ours = mv.make_variant("dora_num_fp32", base, 4, state)
    served = [(m, m.lora_variant["default"]) for m in ours.modules()
              if isinstance(getattr(m, "lora_variant", {}).get("default"), DoRAKernelVariant)]
    assert len(served) == len(mv.TARGET_MODULES) * TINY.layers
    for mod, v in served:  # the DoRALinear holds PEFT's own parameter objects, dtypes kept
        lyr = v._bind(mod, "default")
        assert lyr.lora_A is mod.lora_A["default"].weight and lyr.magnitude is mod.lora_magnitude_vector["default"].weight
        assert lyr.lora_A.dtype == torch.float32 and lyr.magnitude.dtype == torch.float32
        assert lyr.base.weight.dtype == torch.bfloat16
    trainable = {id(p) for p in ours.parameters() if p.requires_grad}
    assert len(trainable) == 3 * len(served)
    q_ours = ours.base_model.model.model.layers[0].self_attn.q_proj
    q = peft.base_model.model.model.layers[0].self_attn.q_proj
    torch.testing.assert_close(q_ours.lora_B["default"].weight.detach(), q.lora_B["default"].weight.detach(),
                               rtol=0, atol=0)


def test_prediction_orders_the_variants():
    for ckpt in (False, True):
        p = mv.predict(mv.FULL, 384, ckpt)
        assert p["frozen"] < p["lora_fp32"] < p["dora_num_fp32"] < p["peft_fp32"]
    assert mv.predict(mv.FULL, 64, True)["frozen"] > mv.predict(mv.FULL, 64, False)["frozen"]


@pytest.mark.gpu
def test_accelerated_training_step_has_no_sync():
    """A training step (forward, backward, AdamW) of DoRALinear layers through the public API,
    fp32 adapters on a bf16 base under autocast, under the sync debug mode's "error"; the
    deferred finiteness checks then read clean."""
    import dora_num as dn
    from dora_num.ops.finite import check_pending

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(dn.DoRALinear(torch.nn.Linear(512, 512, bias=False).cuda().bfloat16(), 16)
                                 for _ in range(3))
    for layer in layers:
        layer.lora_A = torch.nn.Parameter(layer.lora_A.detach().float())
        layer.lora_B = torch.nn.Parameter(1e-3 * torch.randn(512, 16, device="cuda"))
        layer.magnitude = torch.nn.Parameter(layer.magnitude.detach().float())
    opt = torch.optim.AdamW([p for p in layers.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        h = x
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for layer in layers:
                h = torch.nn.functional.gelu(layer(h))
            loss = h.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_pending()
    assert torch.isfinite(loss).item()


def test_report_tables_plot_and_verdicts(smoke_run):
    """The notebook's functions on the smoke run, and the verdict logic on hand-made rows:
    met, out of reach (the same run's floor below the threshold) and missed."""
    import matplotlib

    matplotlib.use("Agg")
    from dora_num.studies.speed import model_report as mr

    out, _ = smoke_run
    data = mr.load_model(out)
    mt = mr.model_table(data["bench"], data["predictions"])
    peft_rows = mt[mt.variant == "peft_fp32"]
    assert (peft_rows.speedup_vs_peft_fp32 == 1.0).all()
    mr.plot_model(mt)
    assert set(mr.model_targets(data).verdict) <= {"not_recorded", "met", "out_of_reach", "missed"}
    assert set(mr.model_targets(None).verdict) == {"not_recorded"}
    rows = []
    for v, t_plain, t_ckpt, peak in (("peft_fp32", 100.0, 150.0, 4e9), ("dora_num_fp32", 50.0, 90.0, 2e9),
                                     ("lora_fp32", 40.0, 60.0, 1.5e9), ("frozen", 30.0, 45.0, 1e9)):
        for r in (64, 384):
            rows.append({"variant": v, "rank": r, "checkpointing": False, "mode": "train", "ms": t_plain,
                         "peak_extra_bytes": peak})
            rows.append({"variant": v, "rank": r, "checkpointing": True, "mode": "train", "ms": t_ckpt,
                         "peak_extra_bytes": peak})
            rows.append({"variant": v, "rank": r, "checkpointing": False, "mode": "infer_cold",
                         "ms": t_plain / (1.0 if v != "peft_fp32" else 1.5), "peak_extra_bytes": peak})
            rows.append({"variant": v, "rank": r, "checkpointing": False, "mode": "infer",
                         "ms": t_plain, "peak_extra_bytes": peak})
    st = mr.model_targets({"bench": pd.DataFrame(rows), "probe": pd.DataFrame()}).set_index(["target", "shape"])
    assert st.loc[("model_train_speedup_vs_peft", "r=384"), "verdict"] == "met"  # 2.0 >= 1.8
    assert st.loc[("model_train_speedup_vs_peft", "r=384 ckpt"), "verdict"] == "missed"  # 1.67, floor 2.5
    assert st.loc[("model_infer_speedup_vs_peft", "r=384"), "verdict"] == "out_of_reach"  # 1.33; floor 66.7 / 40 = 1.67 < 2
    assert st.loc[("model_peak_memory_inverse_vs_peft", "r=64 ckpt"), "verdict"] == "met"  # 4 GB / 2 GB >= 1/0.6


def _as_recorded(smoke_run, tmp_path, **model):
    """The smoke run's files in a folder whose ``device.json`` reads as a full run (``model``: the
    run summary's fields; none: a suite folder, which has no summary)."""
    import json
    import shutil

    out, summary = smoke_run
    folder = tmp_path / "run"
    shutil.copytree(out, folder)
    desc = dict(mb.describe("cpu", False), smoke=False)
    if model:
        desc["model"] = dict(summary, smoke=False, **model)
    (folder / "device.json").write_text(json.dumps(desc, default=str))
    return folder


def test_ingest_refuses_a_smoke_run_and_an_eager_subset(smoke_run, tmp_path):
    out, _ = smoke_run
    with pytest.raises(SystemExit, match="is a --smoke run; not recorded"):
        mb.ingest(out, tmp_path / "data")
    sub = _as_recorded(smoke_run, tmp_path, ranks=[4])
    with pytest.raises(SystemExit, match="is an eager run of .* not the suite's .* smaller table"):
        mb.ingest(sub, tmp_path / "data")
    assert not (tmp_path / "data").exists()


def test_ingest_copies_the_model_files_with_provenance(smoke_run, tmp_path):
    import json

    out = _as_recorded(smoke_run, tmp_path)
    written = mb.ingest(out, tmp_path)
    assert sorted(p.name for p in written) == sorted(f.rsplit("/", 1)[1] for f in mb.MODEL.files)
    side = json.loads((tmp_path / "model_bench.csv.provenance.json").read_text())
    assert side["producer"] and side["sha256"]
    assert not (tmp_path / "device.json").exists()


def test_record_model_ingest_leaves_the_suites_device_json(smoke_run, tmp_path):
    """``dora-num record model --ingest DIR`` writes the model files only: ``data/gpu/device.json``
    is the suite's, whose copy bandwidth the other sections' percentages are taken against."""
    from dora_num.studies.cli import run

    out = _as_recorded(smoke_run, tmp_path)
    (tmp_path / "device.json").write_text('{"suite": true}\n')
    assert run("model", ["--ingest", str(out), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "device.json").read_text() == '{"suite": true}\n'
    assert all((tmp_path / f).exists() for f in (g.rsplit("/", 1)[1] for g in mb.MODEL.files))


def test_the_g_error_of_each_path():
    """The g error of each path against float64 (the matrix's g rows; aot_eager on the CPU: the graphs
    Inductor would get): this operator's compiled g is its eager g, bit for bit, and within a few fp32
    roundings of float64; PEFT's (its norm of W + s lora_B(lora_A(I)) under bf16 autocast) is bf16-limited."""
    base = mv.build_base(TINY, "cpu")
    state = mv.adapter_state(base, 4)
    g = pd.DataFrame(mb.g_error_rows(base, 4, state, "cpu", backend="aot_eager")).pivot_table(
        index="shape", columns="what", values="value")
    assert (g["dora_num_compiled"] == g["dora_num_eager"]).all()
    assert (g["dora_num_eager"] < 8 * 2.0**-24).all()
    assert (g["peft_eager"] > g["dora_num_eager"]).all()


def test_matrix_part_interleaves_every_variant_and_mode(tmp_path, monkeypatch):
    """A part of the model matrix on the CPU (aot_eager, each decoder layer compiled): every variant in
    every mode, training with and without checkpointing and inference, one table; its ingest goes to
    that part's data set and refuses a run at other sizes."""
    import json

    from dora_num.repro.paths import OUTPUT_ROOT_ENV

    shape = mv.Shape(hidden=32, intermediate=64, heads=2, kv_heads=1, layers=2, tokens=16, vocab=64)
    from dora_num.studies.speed import model_report as mr

    m = tmp_path / "m" / "part1"
    summary = mb.run_matrix(m, 1, device="cpu", shape=shape, ranks=(4,), rounds=1, reps=1, backend="aot_eager")
    bench = pd.read_csv(mb.MODEL_MATRIX[0].path("bench", m))
    probe = bench[bench["error"].notna() | bench["ms"].isna()]
    assert len(probe) == 1 and probe["compile"].item() == "reduce-overhead" and bool(probe["checkpointing"].item())
    bench = bench.drop(probe.index)
    got = {(r.variant, r.compile, r.mode, bool(r.checkpointing)) for r in bench.itertuples()}
    assert got == {(v, c, m, ck) for v in mb.COMPILED_VARIANTS for c in mb.MATRIX_MODES
                   for m, ck in (("train", False), ("infer", False), ("train", True))
                   if not (ck and c == "reduce-overhead")}
    assert len(bench) == len(got) and (bench["ms"] > 0).all() and bench["regional"].all()
    g = pd.read_csv(mb.MODEL_MATRIX[0].path("g_error", m))
    assert set(g["what"]) == {"peft_eager", "peft_compiled", "dora_num_eager", "dora_num_compiled"}
    # the notebook's tables from it: one row per rank, case and mode, the costs as differences of its own ms
    data = mr.load_matrix(tmp_path / "m")
    t = mr.matrix_table(data)
    assert len(t) == 8 and set(t["compile"]) == set(mb.MATRIX_MODES)
    assert (t["dora_num_fp32_cost_ms"] == t["dora_num_fp32_ms"] - t["lora_fp32_ms"]).all()
    assert (t[t["compile"] == "eager"]["ours_over_ours_eager"] == 1.0).all()
    ge = mr.g_error_table(data)
    assert ge["ours_compiled_bitwise_eager"].all() and (ge["peft_over_ours_eager"] > 1).all()
    verdicts = mr.matrix_targets(dict(data, bench=data["bench"].assign(rank=64)))
    assert {"matrix_cost_peft_over_ours", "matrix_eager_speedup_vs_peft", "matrix_ours_eager_over_compiled",
            "matrix_peak_lora_plus_10pct_over_ours"} <= set(verdicts["target"])
    assert mr.plot_matrix(t) is not None
    # a CPU run at tiny sizes is not the data set's matrix: refused before anything is written
    (m / "device.json").write_text(json.dumps({"matrix": summary}, default=str))
    monkeypatch.setenv(OUTPUT_ROOT_ENV, str(tmp_path / "root"))
    with pytest.raises(SystemExit, match="part 1 of the matrix at other ranks, shape or modes"):
        mb.ingest(m)
    assert not (tmp_path / "root").exists()
    full = dict(summary, ranks=list(mb.MATRIX_PARTS[1]), shape=mb.asdict(mv.FULL))
    (m / "device.json").write_text(json.dumps({"matrix": full}, default=str))
    written = mb.ingest(m)
    assert {p.parent for p in written} == {tmp_path / "root" / "data" / "gpu" / "matrix" / "part1"}


def _one_layer_decoder(T: int = 96):
    """``(T, shape, base, state, ids)``: a one-layer decoder, its r = 8 adapter and ``T`` token ids (the saved
    activations' counts)."""
    shape = mv.Shape(hidden=64, intermediate=160, heads=4, kv_heads=2, layers=1, tokens=T, vocab=128)
    base = mv.build_base(shape, "cpu")
    ids = torch.randint(0, shape.vocab, (1, T), generator=torch.Generator().manual_seed(0))
    return T, shape, base, mv.adapter_state(base, 8), ids


def test_what_the_accelerated_model_saves_beyond_plain_lora():
    """What the eager training step keeps beyond plain LoRA's (docs/operator.md, "The model matrix"), counted
    by the bytes per token and dtype of each saved activation (storages with a token dimension): tensors the
    widths of k, v, gate and up's outputs (the compose keeps its base input for the gradient of m), less one
    of the hidden width.  By size alone the count cannot tell which tensors of one width these are."""
    import collections

    T, shape, base, state, ids = _one_layer_decoder()
    saved = {}
    for v in ("lora_fp32", "dora_num_fp32"):
        model = mv.make_variant(v, base, 8, state)
        seen = {}

        def pack(t):
            if T in t.shape:
                seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes() // T, t.dtype)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids, use_cache=False).loss
        saved[v] = collections.Counter(seen.values())
    proj = shape.projections()
    kv, inter = proj["k_proj"][1], proj["gate_proj"][1]
    bf = torch.bfloat16
    assert saved["dora_num_fp32"] - saved["lora_fp32"] == collections.Counter({(2 * kv, bf): 2, (2 * inter, bf): 2})
    assert saved["lora_fp32"] - saved["dora_num_fp32"] == collections.Counter({(2 * shape.hidden, bf): 1})


def test_compiled_rounds_slower_pairs_the_interleaved_rounds():
    """A compiled cell whose median is below the eager one but one of whose rounds is not is named, with its
    per-round ratios (round i over round i); a cell faster in every round is not."""
    from dora_num.studies.speed import model_report as mr

    def row(comp, rounds, ckpt=False):
        ms = sorted(rounds)[1]
        return {"variant": "dora_num_fp32", "rank": 64, "checkpointing": ckpt, "mode": "train", "compile": comp,
                "ms": ms, "rounds_ms": ";".join(map(str, rounds))}

    bench = pd.DataFrame([row("eager", [90.0, 100.0, 100.0]), row("default", [99.0, 98.0, 97.0]),
                          row("reduce-overhead", [60.0, 61.0, 62.0])])
    assert mr.compiled_rounds_slower({"bench": bench}) == {(64, False, "train", "default"): "1.10, 0.98, 0.97"}


def test_what_the_compiled_step_saves_beyond_plain_lora():
    """The same count for the compiled step (docs/operator.md): each decoder layer compiled through AOT
    autograd with Inductor's partitioner (min-cut rematerialisation), the forward graph's saved outputs with a
    token dimension; the accelerated model's exceed plain LoRA's by the base outputs of all seven projections,
    ``sum(d_out) x 2`` bytes per token in bf16."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    T, shape, base, state, ids = _one_layer_decoder()
    per_token = {}
    for v in ("lora_fp32", "dora_num_fp32"):
        saved = []

        def fw(gm, example_inputs):
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            saved.extend(n.meta["val"] for n in out if hasattr(n, "meta") and isinstance(n.meta.get("val"), torch.Tensor))
            return gm.forward

        backend = aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, ex: gm.forward,
                               partition_fn=min_cut_rematerialization_partition)
        model = mv.make_variant(v, base, 8, state)
        for layer in mv._hf(model).model.layers:
            layer.compile(backend=backend)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        per_token[v] = sum(t.numel() * t.element_size() for t in saved if T in t.shape) // T
    assert per_token["dora_num_fp32"] - per_token["lora_fp32"] == 2 * sum(d for _, d in shape.projections().values())
