"""The kernels Inductor launches for a compiled layer, compiled for an H100/H200 (sm_90) on the CPU
(tests/ops/kernels/sm90.py): the interpreter, which runs them everywhere else in CI, accepts code the
compiler refuses, and says nothing of contraction."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def _run(*args):
    """sm90.py's JSON for ``args``, run in a subprocess without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(HERE / "sm90.py"), *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def compiled():
    """Every case of sm90.CASES, compiled with fusion on and off and as Inductor compiles it."""
    return _run()


def test_inductor_finds_what_the_tail_writes():
    """Inductor's analysis of the tail as the compiled layer launches it finds the kernel's outputs and its running
    flag written, every input read-only (unused pointers point at U, an input): no argument copied for nothing."""
    found = _run("accesses")
    assert found["writes"] == ["acc_ptr", "aux_ptr", "den_ptr", "flag_ptr", "wnorm_ptr"], found
    assert set(found["reads"]) >= {"u_ptr", "b_ptr", "gram_ptr", "base_ptr", "m_ptr", "zrow_ptr", "w_ptr", "a_ptr"}


def test_every_variant_compiles_for_sm90(compiled):
    """Each kernel Inductor launches, in each variant the launchers use, compiles (the tail: guard, split, fp16
    split's runtime scale, B G as an fp32 dot or on tensor cores from fp32 and bf16 B); the tail's tensor-core
    variants hold tensor-core instructions, its fp32 dot none (its products are FMAs, with fusion off too)."""
    from ops.kernels.sm90 import CASES

    assert set(compiled) == set(CASES)
    for name, by_fusion in compiled.items():
        if not name.startswith("tail"):
            continue
        off, tc = by_fusion["fusion_off"], CASES[name][1].get("tc_bg", False)
        assert (off["mma"] > 0) == tc, (name, off)
        if not tc:
            assert off["fma.rn.f32"] > 0, (name, off)  # the IEEE fp32 dot: an FMA chain, whatever the flag


def test_inductors_kernels_compile_to_the_same_instructions_with_fusion_on_and_off(compiled):
    """Every product that an add follows is ``mul_rn`` (``mul_rn64`` in the tail's float64 recompute), so each
    kernel as Inductor compiles it (fusion on, the default for a wrapped kernel) and as our launcher compiles it
    (fusion off) are the same instructions: no multiply left that ``ptxas`` could contract, and no FMA beyond
    the tail's fp32 dot's own chain (the same count either way)."""
    for name, c in compiled.items():
        on, off = c["fusion_on"], c["fusion_off"]
        assert on["mul.f32"] == on["mul.f64"] == 0, (name, on)
        assert on["fma.rn.f32"] == off["fma.rn.f32"] and on["fma.rn.f64"] == off["fma.rn.f64"] == 0, (name, on, off)
        assert c["same_instructions"], name


def test_kernels_compile_as_inductor_types_their_float_arguments(compiled):
    """Inductor types a wrapped kernel's float arguments float64 (Triton's launcher: float32); each kernel compiles
    so, with no multiply that could be contracted and the FMA count of our launch (the tail casts its floats to
    float32 first: a float64 ``eps`` once made its division refuse to compile)."""
    for name, c in compiled.items():
        ind, off = c["inductor"], c["fusion_off"]
        assert ind["mul.f32"] == ind["mul.f64"] == 0, (name, ind)
        assert ind["fma.rn.f32"] == off["fma.rn.f32"] and ind["fma.rn.f64"] == 0, (name, ind, off)


def test_tail_recompute_keeps_its_float64_constants(compiled):
    """The float64 recompute's margins (lemma 5'), ``1 + 2^-30``, ``1 + 2^-40``, ``1 - 2^-40`` and the exactness
    limit ``2^53 (1 - 2^-40)``, reach the PTX as float64 immediates: a Python float in fp32's normal range that
    meets no float64 operand is an fp32 constant in Triton, so each would have been 1 (or 2^53)."""
    import struct

    want = {"0d" + struct.pack(">d", x).hex().upper()
            for x in (1.0 + 2.0**-30, 1.0 + 2.0**-40, 1.0 - 2.0**-40, 2.0**53 * (1.0 - 2.0**-40))}
    for name in ("tail", "tail_fp16_split", "tail_tc_fp32_B", "tail_tc_bf16_B"):
        found = set(compiled[name]["f64_immediates"])
        assert want <= found, (name, sorted(want - found))
