"""The recorded data of notebook 04 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

CONVERGENCE = DataSet("convergence", {role: f"gpu/convergence/{f}" for role, f in (
    ("history", "history.csv.gz"), ("evals", "evals.csv"), ("g_stats", "g_stats.csv.gz"), ("profile", "profile.csv"),
    ("summary", "summary.json"))},
    recorder="convergence --base .carry/minilm", notebooks=("04",),
    module="dora_num.studies.convergence.record_convergence", about="GPU: fused vs eager training, 2000 steps x 3 seeds (04)")

DATASETS = (CONVERGENCE,)
