"""Two gloo ranks on CPU train a wrapped and a PEFT-accelerated model under DDP and FSDP2
(``fully_shard``) and match one process bit for bit (the derivation:
:mod:`dora_num.scaleout`), in a subprocess with a timeout."""

import json
import os
import subprocess
import sys
from pathlib import Path

from dora_num.scaleout import ENGINES, MODELS, STEPS

ROOT = Path(__file__).resolve().parents[1]


def test_ddp_and_fsdp2_match_one_process_bitwise(tmp_path):
    out = tmp_path / "scaleout.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "dora_num.scaleout", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(f"{m}/{e}" for m in MODELS for e in ENGINES)
    for name, r in report.items():
        assert len(r["losses"]) == STEPS and r["n_params"] == 3 * 14, name  # A, B, m of 2 x 7 linears
        assert r["losses_bitwise"], (name, r["losses"], r["losses_one_process"])
        assert r["params_bitwise"] and r["max_abs_param_change"] == 0.0, name
        c, L = r["collectives_last_step"], r["n_layers"]
        if name.endswith("fsdp2"):  # FSDP2's own schedule: per layer unit one gather for the forward, one for the
            # backward, the root once; one reduce-scatter per layer unit; the DoRA norm adds nothing
            assert c == {"c10d::_allgather_base_": 2 * L + 1, "c10d::_reduce_scatter_base_": L}, (name, c)
        else:  # DDP: gradient all-reduces only (bucketed)
            assert set(c) == {"c10d::allreduce_"}, (name, c)
    # against one process on the whole batch (one mean over 4 rows, not two over 2): rounding, reported
    print({name: r["max_abs_diff_vs_whole_batch"] for name, r in report.items()})
