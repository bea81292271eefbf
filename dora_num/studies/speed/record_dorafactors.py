"""The paper's released kernels against ours: same GPU, same process, rounds interleaved.

The paper behind this repository released its kernels as ``github.com/sockeye44/dorafactors`` (tag
``v1.0``, a patch of PEFT).  Their source is not part of this repository: it is carried to the GPU
machine (``.carry/`` is git-ignored) and imported there from that folder::

    # here, once: the two files of the release this recorder imports, and a VERSION with the commit
    dora-num record carry-dorafactors .carry/dorafactors --from GIT_DIR   # GIT_DIR: a clone of the repository
    # on the GPU machine, .carry/dorafactors carried (nothing installed there: the image has torch, triton, peft)
    PYTHONPATH=. python3 -m dora_num record dorafactors --out $OUT --dorafactors .carry/dorafactors --git-sha SHA
    # here: -> data/gpu/ with provenance (the dorafactors commit and the GPU in the sidecar)
    dora-num record dorafactors --ingest OUT_DIR --git-sha SHA

Per configuration each implementation is checked once against float64 and timed in rounds (every
implementation once per round, the order rotated), each row with the median, every round and the per-round
ratio to ours.  How their kernels are called, the dtypes each side gets and every measured configuration:
docs/methods.md, ``studies/speed/record_dorafactors.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ...repro.recording import MACHINE_FILE
from ...repro.recording import parser as recorder_parser
from .datasets import DORAFACTORS

RELEASE_REPO = "github.com/sockeye44/dorafactors"
RELEASE_TAG = "v1.0"
RELEASE_DIR = "code/peft_patched/src/peft/tuners/lora"  # where the two files lie in their repository
# The carried files and the module names they are loaded under: the fused kernels under the name their
# layer looks them up by (dora.py's _get_dora_fused reads sys.modules), the layer under a name of its own
# (loaded by file, not from sys.path: the installed peft package would shadow a folder named peft).
RELEASE_MODULES = {"dora_fused.py": "peft.tuners.lora.dora_fused", "dora.py": "dorafactors_release_dora"}
CARRY_DIR = Path(".carry/dorafactors")
VERSION_FILE = "VERSION"  # JSON: repository, tag, commit, each file's path there and sha256
# their settings, read from the environment by their code (recorded as they were: unset = their defaults)
THEIR_ENV = ("PEFT_DORA_FUSED", "PEFT_DORA_FUSED_BACKWARD", "PEFT_DORA_NORM_CHUNK_MB", "PEFT_DORA_FWD_CHUNK_MB",
             "DORA_AUTOTUNE_COMPREHENSIVE")

ROUNDS = 7
SMOKE_ROUNDS = 2
TIMING = dict(warmup=10, rep=50)  # ms of do_bench per timing: 7 rounds of every case stay near a minute
SEED = 20261211
ALPHA = 192.0  # rsLoRA alpha of the layer benchmark (record_layer): s = 192 / sqrt(r)
UPDATE_RATIO = 0.05  # ||sBA|| / ||W|| per row: a realistic adapter (record_guard_cost's)
G_SPREAD = 1e-3  # g - 1 ~ G_SPREAD N(0, 1): the realistic regime
RANKS = (16, 64, 384)  # the model-level rows' ranks (model_variants.RANKS)
FULL = dict(compose=((4096, 4096), (4096, 8192)),  # tokens x d_out
            norm=tuple((d, d, r) for d in (4096, 8192) for r in RANKS),  # d_out x d_in, rank
            layer=tuple((d, d, r, 4096) for d in (4096, 8192) for r in RANKS))  # d_in, d_out, rank, tokens
SMOKE = dict(compose=((256, 512),), norm=((512, 512, 16),), layer=((512, 512, 16, 256),))


# --------------------------------------------------------------------------
# The carried release
# --------------------------------------------------------------------------

def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def carry_hint(folder) -> str:
    return (f"carry it first (here): dora-num record carry-dorafactors {folder} --from GIT_DIR "
            f"(GIT_DIR: a clone of {RELEASE_REPO})")


def check_carry(folder) -> dict:
    """The VERSION of the release carried in ``folder``, once its files are there and unchanged since they
    were carried (their sha256 as VERSION records them); a clear error naming the path otherwise.  Reads
    files only (no import), so a recorder refuses a missing release before it asks for the GPU."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no dorafactors release at {folder}: {carry_hint(folder)}")
    vf = folder / VERSION_FILE
    if not vf.is_file():
        raise FileNotFoundError(f"{folder} has no {VERSION_FILE}: not a carried dorafactors release; "
                                f"{carry_hint(folder)}")
    version = json.loads(vf.read_text())
    for name in RELEASE_MODULES:
        p = folder / name
        if not p.is_file():
            raise FileNotFoundError(f"{p} is missing: {carry_hint(folder)}")
        want = version["files"][name]["sha256"]
        if sha256(p) != want:
            raise ValueError(f"{p} is not the file carried from {version['repo']} at {version['commit']} "
                             f"(sha256 {sha256(p)}, carried {want}): carry it again")
    return version


@dataclass
class Release:
    """The imported release: ``fused`` (their ``dora_fused`` module), ``dora`` (their ``dora`` module, None
    where it did not import: ``dora_error`` says why), ``version`` (the carry's VERSION)."""
    fused: object
    dora: object | None
    version: dict
    dora_error: str | None = None


def _load_module(name: str, path: Path):
    have = sys.modules.get(name)
    if have is not None:
        if Path(getattr(have, "__file__", "") or "").resolve() == Path(path).resolve():
            return have
        raise RuntimeError(f"module {name} is already loaded from {getattr(have, '__file__', None)}, not from "
                           f"{path}: run the recorder in a fresh process")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def load_release(folder) -> Release:
    """Import the release carried in ``folder`` (:func:`check_carry` first).  Their fused kernels must
    import; their layer module may fail (a missing peft): the failure is kept, not raised."""
    folder = Path(folder)
    version = check_carry(folder)
    fused = _load_module(RELEASE_MODULES["dora_fused.py"], folder / "dora_fused.py")
    try:
        dora = _load_module(RELEASE_MODULES["dora.py"], folder / "dora.py")
    except Exception as e:  # noqa: BLE001 - the compose rows need only the fused module
        return Release(fused, None, version, f"{type(e).__name__}: {e}")
    return Release(fused, dora, version)


# --------------------------------------------------------------------------
# Rounds, ratios, rows (no GPU: the timer is a seam)
# --------------------------------------------------------------------------

@dataclass
class Case:
    """One measurement at one configuration: ``impls`` (name -> the timed call), ``ours`` (the name the
    ratios are taken to), ``info`` (name -> columns: dtypes, path, errors), ``reset`` (after each timing:
    drops accumulated gradients)."""
    op: str
    config: dict
    ours: str
    impls: dict[str, Callable[[], object]]
    info: dict[str, dict] = field(default_factory=dict)
    reset: Callable[[], None] | None = None


def round_order(names: list[str], k: int) -> list[str]:
    """Round ``k``'s order: the implementations rotated by ``k`` (each leads in turn)."""
    k %= len(names)
    return names[k:] + names[:k]


def time_rounds(case: Case, rounds: int, timer: Callable[[Callable], float]) -> dict[str, list[float]]:
    """``{impl: [ms of round 0, 1, ...]}``: ``rounds`` rounds, each timing every implementation once
    (``timer(fn)`` -> milliseconds), in :func:`round_order`."""
    names = list(case.impls)
    if case.ours not in names:
        raise ValueError(f"{case.op}: ours ({case.ours!r}) is not among the implementations {names}")
    ms: dict[str, list[float]] = {n: [] for n in names}
    for k in range(rounds):
        for n in round_order(names, k):
            ms[n].append(float(timer(case.impls[n])))
            if case.reset is not None:
                case.reset()
    return ms


def case_rows(case: Case, ms: dict[str, list[float]]) -> list[dict]:
    """One row per implementation: the median of its rounds, each round, and its time over ours within
    each round (the median of those ratios is ``ratio_to_ours``: a drift between rounds cancels)."""
    ours = ms[case.ours]
    rows = []
    for name, ts in ms.items():
        ratios = [t / o for t, o in zip(ts, ours)]
        rows.append({"op": case.op, "impl": name, "ours": case.ours, **case.config, **case.info.get(name, {}),
                     "ms": statistics.median(ts), "ratio_to_ours": statistics.median(ratios),
                     "rounds_ms": ";".join(f"{t:.4f}" for t in ts),
                     "ratio_rounds": ";".join(f"{r:.4f}" for r in ratios), "rounds": len(ts)})
    return rows


def measure(builders, rounds: int, timer, *, log=print, checkpoint: Callable[[list], None] | None = None) -> list[dict]:
    """Build each configuration's cases (``builders``: ``(op, config, build)``, ``build()`` -> a list of
    :class:`Case`), time them (:func:`time_rounds`) and return the rows.  A configuration that fails
    is recorded as an ``error`` row and the run goes on (one device call, no retries)."""
    rows: list[dict] = []
    for op, config, build in builders:
        t0 = time.perf_counter()
        try:
            for case in build():
                rows += case_rows(case, time_rounds(case, rounds, timer))
                del case
        except Exception as e:  # noqa: BLE001 - record and go on
            traceback.print_exc()
            rows.append({"op": op, "impl": "error", **config, "error": f"{type(e).__name__}: {e}"[:400]})
        log(f"dorafactors {op} {config} done ({time.perf_counter() - t0:.1f} s)")
        if checkpoint is not None:
            checkpoint(rows)
    return rows


def summary(df):
    """The rows a reader compares: per measurement and configuration, each implementation's median time,
    its ratio to ours and its error against float64."""
    keys = [c for c in ("op", "tokens", "d_in", "d_out", "rank", "impl") if c in df.columns]
    errs = [c for c in df.columns if c.startswith("err_") and not c.endswith("own_inputs")]
    return df[keys + [c for c in ("ms", "ratio_to_ours") if c in df.columns] + errs]


# --------------------------------------------------------------------------
# The measurements (torch from here on)
# --------------------------------------------------------------------------

def _dt(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _measured_call(fn, device):
    """``(peak extra bytes, fn())``: the allocator's peak on CUDA, None elsewhere."""
    import torch

    if torch.device(device).type == "cuda":
        from ..bench import peak_extra_bytes

        return peak_extra_bytes(fn)
    return None, fn()


def _compose64(base, lora, g, s):
    from ...numerics import formulas as F
    from ...oracles import TorchFP64

    return F.compose_stable(TorchFP64, base.double(), lora.double(), g.double().reshape(-1), s)


def compose_cases(R: Release, tokens: int, d_out: int, device: str) -> list[Case]:
    """``compose_fwd`` and ``compose_train`` at ``tokens x d_out`` bf16 (:func:`suite_compose_torch`'s
    inputs): their fused compose (``mag``: bf16 ``[1, N]``, as their layer casts it), ours (fp32 ``g``),
    eager torch (the contract's reference, fp32 ``g``)."""
    import torch

    from ...numerics.formulas import scale_constants
    from ...ops import reference as ref
    from ...ops.compose import ComposeFunction
    from ...ops.kernels import compose as kc
    from ...oracles import dg_ref64
    from ..bench import max_rel_err
    from ..inputs import SUITE_COMPOSE_SCALE, suite_compose_torch
    from .record_compose import autograd_expr

    gen = torch.Generator(device=device).manual_seed(SEED)
    base, lora, g, grad = suite_compose_torch(tokens, d_out, torch.bfloat16, gen, device)
    s = scale_constants(SUITE_COMPOSE_SCALE)[0]
    mag = g.to(base.dtype).view(1, -1)
    theirs_path = "triton" if R.fused.is_triton_available() and lora.is_cuda else "torch_fallback"
    config = {"tokens": tokens, "d_out": d_out}
    g_of = {"dorafactors_fused": mag, "dora_num_fused": g, "eager_torch": g}
    path = {"dorafactors_fused": theirs_path, "dora_num_fused": "triton", "eager_torch": "torch"}

    def cols(name, out):
        return {"act_dtype": _dt(base), "g_dtype": _dt(g_of[name]), "out_dtype": _dt(out), "path": path[name]}

    # ---- forward ----
    fwd = {"dorafactors_fused": lambda: R.fused.fused_dora_compose(lora, base, mag, s, inplace=False),
           "dora_num_fused": lambda: kc.compose_fwd(base, lora, g, s)[0],
           "eager_torch": lambda: ref.compose_stable_ref(base, lora, g, s)}
    ref64 = _compose64(base, lora, g, s)
    info = {}
    for name, fn in fwd.items():
        out = fn()
        own = ref64 if g_of[name] is g else _compose64(base, lora, g_of[name], s)
        info[name] = {**cols(name, out), "err_out": max_rel_err(out, ref64),
                      "err_out_own_inputs": max_rel_err(out, own)}
        del out, own
    cases = [Case("compose_fwd", config, "dora_num_fused", fwd, info)]

    # ---- training: forward and backward of the compose alone ----
    bl, ll, gg = (t.detach().clone().requires_grad_(True) for t in (base, lora, g))
    bt, lt, mt = (t.detach().clone().requires_grad_(True) for t in (base, lora, mag))

    def step(fwd_fn, inputs):  # (out, (dbase, dlora, dg)) for the inputs (base, lora, g)
        def run():
            o = fwd_fn(*inputs)
            return o, torch.autograd.grad(o, inputs, grad)
        return run

    train = {"dorafactors_fused": step(lambda b, l_, m_: R.fused.fused_dora_compose_autograd(l_, b, m_, s),
                                       (bt, lt, mt)),
             "dora_num_fused": step(lambda b, l_, g_: ComposeFunction.apply(b, l_, g_, s, True), (bl, ll, gg)),
             "eager_torch": step(lambda b, l_, g_: autograd_expr(b, l_, g_, s), (bl, ll, gg))}
    g64, D64 = g.double(), grad.double()
    refs = {"dbase": (g64 - 1) * D64, "dlora": g64 * s * D64,
            "dg": dg_ref64(s * lora.double() + base.double(), grad)}
    info = {}
    for name, fn in train.items():
        out, (db, dl, dg) = fn()
        out = out.detach()
        info[name] = {**cols(name, out), "err_out": max_rel_err(out, ref64),
                      "err_dbase": max_rel_err(db, refs["dbase"]), "err_dlora": max_rel_err(dl, refs["dlora"]),
                      "err_dg": max_rel_err(dg.reshape(-1), refs["dg"])}
        del out, db, dl, dg
    cases.append(Case("compose_train", config, "dora_num_fused", train, info))
    return cases


def adapter(d_out: int, d_in: int, r: int, device: str, seed: int = SEED + 1):
    """``(W, A, B, s, m)``, all bf16: ``W``, ``A`` ~ N(0, 1/d_in), ``B`` scaled to ``||sBA|| = UPDATE_RATIO
    ||W||`` per row, ``s = ALPHA / sqrt(r)``, ``m = ||W + sBA||_row (1 + G_SPREAD N(0, 1))`` (fp64, rounded)."""
    import math

    import torch

    from ...oracles import row_norm_ref64

    gen = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16
    W = (torch.randn(d_out, d_in, device=device, generator=gen) / math.sqrt(d_in)).to(bf)
    A = (torch.randn(r, d_in, device=device, generator=gen) / math.sqrt(d_in)).to(bf)
    s = ALPHA / math.sqrt(r)
    B = torch.randn(d_out, r, device=device, generator=gen)
    upd = (s * (B @ A.float())).norm(dim=1, keepdim=True)
    B = (B * (UPDATE_RATIO * W.float().norm(dim=1, keepdim=True) / upd)).to(bf)
    z = torch.randn(d_out, device=device, generator=gen, dtype=torch.float64)
    m = (row_norm_ref64(W, A, B, s) * (1 + G_SPREAD * z)).to(bf)
    return W, A, B, s, m


def _need_layer(R: Release) -> None:
    if R.dora is None:
        raise RuntimeError(f"their dora.py did not import ({R.dora_error}); the norm and layer rows need it")


def norm_cases(R: Release, d_out: int, d_in: int, r: int, device: str) -> list[Case]:
    """``row_norm``: their factored norm (their layer's, fused assembly as their defaults pick), ours without
    and with the cached ``base_sq``, the dense fp32 norm; bf16 ``W``, ``A``, ``B``."""
    from ...ops.norm import base_row_norm_sq, dense_row_norm, factored_row_norm
    from ...oracles import row_norm_ref64
    from ..bench import max_rel_err

    _need_layer(R)
    W, A, B, s, _ = adapter(d_out, d_in, r, device)
    cache = base_row_norm_sq(W)
    theirs = R.dora.DoraLinearLayer(fan_in_fan_out=False)
    impls = {"dorafactors_factored": lambda: theirs._get_weight_norm_linear(base_weight=W, lora_A_w=A, lora_B_w=B,
                                                                             scaling=s),
             "dora_num_factored": lambda: factored_row_norm(W, A, B, s),
             "dora_num_factored_cached": lambda: factored_row_norm(W, A, B, s, base_sq=cache),
             "dense_fp32": lambda: dense_row_norm(W, A, B, s)}
    ref = row_norm_ref64(W, A, B, s)
    info = {}
    for name, fn in impls.items():
        peak, out = _measured_call(fn, device)
        info[name] = {"w_dtype": _dt(W), "ab_dtype": _dt(A), "out_dtype": _dt(out), "peak_extra_bytes": peak,
                      "err_norm": max_rel_err(out, ref)}
        del out
    return [Case("row_norm", {"d_out": d_out, "d_in": d_in, "rank": r}, "dora_num_factored", impls, info)]


def _their_layer_class():
    import torch
    from torch import nn

    class TheirLayer(nn.Module):
        """Their DoRA layer as PEFT's ``lora.Linear`` runs it (``DoraLinearVariant.forward`` in their
        ``variants.py``; bias-free base, no dropout): ``y = base(x) + dora(x, ..., base_result=base(x))``,
        the sum out of place under autograd (the DoRA term was formed from the base output), in place without."""

        def __init__(self, dora_cls, lin: nn.Linear, A, B, m, scaling: float):
            super().__init__()
            self.base = lin
            self.lora_A = nn.Linear(lin.in_features, A.shape[0], bias=False, device=A.device, dtype=A.dtype)
            self.lora_B = nn.Linear(A.shape[0], lin.out_features, bias=False, device=B.device, dtype=B.dtype)
            with torch.no_grad():
                self.lora_A.weight.copy_(A)
                self.lora_B.weight.copy_(B)
            self.dora = dora_cls(fan_in_fan_out=False)
            self.dora.weight = nn.Parameter(m.detach().clone())
            self.scaling = scaling

        def forward(self, x):
            result = self.base(x)
            delta = self.dora(x, lora_A=self.lora_A, lora_B=self.lora_B, scaling=self.scaling, base_layer=self.base,
                              base_result=result)
            if delta.dtype != result.dtype:
                delta = delta.to(result.dtype)
            return result + delta if torch.is_grad_enabled() else result.add_(delta)

        def adapter_grads(self):
            return self.lora_A.weight.grad, self.lora_B.weight.grad, self.dora.weight.grad

    return TheirLayer


def _their_paths(R: Release, tokens: int, d_out: int, device: str) -> dict[str, str]:
    """The compose path their layer takes at this shape, by their own dispatch (their defaults from the
    environment): training ``fused_autograd`` or ``eager``, inference ``fused_inplace`` or ``eager_inplace``."""
    import torch

    probe = torch.empty(tokens, d_out, dtype=torch.bfloat16, device=device)
    mag = torch.empty(1, d_out, dtype=torch.bfloat16, device=device)
    try:
        train = "fused_autograd" if R.dora._should_use_fused_backward_for_tensor(probe, mag) else "eager"
        infer = "fused_inplace" if R.dora._use_fused_kernels() and probe.is_cuda else "eager_inplace"
    except AttributeError as e:  # a private helper of theirs renamed: say so, the timing stands
        train = infer = f"unknown ({e})"
    return {"layer_fwd_bwd": train, "layer_fwd": infer}


def layer_cases(R: Release, d_in: int, d_out: int, r: int, tokens: int, device: str) -> list[Case]:
    """``layer_fwd_bwd`` and ``layer_fwd``: their layer (:class:`TheirLayer`) and ``DoRALinear``, one bf16 ``W``,
    ``A``, ``B``, ``m`` (copies on each side), ``x`` bf16 ``[tokens, d_in]``; checked against the float64
    layer (:func:`~dora_num.oracles.dora_linear_ref64`) and its gradients by float64 autograd."""
    import copy

    import torch
    from torch import nn

    from ...ops.layer import DoRALinear
    from ...oracles import dora_linear_ref64
    from ..bench import max_rel_err

    _need_layer(R)
    W, A, B, _, m = adapter(d_out, d_in, r, device)
    gen = torch.Generator(device=device).manual_seed(SEED + 2)
    lin = nn.Linear(d_in, d_out, bias=False, device=W.device, dtype=W.dtype)
    with torch.no_grad():
        lin.weight.copy_(W)
    lin.weight.requires_grad_(False)  # frozen on both sides, as PEFT freezes it: no dW in the backward
    ours = DoRALinear(copy.deepcopy(lin), r, ALPHA, use_rslora=True, lora_A=nn.Parameter(A.clone()),
                      lora_B=nn.Parameter(B.clone()), magnitude=nn.Parameter(m.clone()))
    scale = ours.scale  # ALPHA / sqrt(r), handed to theirs as their scaling
    theirs = _their_layer_class()(R.dora.DoraLinearLayer, copy.deepcopy(lin), A, B, m, scale)
    layers = {"dorafactors_layer": theirs, "dora_num_layer": ours}
    grads_of = {"dorafactors_layer": theirs.adapter_grads,
                "dora_num_layer": lambda: (ours.lora_A.grad, ours.lora_B.grad, ours.magnitude.grad)}
    x = torch.randn(tokens, d_in, device=device, generator=gen).to(W.dtype)
    D = torch.randn(tokens, d_out, device=device, generator=gen).to(W.dtype)
    xr = x.detach().requires_grad_(True)
    # the float64 layer and its gradients on the same (bf16-valued) tensors
    x64, A64, B64, m64 = (t.detach().double().requires_grad_(True) for t in (x, A, B, m))
    y64 = dora_linear_ref64(x64, W.double(), None, A64, B64, m64, scale)
    y64.backward(D.double())
    y64 = y64.detach()

    def reset():
        for layer in layers.values():
            layer.zero_grad(set_to_none=True)
        xr.grad = None

    def fwd_of(layer):
        def run():
            with torch.no_grad():
                return layer(x)
        return run

    def fwd_bwd_of(layer):
        def run():
            y = layer(xr)
            y.backward(D)
            return y
        return run

    paths = _their_paths(R, tokens, d_out, device)
    dtypes = {"act_dtype": _dt(x), "w_dtype": _dt(W), "ab_dtype": _dt(A), "m_dtype": _dt(m)}
    config = {"d_in": d_in, "d_out": d_out, "rank": r, "tokens": tokens}
    cases = []
    for op, make in (("layer_fwd_bwd", fwd_bwd_of), ("layer_fwd", fwd_of)):
        impls = {name: make(layer) for name, layer in layers.items()}
        info = {}
        for name, fn in impls.items():
            reset()
            peak, y = _measured_call(fn, device)
            ours_path = f"norm={ours.norm}, compose={ours.compose_path}"
            row = {**dtypes, "out_dtype": _dt(y), "peak_extra_bytes": peak, "err_y": max_rel_err(y.detach(), y64),
                   "path": paths[op] if name == "dorafactors_layer" else ours_path}
            if op == "layer_fwd_bwd":
                dA, dB, dm = grads_of[name]()
                row.update(err_dx=max_rel_err(xr.grad, x64.grad), err_dA=max_rel_err(dA, A64.grad),
                           err_dB=max_rel_err(dB, B64.grad), err_dm=max_rel_err(dm.reshape(-1), m64.grad))
            info[name] = row
            del y
        reset()
        cases.append(Case(op, config, "dora_num_layer", impls, info, reset))
    return cases


def builders(R: Release, shapes: dict, device: str):
    """The configurations in order: ``(op, config, build)`` for :func:`measure`."""
    for tokens, d_out in shapes["compose"]:
        yield "compose", {"tokens": tokens, "d_out": d_out}, lambda t=tokens, n=d_out: compose_cases(R, t, n, device)
    for d_out, d_in, r in shapes["norm"]:
        yield "row_norm", {"d_out": d_out, "d_in": d_in, "rank": r}, \
            lambda a=d_out, b=d_in, c=r: norm_cases(R, a, b, c, device)
    for d_in, d_out, r, tokens in shapes["layer"]:
        yield "layer", {"d_in": d_in, "d_out": d_out, "rank": r, "tokens": tokens}, \
            lambda a=d_in, b=d_out, c=r, t=tokens: layer_cases(R, a, b, c, t, device)


def run(out: Path, release_dir: Path, *, smoke: bool = False, rounds: int | None = None,
        git_sha: str | None = None) -> Path:
    import torch

    from ...repro.recording import measured_git_sha, require_cuda, write_machine
    from ..bench import gpu_description, log, time_ms, write_csv

    check_carry(release_dir)  # before the GPU: a missing release is named here, not after a device start
    require_cuda("dorafactors", torch.cuda.is_available())
    R = load_release(release_dir)
    rounds = rounds or (SMOKE_ROUNDS if smoke else ROUNDS)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    peft = sys.modules.get("peft")
    desc = gpu_description(measured_git_sha(git_sha))
    desc.update(dorafactors=R.version, dorafactors_layer_error=R.dora_error,
                peft_helpers=getattr(peft, "__version__", None) if R.dora is not None else None,
                dorafactors_env={k: os.environ.get(k) for k in THEIR_ENV}, smoke=smoke, rounds=rounds,
                timing=TIMING)
    write_machine(out, desc)
    log(f"dorafactors {R.version['tag']} ({R.version['commit'][:12]}) on {torch.cuda.get_device_name()}"
        + (f"; their layer did not import: {R.dora_error}" if R.dora_error else ""))
    dest = DORAFACTORS.path(folder=out)
    rows = measure(builders(R, SMOKE if smoke else FULL, "cuda"), rounds, lambda fn: time_ms(fn, **TIMING).ms,
                   log=log, checkpoint=lambda rs: write_csv(rs, dest))
    write_csv(rows, dest)
    return dest


# --------------------------------------------------------------------------
# Ingest and the command line
# --------------------------------------------------------------------------

def ingest(src: Path, dest: Path | None = None, *, git_sha: str | None = None) -> Path:
    """Record a ``--out`` folder into ``data/gpu/`` with provenance (the GPU and the dorafactors commit
    from its ``device.json``)."""
    import pandas as pd

    from ...repro import recording

    machine = recording.read_machine(src)
    df = pd.read_csv(DORAFACTORS.path(folder=src))
    (path,) = recording.ingest({DORAFACTORS.filename(): df}, dest or DORAFACTORS.dest(), machine=machine,
                               producer=DORAFACTORS.producer, git_sha=git_sha, sources=[src],
                               params={"smoke": machine.get("smoke"), "rounds": machine.get("rounds"),
                                       "timing": machine.get("timing"), "seed": SEED},
                               extra={"dorafactors": machine.get("dorafactors"),
                                      "dorafactors_env": machine.get("dorafactors_env"),
                                      "dorafactors_layer_error": machine.get("dorafactors_layer_error"),
                                      "peft_helpers": machine.get("peft_helpers")})
    return path


def build_parser(prog: str = "dora-num record dorafactors", name: str = "dorafactors"):
    p = recorder_parser(prog, __doc__, smoke=f"one small shape per measurement, {SMOKE_ROUNDS} rounds",
                        out=f"output folder ({DORAFACTORS.filename()}, {MACHINE_FILE})")
    p.add_argument("--dorafactors", type=Path, default=CARRY_DIR, metavar="DIR",
                   help=f"the carried release (default {CARRY_DIR}; dora-num record carry-dorafactors)")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"interleaved rounds (default {ROUNDS}, --smoke {SMOKE_ROUNDS})")
    return p


def ingest_args(a) -> list[Path]:
    import pandas as pd

    p = ingest(a.ingest, a.out, git_sha=a.git_sha)
    print(summary(pd.read_csv(p)).to_string(index=False))
    return [p]


def record(a) -> int:
    if a.rounds is not None and a.rounds < 1:
        raise SystemExit(f"dora-num record dorafactors: --rounds must be at least 1, got {a.rounds}")
    try:
        check_carry(a.dorafactors)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"dora-num record dorafactors: {e}") from None
    print(run(a.out, a.dorafactors, smoke=a.smoke, rounds=a.rounds, git_sha=a.git_sha))
    return 0
