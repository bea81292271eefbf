"""The same artifacts on "another CPU": notebook 00 (SMOKE) run twice under the pinned kernel
choice, once as on this host and once with MKL and numpy restricted to AVX2 (what they run
on a CPU without AVX-512), must give byte-identical data and figures; and without the pins,
with ATen's portable kernels (``ATEN_CPU_CAPABILITY=default``), the norms move, which shows
the comparison can see a kernel change.  The lead's full check of every notebook under these
switches is ``dora-num reproduce --check`` run with the same variables."""

import hashlib
import json

import pytest

from dora_num.repro.determinism import NATIVE_ENV
from dora_num.repro.runner import reproduce

AVX2_HOST = {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}  # numpy is pinned to AVX2 by the runner itself


def _digests(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.endswith(".provenance.json")}


def _run(tmp_path, name, monkeypatch, env):
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        (res,) = reproduce(["00"], smoke=True, build_dir=tmp_path / f"build-{name}", smoke_dir=tmp_path / name)
    return _digests(res.out_root)


@pytest.mark.slow
def test_notebook_00_bytes_do_not_depend_on_the_cpu_features(tmp_path, monkeypatch):
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    here = _run(tmp_path, "here", monkeypatch, {})
    assert any(k.endswith(".csv") for k in here) and any(k.endswith(".png") for k in here), here
    side = json.loads((tmp_path / "here" / "00_overview" / "data" / "00_overview" / "norm_agreement.csv.provenance.json")
                      .read_text())
    assert side["device"]["cpu"]["torch_capability"] == "AVX2"  # the pins reached the kernel
    assert side["device"]["cpu"]["env"]["MKL_CBWR"] == "COMPATIBLE"  # the one branch Intel and AMD both run
    other = _run(tmp_path, "avx2-host", monkeypatch, AVX2_HOST)
    assert other == here, sorted(k for k in here if here[k] != other.get(k))
    portable = _run(tmp_path, "unpinned-default", monkeypatch, {NATIVE_ENV: "1", "ATEN_CPU_CAPABILITY": "default"})
    moved = sorted(k for k in here if here[k] != portable.get(k))
    assert "data/00_overview/norm_agreement.csv" in moved, moved
