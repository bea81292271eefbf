"""The recorded data of notebook 06 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

MEMORY = DataSet("memory", {"peaks": "gpu/memory/memory_peaks.csv"}, recorder="memory --base .carry/minilm",
                 notebooks=("06",), module="dora_num.studies.gradient.record_memory",
                 about="GPU: peak memory of training steps against the memory model (06)")
# the memory model out of sample (studies/gradient/memory_holdout.py): its predictions registered on the
# CPU before any measurement, then the same configurations measured on one GPU
MEMORY_HOLDOUT_PREDICTIONS = DataSet(
    "memory-holdout-predictions", {"predictions": "gpu/memory/memory_holdout_predictions.csv"},
    recorder="memory --predict-holdout", where="the CPU, a second", ingest=False)
MEMORY_HOLDOUT = DataSet("memory-holdout", {"measured": "gpu/memory/memory_holdout.csv"},
                         recorder="memory --holdout --base .carry/minilm", where="one H100 or H200, under 2 minutes",
                         notebooks=("06",))

# the same registered configurations measured again after the harness was fixed (record_memory.measure_peak: every
# thread's pending flags read before the baseline, fp16 AdamW's eps), against the same registered predictions
MEMORY_HOLDOUT_RERUN = DataSet("memory-holdout-rerun", {"measured": "gpu/memory/rerun/memory_holdout.csv"},
                               recorder="memory --holdout --base .carry/minilm (ingest: --ingest DIR --out "
                               "data/gpu/memory/rerun)", where="one H100 or H200, under 2 minutes", notebooks=("06",))

# dg on the MiniLM capture (dg_accuracy.capture_minilm): float64 training on the CPU, whose last bits still follow
# the CPU model under the pinned kernels (an Intel Xeon against the AMD EPYC record: 25 values in 20 of 144 rows,
# counts by one, rel_err_norm by at most 4.4e-7 of itself, cosine by 2e-16), so the table is read from its record
DG_MINILM = DataSet("dg-minilm", {"table": "06_gradient_and_memory/dg_minilm.csv"},
                    recorder="notebook 06 with RECOMPUTE_MINILM=True", where="the CPU, about 2 min on 2 cores",
                    notebooks=("06",))

DATASETS = (MEMORY, MEMORY_HOLDOUT_PREDICTIONS, MEMORY_HOLDOUT, MEMORY_HOLDOUT_RERUN, DG_MINILM)
