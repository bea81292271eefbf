"""The recorded data of notebook 06 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

MEMORY = DataSet("memory", {"peaks": "gpu/memory/memory_peaks.csv"}, recorder="memory --base .carry/minilm",
                 notebooks=("06",), module="dora_num.studies.gradient.record_memory",
                 about="GPU: peak memory of training steps against the memory model (06)")

DATASETS = (MEMORY,)
