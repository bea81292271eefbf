"""The recorded data of notebook 01 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

_EXPORT = "adapters/trained/exported/r16_lr0.001/"  # the committed export (runs.EXPORTS up to runs.COMMIT_MAX_RANK)
TRAINED = DataSet("trained-adapters", {
    **{role: f"adapters/trained/{f}" for role, f in (
        ("manifest", "manifest.json"), ("evals", "evals.csv"), ("history_windows", "history_windows.csv"),
        ("collapse", "collapse.csv.gz"), ("g_final", "g_final.npz"), ("crosscheck", "crosscheck.csv"))},
    "export_config": _EXPORT + "adapter_config.json", "export_weights": _EXPORT + "adapter_model.safetensors",
    "export_capture": _EXPORT + "final_capture.npz"},
    recorder="adapters-gpu --base .carry/minilm", notebooks=("01", "02"),
    module="dora_num.studies.cancellation.record_trained",
    about="GPU: MiniLM DoRA trained until MRR@10 plateaus, g captured over training (01, 02)")
# The seeds plan's record (studies/cancellation/seeds.py): seeds 1 to 3 of the grid, seed 0 from TRAINED.
TRAINED_SEEDS = DataSet("trained-adapters-seeds", {
    role: f"adapters/trained_seeds/{f}" for role, f in (
        ("manifest", "manifest.json"), ("stats", "stats.csv.xz"), ("evals", "evals.csv"))},
    recorder="adapters-gpu --plan seeds --seeds K --base .carry/minilm --wall-s 500 (one seed a call: "
             ".ci/gpu/session.sh seed), then --ingest DIR DIR", notebooks=("01",))
AGREEMENT = DataSet("agreement", {"runs": "adapters/agreement.csv"}, recorder="adapters --agreement-only",
                    where="the CPU, a few minutes on 2 cores", ingest=False, notebooks=("01",),
                    module="dora_num.studies.cancellation.record_adapters",
                    about="CPU: the PEFT agreement runs (and the early-training MiniLM DoRA adapters) (01)")
PAPER_SHAPE = DataSet("paper-shape", {"at_g1": "01_cancellation_at_g1/paper_benchmark_g1_paper_shape.csv"},
                      recorder="notebook 01 with RECOMPUTE_PAPER_SHAPE=True", where="the CPU, about 3 min on 2 cores",
                      notebooks=("01",))

DATASETS = (TRAINED, TRAINED_SEEDS, AGREEMENT, PAPER_SHAPE)
