"""The recorded data of notebook 04 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

CONVERGENCE = DataSet("convergence", tuple(f"gpu/convergence/{f}" for f in (
    "history.csv.gz", "evals.csv", "g_stats.csv.gz", "profile.csv", "summary.json")),
    recorder="convergence --base .carry/minilm", notebooks=("04",))

# one wave at one commit: per seed eager, fused and three eager runs with m moved by 1 ulp (the same-batch
# floor), eager seed 0 twice; one device call per seed (.ci/gpu/session.sh samebatch), merged by --ingest
SAMEBATCH = DataSet("convergence-samebatch", tuple(f"gpu/convergence_samebatch/{f}" for f in (
    "history.csv.gz", "summary.json")),
    recorder="convergence --base .carry/minilm --ulp-replicates 3 (one seed a call: .ci/gpu/session.sh "
             "samebatch), then --ingest DIR... --loss-only --out data/gpu/convergence_samebatch", notebooks=("04",))

DATASETS = (CONVERGENCE, SAMEBATCH)
