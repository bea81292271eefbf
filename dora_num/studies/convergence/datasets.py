"""The recorded data of notebook 04 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

CONVERGENCE = DataSet("convergence", tuple(f"gpu/convergence/{f}" for f in (
    "history.csv.gz", "evals.csv", "g_stats.csv.gz", "profile.csv", "summary.json")),
    recorder="convergence --base .carry/minilm", notebooks=("04",))

DATASETS = (CONVERGENCE,)
