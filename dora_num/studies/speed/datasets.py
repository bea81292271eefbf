"""The recorded data of notebook 05 and the host-cost records beside it (``dora-num record --list``
shows every data set)."""

from ...repro.paths import DataSet

_SUITE = "dora_num.studies.record_suite"
SUITE = DataSet("suite", {"device": "gpu/device.json", "log": "gpu/suite.log"}, recorder="suite", notebooks=("05",),
                module=_SUITE, about="GPU: every section of the GPU suite in one process (notebooks 02, 05)")
COMPOSE = DataSet("compose", {"bench": "gpu/compose_bench.csv.xz"}, recorder="compose", notebooks=("05",), module=_SUITE,
                  about="GPU: compose kernels vs eager and torch.compile (05)")
TILES = DataSet("tiles", {"sweep": "gpu/tile_sweep.csv"}, recorder="tiles", module=_SUITE,
                about="GPU: tile sweep of the compose kernels and the norm's row sums and tail (05)")
NORM = DataSet("norm", {"bench": "gpu/norm_bench.csv"}, recorder="norm", notebooks=("05",), module=_SUITE,
               about="GPU: row-norm time and memory (05)")
LAYER = DataSet("layer", {"bench": "gpu/layer_bench.csv", "profile": "gpu/layer_profile.txt"}, recorder="layer",
                notebooks=("05",), module=_SUITE, about="GPU: DoRALinear vs PEFT's DoRA layer (05)")


def suite_session(name: str, folder: str, recorder: str = "suite --repeat --only compose norm layer", *,
                  profile: bool = True, **kw) -> DataSet:
    """One more machine session of the suite's timed sections that the speed targets read (the same shapes),
    in ``data/<folder>/``: the targets' spread over sessions (``profile``: keep the layer's profiler table
    too, which no target reads)."""
    return DataSet(name, {role: f"{folder}/{f}" for role, f in (
        ("device", "device.json"), ("compose", "compose_bench.csv.xz"), ("norm", "norm_bench.csv"),
        ("layer", "layer_bench.csv"), *((("profile", "layer_profile.txt"),) if profile else ()))},
        recorder=recorder, **kw)


# a second session on the first session's card (the H200), beside the first session's record above
SPEED_REPEAT = suite_session("speed-repeat", "gpu/repeat")
# two sessions on an H100 (each its own machine lease, ingested with --out data/gpu/sessions/h100_<a|b>)
# (their layer profiles are not kept: the data budget; a session's ingest copies only its declared files)
SPEED_H100 = tuple(suite_session(f"speed-h100-{k}", f"gpu/sessions/h100_{k}", where="an H100", profile=False,
                                 recorder=f"suite --repeat --only compose norm layer (session {k} on an H100; "
                                          f"ingest with --out data/gpu/sessions/h100_{k})", notebooks=("05",))
                   for k in ("a", "b"))
SESSIONS = (SPEED_REPEAT, *SPEED_H100)
_MODEL_TABLES = ("bench", "agreement", "probe", "predictions")
MODEL = DataSet("model", {t: f"gpu/model_{t}.csv" for t in _MODEL_TABLES}, recorder="model", optional=("05",),
                module="dora_num.studies.speed.record_model",
                about="GPU: a Llama-architecture decoder at 8B layer shapes, PEFT vs this operator (05)")
# the model matrix (plain LoRA, PEFT's DoRA and this operator; eager, compile, reduce-overhead; training with and
# without checkpointing, inference; 4 layers) in two device calls, each its own data set (its own commit and card)
MODEL_MATRIX = tuple(DataSet(f"model-matrix-{k}", {"bench": f"gpu/matrix/part{k}/matrix_bench.csv",
                                                  "g_error": f"gpu/matrix/part{k}/matrix_g_error.csv"},
                             recorder=f"model --matrix {k}", where="an H100 or H200", optional=("05",))
                     for k in (1, 2))
TRAIN_GRAPHS = DataSet("train-graphs", {"timing": "gpu/train_graphs.csv"}, recorder="train-graphs", notebooks=("05",),
                       module="dora_num.studies.speed.record_train_graphs",
                       about="GPU: the training compose on the device alone, under CUDA graphs (05)")
OVERHEAD = DataSet("overhead", {"log": "gpu/host_overhead.log"}, recorder="overhead",
                   module="dora_num.studies.speed.record_overhead", about="GPU: host (CPU) cost of the fused tier per call (05)")
GUARD_COST = DataSet("guard-cost", {"interleaved": "gpu/guard_cost.csv"}, recorder="guard-cost",
                     module="dora_num.studies.speed.record_guard_cost",
                     about="GPU: what the cancellation guard costs, on vs off interleaved")

# The paper's released kernels (github.com/sockeye44/dorafactors, tag v1.0) against ours in one process on one
# GPU, their source carried (dora-num record carry-dorafactors).
DORAFACTORS = DataSet("dorafactors", {"bench": "gpu/dorafactors_bench.csv"},
                      recorder="dorafactors --dorafactors .carry/dorafactors",
                      module="dora_num.studies.speed.record_dorafactors", notebooks=("05",),
                      where="one H100 or H200, about 2 minutes",
                      about="GPU: the released dorafactors kernels (v1.0) against ours, interleaved in one run")

DATASETS = (SUITE, COMPOSE, TILES, NORM, LAYER, MODEL, *MODEL_MATRIX, TRAIN_GRAPHS, OVERHEAD, GUARD_COST,
            DORAFACTORS, *SPEED_H100)
UNRECORDED = (SPEED_REPEAT,)
