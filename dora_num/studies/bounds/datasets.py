"""The recorded data of notebook 03 and the exhaustive checks notebook 01 reads too
(``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

COMPOSE_FP8 = DataSet("compose-fp8", {"check": "exhaustive/compose_fp8.csv.gz"}, recorder="compose-fp8",
                      where="the CPU, about 3 min on 2 cores", ingest=False, notebooks=("01", "03"),
                      module="dora_num.studies.bounds.record_fp8", about="CPU: the exhaustive fp8 compose check (01, 03)")
# device.json describes the whole exhaustive GPU run (its census and accumulation sections too)
COMPOSE_GPU = DataSet("compose-exhaustive", {
    "results": "gpu/exhaustive/compose_exhaustive.csv.xz", "bitwise": "gpu/exhaustive/compose_exhaustive_bitwise.csv",
    "device": "gpu/exhaustive/device.json"}, recorder="exhaustive --only compose", optional=("01", "03"),
    module="dora_num.studies.record_exhaustive",
    about="GPU: exhaustive sqrt census, tensor-core accumulation probe, 16-bit compose checks (01-03)")
ACCUMULATION = DataSet("accumulation", {"probe": "gpu/exhaustive/accumulation_probe.json.xz",
                                        "findings": "gpu/exhaustive/accumulation_findings.json"},
                       recorder="exhaustive --only accumulation", optional=("03",))

# the factored norm's products and guard on the GPU (the accumulation probe: per card, below)
PRODUCTS = DataSet("products", {p: f"gpu/products/{f}" for p, f in (
    ("tf32", "tf32.csv"), ("bf16_base", "bf16_base.csv"), ("fire_rate", "guard_fire_rate.csv"))},
    recorder="products --only tf32 bf16_base fire_rate", module="dora_num.studies.bounds.record_products",
    about="GPU: the norm's products under TF32 switches, a bf16 base, the accumulation probe, the guard's fire rate (03)"
)  # read by docs/bounds.md


def operator_accumulation(card: str) -> DataSet:
    """The accumulation probe at the operator's GEMM shapes (r 8 to 384, K up to one TC_BLOCK_K block,
    split-K included), as one card recorded it: each card keeps its own record."""
    return DataSet(f"accumulation-{card}", {"probe": f"gpu/products/accumulation_probe_{card}.json.xz"},
                   recorder=f"products --only accumulation (on an {card.upper()})")


OPERATOR_ACCUMULATION_CARDS = ("h100",)  # the cards recorded so far
DATASETS = (COMPOSE_FP8, COMPOSE_GPU, ACCUMULATION, PRODUCTS,
            *(operator_accumulation(c) for c in OPERATOR_ACCUMULATION_CARDS))
