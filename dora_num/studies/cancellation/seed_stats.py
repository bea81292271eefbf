"""The compact record of one capture of a seeds-plan run: what :mod:`.seeds` needs, and nothing of ``g`` itself.

Per module ``j`` of one capture (``g = m / wnorm64``, float64; ``w = ||W_j||_2`` of the frozen base row, float64)
and per tercile of ``w`` within the module (``wbin`` 0, 1, 2; ``-1``: the whole module):

* ``rows``; per narrow format ``f`` the counts ``n_one_<f>`` (``fl_f(g) == 1``: the exact zone) and ``n_sym_<f>``
  (``|g - 1| < eps_f / 2``: the paper's zone), :func:`dora_num.numerics.collapse.zone_masks` (whole-module
  rows only: the intervals resample modules);
* ``gm1_mean`` (whole-module rows only), ``gm1_rms`` (``sqrt(mean((g - 1)^2))``: what a pooled std(g) is built from), ``abs_median``
  (median ``|g - 1|``); ``w_median`` (median ``w`` of the rows counted).

Counts are exact; the summaries are written to 3 significant digits (a relative 5e-3, far below the
seed-to-seed spread :mod:`.seeds` resolves).  36 modules x 4 rows x ~7 captures per run: about 10 KB gzipped a run,
where the run's ``g`` would be 330 KB a capture.  Run labels (rank, lr, seed, ...) live in the record's manifest.  The recorder (:func:`.record_trained.run_one`, plan ``seeds``)
writes it per run; the ingest (:func:`.ingest_seeds.ingest_seeds`) gathers it; seed 0 (the full plan's record,
final step only) is summarised by the same :func:`capture_stats` from its committed ``g``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...numerics.collapse import zone_masks
from ...numerics.formats import NARROW_FORMATS
from .runs import module_type

WBINS = 3  # terciles of the base row norm within a module: the within-module ||W_j|| contrast of the scaling fit
ALL_ROWS = -1  # wbin of the whole-module row
SUMMARY_COLUMNS = ("gm1_mean", "gm1_rms", "abs_median", "w_median")
FLOAT_FORMAT = "%.3g"


def count_column(zone: str, fmt: str) -> str:
    """``n_one_<fmt>`` (zone ``one``: rounds to exactly 1) or ``n_sym_<fmt>`` (``sym``: ``|g-1| < eps/2``)."""
    if zone not in ("one", "sym"):
        raise ValueError(f"zone must be 'one' or 'sym', got {zone!r}")
    return f"n_{zone}_{fmt}"


_MASK_KEY = {"one": "frac_rounds_to_one", "sym": "frac_symmetric_zone"}


def wbin_of(w: np.ndarray, nbins: int = WBINS) -> np.ndarray:
    """Bin ``0..nbins-1`` of each row by its rank in ``w`` (equal counts up to one; ties by position):
    quantile bins that do not depend on where the values fall."""
    order = np.argsort(w, kind="stable")
    out = np.empty(w.size, dtype=np.int64)
    out[order] = (np.arange(w.size) * nbins) // max(w.size, 1)
    return out


def _summary(gm1: np.ndarray, w: np.ndarray, formats, whole: bool) -> dict:
    d = {"rows": int(gm1.size)}
    g = 1.0 + gm1
    for f in formats:
        m = zone_masks(g, f) if whole else None
        for zone, key in _MASK_KEY.items():
            d[count_column(zone, f)] = int(m[key].sum()) if whole else None
    d.update(gm1_mean=float(gm1.mean()) if whole else None, gm1_rms=float(np.sqrt(np.mean(gm1**2))),
             abs_median=float(np.median(np.abs(gm1))), w_median=float(np.median(w)))
    return d


def capture_stats(gm1: dict[str, np.ndarray], wbase: dict[str, np.ndarray], formats=NARROW_FORMATS,
                  nbins: int = WBINS) -> pd.DataFrame:
    """The table above for one capture: ``gm1`` ``{module: g - 1}`` (float64, per row), ``wbase`` ``{module:
    ||W_j||}`` of the same rows."""
    rows = []
    for n in sorted(gm1):
        d, w = np.asarray(gm1[n], dtype=np.float64), np.asarray(wbase[n], dtype=np.float64)
        if d.shape != w.shape:
            raise ValueError(f"{n}: {d.size} values of g - 1 but {w.size} row norms")
        if not np.isfinite(d).all():
            raise ValueError(f"{n}: g - 1 is not finite")
        module_type(n)  # a MiniLM encoder linear, or a clear error
        rows.append({"module": n, "wbin": ALL_ROWS, **_summary(d, w, formats, True)})
        b = wbin_of(w, nbins)
        rows += [{"module": n, "wbin": k, **_summary(d[b == k], w[b == k], formats, False)} for k in range(nbins)]
    df = pd.DataFrame(rows)
    counts = [c for c in df.columns if c.startswith("n_")]
    return df.astype({c: "Int64" for c in counts})


def read_stats(path) -> pd.DataFrame:
    """A written table of :func:`capture_stats` rows, its counts read back as integers (``Int64``: empty in the
    tercile rows), so that writing it again (with :data:`FLOAT_FORMAT`) cannot round a count."""
    df = pd.read_csv(path)
    return df.astype({c: "Int64" for c in df.columns if c.startswith("n_")})


def base_row_norms(model, names) -> dict[str, np.ndarray]:
    """``||W_j||_2`` (float64) of every row of each adapted linear's frozen base weight."""
    import torch

    out = {}
    for n in names:
        mod = model.get_submodule(n)
        # DoRALinear keeps the frozen linear as .base, PEFT's layer as get_base_layer(); a bare base model's is it
        w = (mod.base.weight if hasattr(mod, "base") else mod.get_base_layer().weight
             if hasattr(mod, "get_base_layer") else mod.weight).detach()
        out[n] = torch.linalg.vector_norm(w.double(), dim=1).cpu().numpy()
    return out
