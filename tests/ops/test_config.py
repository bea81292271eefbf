"""The operator configuration (:mod:`dora_num.ops.config`): the environment read once and
validated, ``override()`` local to its thread, nested, undone on exceptions, ``reload()``."""

import os
import subprocess
import sys
import threading

import pytest

from dora_num.ops.config import ComposeTiles, NormTailTiles, OpConfig, RowSumsqTiles, from_env, get_config, override, reload


@pytest.mark.parametrize("name,value", [("DORA_NUM_COMPOSE_PATH", "turbo"), ("DORA_NUM_NORM_TAIL", "cuda"),
                                        ("DORA_NUM_FOLD_OUTPUT_ADD", "2"), ("DORA_NUM_DG_TWO_LAUNCH", "maybe"),
                                        ("DORA_NUM_RECOMPUTE_INNER", "-1"), ("TRITON_INTERPRET", "yes please"),
                                        ("DORA_NUM_TAIL_BG", "cuda_cores")])
def test_invalid_environment_names_the_variable(name, value):
    with pytest.raises(ValueError, match=f"environment variable {name} must be") as e:
        from_env({name: value})
    assert repr(value) in str(e.value)


def test_environment_values():
    env = {"DORA_NUM_COMPOSE_PATH": " Eager ", "DORA_NUM_NORM_TAIL": "torch", "DORA_NUM_FOLD_OUTPUT_ADD": "0",
           "DORA_NUM_DG_TWO_LAUNCH": "true", "DORA_NUM_RECOMPUTE_INNER": "off", "TRITON_INTERPRET": "1"}
    c = from_env(env)
    assert (c.compose_path, c.norm_tail, c.fold_output_add, c.dg_stage2_in_kernel, c.recompute_inner,
            c.interpret) == ("eager", "torch", False, False, False, True)
    assert c.compose_tiles == ComposeTiles.for_interpreter()
    d = from_env({})
    assert d == OpConfig() and d.compose_tiles == ComposeTiles() and d.norm_tail_tiles == NormTailTiles()
    assert d.row_sumsq_tiles == RowSumsqTiles() == RowSumsqTiles(block_m=8, block_k=512, num_warps=4)


def test_fields_are_validated_and_named():
    for kw, match in [({"compose_path": "x"}, "compose_path"), ({"norm_tail": "x"}, "norm_tail"),
                      ({"finite_check": "x"}, "finite_check"), ({"poison": 1}, "poison"),
                      ({"compose_tiles": (1, 2)}, "compose_tiles"), ({"norm_tail_tiles": None}, "norm_tail_tiles"),
                      ({"row_sumsq_tiles": NormTailTiles()}, "row_sumsq_tiles must be a RowSumsqTiles")]:
        with pytest.raises((ValueError, TypeError), match=match):
            OpConfig(**kw)
    with pytest.raises(ValueError, match="ComposeTiles.bwd_block_m must be a positive int"):
        ComposeTiles(bwd_block_m=0)
    with pytest.raises(ValueError, match="NormTailTiles.block_r must be a positive int"):
        NormTailTiles(block_r=True)
    with pytest.raises(ValueError, match="RowSumsqTiles.block_k must be a positive int"):
        RowSumsqTiles(block_k=0)
    with pytest.raises(ValueError, match="RowSumsqTiles.block_m must be a power of two, got 12"):
        RowSumsqTiles(block_m=12)
    with pytest.raises(ValueError, match="RowSumsqTiles.num_warps must be a power of two, got 3"):
        RowSumsqTiles(num_warps=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_switch'"):
        with override(no_such_switch=True):
            pass
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        with override(interpret=not get_config().interpret):
            pass


def test_key_round_trips():
    c = OpConfig(norm_tail="torch", compose_tiles=ComposeTiles(bwd_block_m=16), poison=True,
                 row_sumsq_tiles=RowSumsqTiles(block_m=16, block_k=128, num_warps=8))
    assert OpConfig.from_key(c.key) == c and OpConfig.from_key(c.key).key == c.key
    assert c.key != OpConfig().key
    # the row sums' tiles alone make another key (a compiled graph holding it is another graph)
    assert OpConfig(row_sumsq_tiles=RowSumsqTiles(block_k=256)).key != OpConfig().key


def test_override_nests_and_restores_also_after_an_exception():
    before = get_config()
    with override(norm_tail="torch") as outer:
        assert get_config() is outer and outer.norm_tail == "torch"
        with override(fold_output_add=False) as inner:
            assert get_config() is inner
            assert (inner.norm_tail, inner.fold_output_add) == ("torch", False)  # composes with the outer one
        assert get_config() is outer
        with pytest.raises(RuntimeError, match="boom"):
            with override(recompute_inner=False):
                raise RuntimeError("boom")
        assert get_config() is outer
    assert get_config() is before


def test_override_is_local_to_its_thread():
    """Two threads, each under its own override, see only their own (the main thread neither)."""
    barrier = threading.Barrier(2)
    seen, errors = {}, []

    def worker(name, tail):
        try:
            with override(norm_tail=tail):
                barrier.wait(timeout=10)  # both overrides are in force now
                seen[name] = get_config().norm_tail
                barrier.wait(timeout=10)
            seen[name + "/after"] = get_config().norm_tail
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    main_before = get_config().norm_tail
    threads = [threading.Thread(target=worker, args=("a", "torch")), threading.Thread(target=worker, args=("b", "triton"))]
    with override(norm_tail="auto"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert get_config().norm_tail == "auto"
    assert not errors
    assert seen["a"] == "torch" and seen["b"] == "triton"
    assert seen["a/after"] == seen["b/after"] == main_before  # a new thread starts at the process default


def test_reload_reads_the_environment_again(monkeypatch):
    reload()
    base = get_config()
    try:
        monkeypatch.setenv("DORA_NUM_NORM_TAIL", "torch")
        assert get_config().norm_tail == base.norm_tail  # read once: a later change is not seen ...
        with override(fold_output_add=False) as snapshot:
            assert reload().norm_tail == "torch"  # ... until reload(); an override in force is a snapshot of
            assert get_config() is snapshot and snapshot.norm_tail == base.norm_tail  # the config it was entered in
        assert get_config().norm_tail == "torch"
        monkeypatch.setenv("DORA_NUM_NORM_TAIL", "fast")
        with pytest.raises(ValueError, match="DORA_NUM_NORM_TAIL"):
            reload()
    finally:
        monkeypatch.undo()
        reload()
    assert get_config() == base


def test_a_variable_set_after_import_before_first_use_is_honoured():
    """In a fresh process: set after ``import dora_num`` (nothing has read the configuration
    yet), the variable is what the first operator call sees."""
    code = ("import os, torch, dora_num\n"
            "os.environ['DORA_NUM_NORM_TAIL'] = 'torch'\n"
            "os.environ['DORA_NUM_FOLD_OUTPUT_ADD'] = '0'\n"
            "from dora_num.ops.config import get_config\n"
            "layer = dora_num.DoRALinear(torch.nn.Linear(4, 4), 2)\n"
            "c = get_config()\n"
            "print(c.norm_tail, c.fold_output_add)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DORA_NUM_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "False"]



def test_the_first_eager_read_does_not_recompile_a_traced_graph():
    """A graph traced before any eager call of the operator stays valid after the first eager
    ``get_config()`` builds the default from the environment (an equal configuration is not swapped in,
    and the trace reads no flag that the first eager read flips): no recompile.  In a fresh process,
    where no eager call ran yet."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from torch._dynamo.utils import counters\n"
        "from dora_num.ops import config\n"
        "f = torch.compile(lambda x: x * (2.0 if config.get_config().norm_tail == 'auto' else 3.0),"
        " backend='eager')\n"
        "x = torch.ones(3)\n"
        "f(x)\n"
        "assert not config._read_at_first_use\n"
        "config.get_config()\n"
        "assert config._read_at_first_use\n"
        "f(x)\n"
        "print(counters['stats']['unique_graphs'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "1", out.stdout + out.stderr
