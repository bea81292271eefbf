"""The recorded data of notebook 03 and the exhaustive checks notebook 01 reads too
(``dora-num record --list`` shows every data set)."""

from ...repro.paths import DataSet

COMPOSE_FP8 = DataSet("compose-fp8", ("exhaustive/compose_fp8.csv.gz",), recorder="compose-fp8",
                      where="the CPU, about 3 min on 2 cores", ingest=False, notebooks=("01", "03"))
# device.json describes the whole exhaustive GPU run (its census and accumulation sections too)
COMPOSE_GPU = DataSet("compose-exhaustive", tuple(f"gpu/exhaustive/{f}" for f in (
    "compose_exhaustive.csv", "compose_exhaustive_bitwise.csv", "device.json")), recorder="exhaustive --only compose",
    optional=("01", "03"))
ACCUMULATION = DataSet("accumulation", ("gpu/exhaustive/accumulation_probe.json.gz",
                                        "gpu/exhaustive/accumulation_findings.json"),
                       recorder="exhaustive --only accumulation", optional=("03",))

# the factored norm's products and guard on the GPU (the accumulation part: not yet recorded)
PRODUCTS = DataSet("products", tuple(f"gpu/products/{f}" for f in ("tf32.csv", "bf16_base.csv", "guard_fire_rate.csv")),
                   recorder="products --only tf32 bf16_base fire_rate")  # read by docs/bounds.md



def operator_accumulation(card: str) -> DataSet:
    """The accumulation probe at the operator's GEMM shapes (r 8 to 384, K up to one TC_BLOCK_K block,
    split-K included), as one card recorded it: each card keeps its own record."""
    return DataSet(f"accumulation-{card}", tuple(f"gpu/products/{f}" for f in (
        f"accumulation_rows_{card}.npz", f"accumulation_meta_{card}.json.gz")),
        recorder=f"products --only accumulation (on an {card.upper()})")


OPERATOR_ACCUMULATION_CARDS = ("h100",)  # the cards recorded so far
DATASETS = (COMPOSE_FP8, COMPOSE_GPU, ACCUMULATION, PRODUCTS,
            *(operator_accumulation(c) for c in OPERATOR_ACCUMULATION_CARDS))
