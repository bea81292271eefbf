"""Notebook 04's convergence study: its configuration and its run plan.

:class:`ConvergenceConfig` (validated), the tiny CPU configuration :data:`SMOKE`, one
run's identity :class:`RunSpec` and the plan (:func:`run_plan`):

    eager s0, fused s0, eager s0 (repeat), [eager s0 with m + 1 ulp], eager s1, fused s1, ...

and :func:`train_config`, the training harness's configuration of one run.  Running
the plan: :mod:`~dora_num.studies.convergence.record_convergence`; its tables:
:mod:`~dora_num.studies.convergence.tidy`; the recorded runs:
:mod:`~dora_num.studies.convergence.recorded`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...adapters.train import TrainConfig

PATHS = ("eager", "fused")
PROFILE_WARMUP = 3  # steps dropped from the profile (Triton JIT + autotune, cuBLAS heuristics)
# Loss and gradient norm are float32 values (``.item()`` of fp32 tensors): 9 significant
# digits write them exactly; learning rate and seconds need no more.
HISTORY_FLOAT_FORMAT = "%.9g"
RUN_ORDER_NOTE = "eager s0, fused s0, eager s0 repeat, then eager/fused per further seed"


@dataclass
class ConvergenceConfig:
    steps: int = 2000
    seeds: tuple[int, ...] = (0, 1, 2)
    repeat_seed: int | None = 0  # one eager seed run twice (None: no repeat)
    paths: tuple[str, ...] = PATHS  # compose paths run per seed
    # GPU sizing: MiniLM is launch-bound on an H200 (step time ~ number of kernels,
    # not tokens), so batch 64 x 64 tokens costs about what batch 8 does; 64 pairs
    # give 63 in-batch negatives.  2000 steps x 64 = 32 epochs of the 3976 pairs.
    batch_size: int = 64
    max_len: int = 64
    # Summaries and signatures in one forward of 2 x batch texts: half the kernel
    # launches of two forwards, and MiniLM training is launch-bound on an H200.
    joint_encode: bool = True
    rank: int = 16
    alpha: float | None = None
    lr: float = 1e-4
    warmup_steps: int = 200  # the paper's warmup fraction 0.1 of 2000 steps; then constant
    eval_every: int = 200
    eval_limit: int | None = None  # validation pairs (None: all 456)
    profile_steps: int = 12
    device: str = "cuda"
    bf16_autocast: bool = True
    dropout: bool = True  # MiniLM's own dropout (0.1); off for the DDP-vs-single check
    fused_impl: str = "auto"  # "kernels" | "custom_op" | "auto" (kernels where they run)
    deadline_s: float | None = None  # skip runs that would end after this many seconds
    # CPU threads (None: torch's default).  The SMOKE run uses 1: on the shared 2-core CI
    # machine a 2-thread OpenMP region waits for a descheduled thread; measured there
    # under load, a 384->1536 DoRALinear forward of 32 tokens took 238 ms with 2 threads
    # and 5.5 ms with 1.
    threads: int | None = None
    progress: bool = True
    profile_only: bool = False  # only the profiling phase (time per step, both paths)
    runs: tuple[str, ...] | None = None  # only these runs of the plan (e.g. one per GPU process)
    # Eager seeds also run with every m moved by 1 fp32 ulp at init (random signs): how far
    # two runs drift apart from the smallest possible difference, with the same batches.
    ulp_seeds: tuple[int, ...] = ()
    # How many such runs per seed, each with its own random signs (NAME_ulp, NAME_rep1_ulp, ...): the
    # spread of the same-batch floor, not one draw of it.
    ulp_replicates: int = 1

    def validate(self) -> None:
        if not self.seeds:
            raise ValueError("seeds must not be empty")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds}")
        if not set(self.ulp_seeds) <= set(self.seeds):
            raise ValueError(f"ulp_seeds {self.ulp_seeds} must be among seeds {self.seeds}")
        if self.repeat_seed is not None and self.repeat_seed not in self.seeds:
            raise ValueError(f"repeat_seed={self.repeat_seed} must be one of seeds {self.seeds}")
        for name in ("steps", "eval_every", "batch_size", "max_len", "rank", "ulp_replicates"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.profile_steps < 0:
            raise ValueError(f"profile_steps must be >= 0, got {self.profile_steps}")
        bad = [p for p in self.paths if p not in PATHS]
        if bad or not self.paths:
            raise ValueError(f"paths must be a non-empty subset of {PATHS}, got {self.paths}")
        if self.fused_impl not in ("auto", "kernels", "custom_op"):
            raise ValueError(f"fused_impl must be 'auto', 'kernels' or 'custom_op', got {self.fused_impl!r}")

    @property
    def eval_steps(self) -> tuple[int, ...]:
        return tuple(sorted({0, *range(self.eval_every, self.steps + 1, self.eval_every), self.steps}))


SMOKE = dict(steps=3, seeds=(0, 1), batch_size=4, max_len=16, eval_every=3, eval_limit=16, profile_steps=0,
             warmup_steps=2, lr=1e-3, device="cpu", bf16_autocast=False, fused_impl="custom_op", threads=1)


@dataclass(frozen=True)
class RunSpec:
    path: str
    seed: int
    repeat: int = 0
    perturbed: bool = False  # every m moved by 1 fp32 ulp at init (the chaos baseline)

    @property
    def name(self) -> str:
        return (f"{self.path}_s{self.seed}" + (f"_rep{self.repeat}" if self.repeat else "")
                + ("_ulp" if self.perturbed else ""))


# perturb_seed of a perturbed run: ULP_SEED_OFFSET + seed (the random signs of the ulp moves), and for
# replicate k >= 1 ULP_REPLICATE_STRIDE * k more (the first replicate keeps the seed recorded before).
ULP_SEED_OFFSET = 1_000_003
ULP_REPLICATE_STRIDE = 7_919


def ulp_perturb_seed(spec: RunSpec) -> int:
    return ULP_SEED_OFFSET + spec.seed + ULP_REPLICATE_STRIDE * spec.repeat


def run_plan(seeds, repeat_seed=None, paths=PATHS, ulp_seeds=(), ulp_replicates=1) -> list[RunSpec]:
    """Eager and fused of the first seed, the repeat, then both paths per further seed;
    after each seed in ``ulp_seeds``, ``ulp_replicates`` eager runs with every ``m`` moved by 1 ulp
    (each replicate its own random signs)."""
    plan = []
    for i, s in enumerate(seeds):
        plan.extend(RunSpec(p, s) for p in paths)
        if s == repeat_seed and "eager" in paths:
            plan.append(RunSpec("eager", s, 1))
        if s in ulp_seeds and "eager" in paths:
            plan.extend(RunSpec("eager", s, k, True) for k in range(ulp_replicates))
    return plan


def train_config(cfg: ConvergenceConfig, spec: RunSpec, *, steps=None, evals=True, progress=None) -> TrainConfig:
    steps = cfg.steps if steps is None else steps
    return TrainConfig(rank=cfg.rank, alpha=cfg.alpha, lr=cfg.lr, steps=steps, batch_size=cfg.batch_size,
                       max_len=cfg.max_len, seed=spec.seed, warmup_steps=cfg.warmup_steps, backend="dora_num",
                       compose_path="fused" if spec.path == "fused" else "eager",
                       bf16_autocast=cfg.bf16_autocast, device=cfg.device,
                       capture_steps=cfg.eval_steps if evals else (), eval_steps=cfg.eval_steps if evals else (),
                       eval_limit=cfg.eval_limit, joint_encode=cfg.joint_encode, progress=cfg.progress if progress is None else progress,
                       perturb_seed=ulp_perturb_seed(spec) if spec.perturbed else None)
