"""What a study folder's ``headline.py`` writes its README sentences with: reading the committed data
and printing a number the same way in every headline.

Each study folder's ``headline.py`` (``dora_num/studies/<study>/headline.py``) reads its notebook's
artifacts under ``d`` (the ``data/`` folder) and returns its sentences with the statistics they state
(:data:`Stats`); :mod:`dora_num.repro.results` gathers them into the README and checks each strong word
against those statistics.  No science lives here: only the readers and the number formats.
"""

from __future__ import annotations

import json
from pathlib import Path

# Every takeaway and headline function returns its text and the statistics it states (name -> value), so
# that :func:`dora_num.repro.results.overclaims` can check each strong word against the statistic that
# licenses it.
Stats = dict[str, float]


def read_csv(data: Path, rel: str):
    """The table ``rel`` (a path under ``data/``) of the data folder ``data``."""
    import pandas as pd

    return pd.read_csv(data / rel)


def read_json(data: Path, rel: str):
    return json.loads((data / rel).read_text())


def pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def pct_short_of_one(x: float) -> str:
    """``x`` as a percentage with the digits that keep a fraction below 1 from printing as 100%."""
    digits = 3
    while x < 1 and f"{100 * x:.{digits}g}" == "100" and digits < 12:
        digits += 1
    return f"{100 * x:.{digits}g}%"


def joined(values) -> str:
    return " and ".join(f"{x:g}" for x in sorted(set(values)))
