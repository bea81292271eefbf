"""The recorded data of notebook 05 and the host-cost records beside it (``dora-num record --list``
shows every data set)."""

from ...repro.paths import DataSet

SUITE = DataSet("suite", ("gpu/device.json", "gpu/suite.log"), recorder="suite", notebooks=("05",))
COMPOSE = DataSet("compose", ("gpu/compose_bench.csv",), recorder="compose", notebooks=("05",))
TILES = DataSet("tiles", ("gpu/tile_sweep.csv",), recorder="tiles")
NORM = DataSet("norm", ("gpu/norm_bench.csv",), recorder="norm", notebooks=("05",))
LAYER = DataSet("layer", ("gpu/layer_bench.csv", "gpu/layer_profile.txt"), recorder="layer", notebooks=("05",))
MODEL = DataSet("model", tuple(f"gpu/model_{t}.csv" for t in ("bench", "agreement", "probe", "predictions")),
                recorder="model", optional=("05",))
# the compiled rows (torch.compile default and reduce-overhead) of one short device call: one decoder layer
MODEL_COMPILED = DataSet("model-compiled", tuple(f"gpu/compiled/model_{t}.csv" for t in (
    "bench", "agreement", "probe", "predictions")), recorder="model --compile default reduce-overhead --layers 1 "
    "--ranks 384 --no-checkpointing --rounds 3")
TRAIN_GRAPHS = DataSet("train-graphs", ("gpu/train_graphs.csv",), recorder="train-graphs", notebooks=("05",))
OVERHEAD = DataSet("overhead", ("gpu/host_overhead.log",), recorder="overhead")
GUARD_COST = DataSet("guard-cost", ("gpu/guard_cost.csv",), recorder="guard-cost")

DATASETS = (SUITE, COMPOSE, TILES, NORM, LAYER, MODEL, MODEL_COMPILED, TRAIN_GRAPHS, OVERHEAD, GUARD_COST)
