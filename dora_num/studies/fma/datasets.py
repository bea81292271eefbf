"""The recorded data of notebook 02 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

FMA = DataSet("fma", ("gpu/fma_sqrt.csv", "gpu/fma_sqrt_sample.npz"), recorder="fma", notebooks=("02",))
SQRT_CENSUS_CPU = DataSet("sqrt-census-cpu", tuple(f"exhaustive/sqrt_census_cpu_{t}.csv.gz" for t in ("counts", "chunks")),
                          recorder="sqrt-census", where="the CPU, about 25 min on 2 cores", ingest=False,
                          notebooks=("02",))
SQRT_CENSUS_GPU = DataSet("sqrt-census-gpu",
                          tuple(f"gpu/exhaustive/sqrt_census_gpu_{t}.csv" for t in ("counts", "chunks", "timing")),
                          recorder="exhaustive --only census", optional=("02",))

DATASETS = (FMA, SQRT_CENSUS_CPU, SQRT_CENSUS_GPU)
