"""The dorafactors comparison without a GPU: the carry (from a throwaway git repository standing in for the
release), the refusal of a missing or edited release, the rounds and ratios with a fake timer, the float64
checks on a fake release whose compose is inexact by a planted factor (our kernels under the interpreter),
the ingest with provenance; and, on a GPU with the real release carried, the smoke run."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from dora_num.repro.paths import REPO_ROOT
from dora_num.repro.provenance import read_provenance
from dora_num.repro.recording import write_machine
from dora_num.studies import cli
from dora_num.studies.speed import record_dorafactors as rd
from dora_num.studies.speed.record_carry_dorafactors import carry

# A stand-in for the release: the same API, plain torch.  Its compose is off by the factor INEXACT (what the
# float64 check must show), its norm exact then rounded to W's dtype, its layer's dispatch says "fused".
FAKE_FUSED = '''
import torch

INEXACT = 1 + 2.0**-5


def is_triton_available():
    return False


def fused_dora_compose(lora, base, mag_norm_scale, scale, inplace=True):
    m = mag_norm_scale.double()
    return (((m - 1) * base.double() + m * (scale * lora.double())) * INEXACT).to(lora.dtype)


def fused_dora_compose_autograd(lora, base, mag_norm_scale, scale):
    m = mag_norm_scale.float()
    return (((m - 1) * base.float() + m * (scale * lora.float())) * INEXACT).to(lora.dtype)
'''
FAKE_DORA = '''
import torch
from torch import nn


def _should_use_fused_backward_for_tensor(lora_out, mag_norm_scale=None):
    return True


def _use_fused_kernels():
    return True


class DoraLinearLayer(nn.Module):
    def __init__(self, fan_in_fan_out):
        super().__init__()

    @torch.no_grad()
    def _get_weight_norm_linear(self, *, base_weight, lora_A_w, lora_B_w, scaling, chunk_size=None):
        dense = base_weight.double() + scaling * (lora_B_w.double() @ lora_A_w.double())
        return torch.linalg.vector_norm(dense, dim=1).to(base_weight.dtype)

    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None):
        wn = self._get_weight_norm_linear(base_weight=base_layer.weight, lora_A_w=lora_A.weight,
                                          lora_B_w=lora_B.weight, scaling=scaling)
        mag = (self.weight / wn).view(1, -1)
        return (mag - 1) * base_result + mag * (scaling * lora_B(lora_A(x)))
'''


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args], check=True,
                   capture_output=True)


def fake_repository(path, fused=FAKE_FUSED, dora=FAKE_DORA):
    """A git repository with the release's two files where the release has them, tagged, then changed
    on top of the tag (so a carry that read the work tree or HEAD would be seen)."""
    d = path / rd.RELEASE_DIR
    d.mkdir(parents=True)
    _git(path, "init", "-q")
    (d / "dora_fused.py").write_text(fused)
    (d / "dora.py").write_text(dora)
    _git(path, "add", ".")
    _git(path, "commit", "-q", "-m", "release")
    _git(path, "tag", rd.RELEASE_TAG)
    (d / "dora.py").write_text(dora + "\nAFTER_THE_TAG = True\n")
    _git(path, "commit", "-q", "-am", "after")
    return path


@pytest.fixture
def fake_release(tmp_path):
    dst = carry(fake_repository(tmp_path / "repo"), tmp_path / "carry")
    yield dst
    for name in rd.RELEASE_MODULES.values():  # the loader registers them by name: leave none behind
        sys.modules.pop(name, None)


def test_carry_writes_the_files_at_the_tag_with_their_commit(tmp_path):
    repo = fake_repository(tmp_path / "repo")
    dst = tmp_path / "carry"
    assert cli.run("carry-dorafactors", [str(dst), "--from", str(repo)]) == 0
    tagged = subprocess.run(["git", "-C", str(repo), "rev-parse", rd.RELEASE_TAG], capture_output=True,
                            text=True, check=True).stdout.strip()
    version = json.loads((dst / rd.VERSION_FILE).read_text())
    assert version["commit"] == tagged and version["tag"] == rd.RELEASE_TAG
    assert (dst / "dora.py").read_text() == FAKE_DORA and (dst / "dora_fused.py").read_text() == FAKE_FUSED
    assert sorted(p.name for p in dst.iterdir()) == sorted([*rd.RELEASE_MODULES, rd.VERSION_FILE])
    assert rd.check_carry(dst) == version
    with pytest.raises(SystemExit, match="has no commit 'v9'"):
        cli.run("carry-dorafactors", [str(tmp_path / "c2"), "--from", str(repo), "--rev", "v9"])
    with pytest.raises(SystemExit, match="no such folder"):
        cli.run("carry-dorafactors", [str(tmp_path / "c3"), "--from", str(tmp_path / "nowhere")])


def test_the_recorder_names_a_missing_or_edited_release_before_asking_for_the_gpu(tmp_path, fake_release):
    out = tmp_path / "out"
    missing = tmp_path / "none"
    with pytest.raises(SystemExit, match=f"no dorafactors release at {missing}: carry it first.*carry-dorafactors"):
        cli.run("dorafactors", ["--out", str(out), "--dorafactors", str(missing)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="has no VERSION"):
        cli.run("dorafactors", ["--out", str(out), "--dorafactors", str(tmp_path / "empty")])
    (fake_release / "dora.py").write_text(FAKE_DORA + "# edited\n")
    with pytest.raises(SystemExit, match="dora.py is not the file carried"):
        cli.run("dorafactors", ["--out", str(out), "--dorafactors", str(fake_release)])
    assert not out.exists()


def _fake_case(times, reset=None):
    """A case of three implementations ``a`` (ours), ``b``, ``c``; each returns its name, so that the fake
    timer knows whom it times; ``times[name][round]`` is what the timer reports."""
    impls = {n: (lambda n=n: n) for n in ("a", "b", "c")}
    return rd.Case("op", {"d_out": 8}, "a", impls, {"b": {"path": "theirs"}}, reset)


def _timer(times, calls):
    def timer(fn):
        name = fn()
        k = sum(1 for c in calls if c == name)
        calls.append(name)
        return times[name][k]
    return timer


def test_rounds_rotate_and_ratios_are_taken_within_each_round():
    times = {"a": [1.0, 10.0, 1.0], "b": [2.0, 20.0, 2.2], "c": [0.5, 5.0, 0.6]}
    calls, resets = [], []
    case = _fake_case(times, reset=lambda: resets.append(1))
    ms = rd.time_rounds(case, 3, _timer(times, calls))
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"] and len(resets) == 9
    assert ms == times
    rows = {r["impl"]: r for r in rd.case_rows(case, ms)}
    # b's medians are 2.2 / 1.0, but within every round b took 2x ours, once 2.2x: the median ratio is 2
    assert rows["b"]["ratio_to_ours"] == pytest.approx(2.0) and rows["b"]["ms"] == 2.2
    assert rows["c"]["ratio_to_ours"] == pytest.approx(0.5) and rows["a"]["ratio_to_ours"] == 1.0
    assert rows["b"]["rounds_ms"] == "2.0000;20.0000;2.2000" and rows["b"]["ratio_rounds"] == "2.0000;2.0000;2.2000"
    assert rows["b"]["path"] == "theirs" and rows["b"]["ours"] == "a" and rows["b"]["rounds"] == 3
    with pytest.raises(ValueError, match="ours .'z'. is not among"):
        rd.time_rounds(rd.Case("op", {}, "z", case.impls), 1, _timer(times, []))


def test_a_failing_configuration_is_recorded_and_the_run_goes_on():
    times = {n: [1.0, 2.0] for n in "abc"}

    def broken():
        raise RuntimeError("their kernel failed")

    saved = []
    rows = rd.measure([("x", {"d_out": 8}, broken), ("y", {"d_out": 8}, lambda: [_fake_case(times)])], 2,
                      _timer(times, []), log=lambda m: None, checkpoint=lambda rs: saved.append(len(rs)))
    assert rows[0] == {"op": "x", "impl": "error", "d_out": 8, "error": "RuntimeError: their kernel failed"}
    assert [r["impl"] for r in rows[1:]] == ["a", "b", "c"] and saved == [1, 4]


@pytest.mark.interpreter
def test_every_implementation_is_checked_against_float64(fake_release):
    R = rd.load_release(fake_release)
    assert R.dora_error is None and R.version["files"]["dora.py"]["path"].endswith("lora/dora.py")
    shapes = dict(compose=((16, 64),), norm=((64, 96, 4),), layer=((96, 64, 4, 16),))
    rows = rd.measure(rd.builders(R, shapes, "cpu"), 2, lambda fn: (fn(), 1.0)[1], log=lambda m: None)
    df = pd.DataFrame(rows)
    assert "error" not in df.columns or df["error"].isna().all(), df.get("error")
    by = {(r.op, r.impl): r for r in df.itertuples()}
    assert sorted(by) == sorted([*((op, i) for op in ("compose_fwd", "compose_train")
                                   for i in ("dorafactors_fused", "dora_num_fused", "eager_torch")),
                                 *(("row_norm", i) for i in ("dorafactors_factored", "dora_num_factored",
                                                             "dora_num_factored_cached", "dense_fp32")),
                                 *((op, i) for op in ("layer_fwd", "layer_fwd_bwd")
                                   for i in ("dorafactors_layer", "dora_num_layer"))])
    assert (df["ratio_to_ours"] == 1.0).all()  # a constant timer: every implementation as fast as ours
    # the planted inexactness shows: 2^-5 of the output, up to one rounding to bf16 (u = 2^-8, on its own
    # inputs); ours: within one rounding to bf16, which the interpreter's store truncates (2^-7)
    theirs, ours = by["compose_fwd", "dorafactors_fused"], by["compose_fwd", "dora_num_fused"]
    assert abs(theirs.err_out_own_inputs - 2.0**-5) <= 2.0**-8 * (1 + 2.0**-5) and ours.err_out_own_inputs <= 2.0**-7
    assert theirs.g_dtype == "bfloat16" and ours.g_dtype == "float32" and theirs.path == "torch_fallback"
    # against the fp32 g, their bf16 g adds at most 2^-8 of |s lora + base| (about twice the output): still seen
    assert by["compose_train", "dorafactors_fused"].err_out > 2.0**-6 >= by["compose_train", "dora_num_fused"].err_out
    # their norm is returned in W's dtype: bf16's rounding shows, ours stays at fp32's
    nt, no = by["row_norm", "dorafactors_factored"], by["row_norm", "dora_num_factored"]
    assert nt.out_dtype == "bfloat16" and 0 < nt.err_norm <= 2.0**-8
    assert no.out_dtype == "float32" and no.err_norm < 1e-5
    # the layer: every output and gradient checked, the path as their dispatch says
    lt = by["layer_fwd_bwd", "dorafactors_layer"]
    for col in ("err_y", "err_dx", "err_dA", "err_dB", "err_dm"):
        assert 0 < getattr(lt, col) < 2.0**-5 and 0 < getattr(by["layer_fwd_bwd", "dora_num_layer"], col) < 2.0**-5, col
    # (their inference dispatch also asks for CUDA tensors, as theirs does: on the CPU, eager)
    assert lt.path == "fused_autograd" and by["layer_fwd", "dorafactors_layer"].path == "eager_inplace"
    assert (lt.m_dtype, lt.ab_dtype, lt.w_dtype, lt.act_dtype) == ("bfloat16",) * 4


def test_ingest_records_the_gpu_and_the_release_commit(tmp_path):
    src = tmp_path / "run"
    times = {n: [1.0, 2.0] for n in "abc"}
    rows = rd.measure([("op", {"d_out": 8}, lambda: [_fake_case(times)])], 2, _timer(times, []), log=lambda m: None)
    src.mkdir()
    pd.DataFrame(rows).to_csv(rd.DORAFACTORS.path(folder=src), index=False)
    version = {"repo": rd.RELEASE_REPO, "tag": rd.RELEASE_TAG, "commit": "d0fb577", "files": {}}
    write_machine(src, {"device": {"cuda": True, "name": "NVIDIA H100 80GB HBM3"}, "git_sha": "abc",
                        "dorafactors": version, "rounds": 2, "smoke": True})
    out = rd.ingest(src, tmp_path / "data")
    prov = read_provenance(out)
    assert prov["device"]["name"] == "NVIDIA H100 80GB HBM3" and prov["extra"]["measured_at_git_sha"] == "abc"
    assert prov["extra"]["dorafactors"]["commit"] == "d0fb577" and prov["producer"] == "dora-num record dorafactors"
    back = pd.read_csv(out)
    assert back[["impl", "ratio_to_ours"]].values.tolist() == [["a", 1.0], ["b", 1.0], ["c", 1.0]]
    assert list(rd.summary(back).columns) == ["op", "d_out", "impl", "ms", "ratio_to_ours"]


@pytest.mark.gpu
def test_smoke_run_on_the_gpu_with_the_carried_release(tmp_path):
    release = REPO_ROOT / rd.CARRY_DIR
    if not release.is_dir():
        pytest.skip(f"no {rd.CARRY_DIR} (carry it: dora-num record carry-dorafactors {rd.CARRY_DIR} --from GIT_DIR)")
    res = subprocess.run([sys.executable, "-m", "dora_num", "record", "dorafactors", "--out", str(tmp_path),
                          "--dorafactors", str(release), "--smoke"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=540)
    assert res.returncode == 0, res.stderr[-3000:]
    df = pd.read_csv(rd.DORAFACTORS.path(folder=tmp_path))
    assert "error" not in df.columns or df["error"].isna().all(), df["error"].dropna().tolist()
    assert set(df["op"]) == {"compose_fwd", "compose_train", "row_norm", "layer_fwd", "layer_fwd_bwd"}
    ours = df[df["impl"] == df["ours"]]
    assert (ours["ratio_to_ours"] == 1.0).all() and len(ours) == 5
    # ours on the GPU: the compose within one rounding to bf16 (u = 2^-8) of float64, the norm at fp32's level
    assert (df.loc[df["impl"] == "dora_num_fused", "err_out"] <= 2.0**-8 * (1 + 2.0**-7)).all()
    assert (df.loc[df["impl"] == "dora_num_factored", "err_norm"] < 1e-5).all()
    assert json.loads((tmp_path / "device.json").read_text())["dorafactors"]["tag"] == rd.RELEASE_TAG
