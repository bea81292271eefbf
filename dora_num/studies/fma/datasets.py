"""The recorded data of notebook 02 (``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

FMA = DataSet("fma", {"variants": "gpu/fma_sqrt.csv", "sample": "gpu/fma_sqrt_sample.npz"}, recorder="fma",
              notebooks=("02",), module="dora_num.studies.record_suite",
              about="GPU: FMA / sqrt variants of the norm assembly and the compose (02)")
SQRT_CENSUS_CPU = DataSet("sqrt-census-cpu", {t: f"exhaustive/sqrt_census_cpu_{t}.csv.gz" for t in ("counts", "chunks")},
                          recorder="sqrt-census", where="the CPU, about 25 min on 2 cores", ingest=False,
                          notebooks=("02",), module="dora_num.studies.fma.record_census",
                          about="CPU: the exhaustive fp32 sqrt census (02)")
SQRT_CENSUS_GPU = DataSet("sqrt-census-gpu",
                          {t: f"gpu/exhaustive/sqrt_census_gpu_{t}.csv" for t in ("counts", "chunks", "timing")},
                          recorder="exhaustive --only census", optional=("02",))

DEEP_STACK = DataSet("deep-stack", {"cosines": "gpu/deep_stack_cosine.csv"}, recorder="deep-stack",
                     module="dora_num.studies.fma.record_deep_stack", notebooks=("02",),
                     about="GPU: the paper's fused kernel (approximate division, sqrt, FMA), 48-layer stack (02)")

DATASETS = (FMA, SQRT_CENSUS_CPU, SQRT_CENSUS_GPU, DEEP_STACK)
