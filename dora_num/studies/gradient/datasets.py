"""The recorded data of notebook 06 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

MEMORY = DataSet("memory", ("gpu/memory/memory_peaks.csv",), recorder="memory --base .carry/minilm",
                 notebooks=("06",))

DATASETS = (MEMORY,)
