"""The recorded data of notebook 04 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

CONVERGENCE = DataSet("convergence", {role: f"gpu/convergence/{f}" for role, f in (
    ("history", "history.csv.xz"), ("evals", "evals.csv"), ("g_stats", "g_stats.csv.xz"), ("profile", "profile.csv"),
    ("summary", "summary.json"))},
    recorder="convergence --base .carry/minilm", notebooks=("04",),
    module="dora_num.studies.convergence.record_convergence", about="GPU: fused vs eager training, 2000 steps x 3 seeds (04)")

# one wave at one commit: per seed eager, fused and three eager runs with m moved by 1 ulp (the same-batch
# floor), eager seed 0 twice; one device call per seed (.ci/gpu/session.sh samebatch), merged by --ingest
SAMEBATCH = DataSet("convergence-samebatch", {role: f"gpu/convergence_samebatch/{CONVERGENCE.relpath(role)}"
                                               for role in ("history", "summary")},
    recorder="convergence --base .carry/minilm --ulp-replicates 3 (one seed a call: .ci/gpu/session.sh "
             "samebatch), then --ingest DIR... --loss-only --out data/gpu/convergence_samebatch", notebooks=("04",))

DATASETS = (CONVERGENCE, SAMEBATCH)
