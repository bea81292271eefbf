"""The recorded data of notebook 01 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

_EXPORT = "adapters/trained/exported/r16_lr0.001/"  # the committed export (trained_plan.EXPORTS up to COMMIT_MAX_RANK)
TRAINED = DataSet(
    "trained-adapters",
    tuple(f"adapters/trained/{f}" for f in ("manifest.json", "evals.csv", "history_windows.csv", "collapse.csv.gz",
                                            "g_final.npz", "crosscheck.csv"))
    + tuple(_EXPORT + f for f in ("adapter_config.json", "adapter_model.safetensors", "final_capture.npz")),
    recorder="adapters-gpu --base .carry/minilm", notebooks=("01", "02"))
AGREEMENT = DataSet("agreement", ("adapters/agreement.csv",), recorder="adapters --agreement-only",
                    where="the CPU, a few minutes on 2 cores", ingest=False, notebooks=("01",))
PAPER_SHAPE = DataSet("paper-shape", ("01_cancellation_at_g1/paper_benchmark_g1_paper_shape.csv",),
                      recorder="notebook 01 with RECOMPUTE_PAPER_SHAPE=True", where="the CPU, about 3 min on 2 cores",
                      notebooks=("01",))

DATASETS = (TRAINED, AGREEMENT, PAPER_SHAPE)
