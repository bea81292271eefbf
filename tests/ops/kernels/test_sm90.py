"""The tail kernel compiled for an H100/H200 (sm_90) on the CPU (tests/ops/kernels/sm90.py): the
interpreter, which runs it everywhere else in CI, accepts code the compiler refuses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


@pytest.fixture(scope="module")
def compiled():
    """Every case of sm90.CASES, compiled with fusion on and off, in one subprocess without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(HERE / "sm90.py")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_tail_variant_compiles_for_sm90(compiled):
    """Each variant the launchers use (guard, split, fp16 split's runtime scale, B G as an fp32 dot or on tensor
    cores from fp32 and bf16 B) compiles; the tensor-core variants hold tensor-core instructions, the fp32 dot
    none (its products are FMAs, with fusion off too)."""
    from ops.kernels.sm90 import CASES

    assert set(compiled) == set(CASES)
    for name, by_fusion in compiled.items():
        off = by_fusion["fusion_off"]
        assert (off["mma"] > 0) == CASES[name].get("tc_bg", False), (name, off)
        if not CASES[name].get("tc_bg"):
            assert off["fma.rn.f32"] > 0, (name, off)  # the IEEE fp32 dot: an FMA chain, whatever the flag
