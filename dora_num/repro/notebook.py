"""``setup()``: the second cell of every notebook.

``ctx = dn.setup("NN_topic", globals())`` reads the notebook's own ``parameters``
cell, so each parameter is declared once, there, with its type, its value and a
comment.  A parameter whose comment ends in ``smoke: VALUE`` (a Python literal) takes
``VALUE`` in SMOKE mode, unless the run passed it explicitly (papermill's injected
value differs from the cell's)::

    N_PER_REGIME: int = 34000  # elements per regime; smoke: 1000

The method in full: docs/methods.md, repro/notebook.py.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import random
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

from . import paths
from .plotting import save_figure, set_theme
from .provenance import save_dataframe, save_json

_SMOKE_SPEC = re.compile(r"\bsmoke:\s*(?P<value>.+?)\s*$")


@dataclass(frozen=True)
class Parameter:
    """One line of a ``parameters`` cell: ``NAME: type = default  # comment; smoke: VALUE``."""

    name: str
    default: object
    smoke: object = None
    has_smoke: bool = False


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def parse_parameters(source: str) -> list[Parameter]:
    """The parameters declared in a ``parameters`` cell's ``source``, in order.

    Each top-level statement must be an (annotated) assignment of a literal to one name;
    anything else is an error naming the line (the cell is data, not code)."""
    tree = ast.parse(source)
    comments = _comments(source)
    out = []
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            name, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        else:
            raise ValueError(f"parameters cell, line {node.lineno}: expected NAME: type = literal")
        try:
            default = ast.literal_eval(value)
        except ValueError:
            raise ValueError(f"parameters cell, line {node.lineno}: the value of {name} is not a literal") from None
        m = _SMOKE_SPEC.search(comments.get(node.end_lineno, ""))
        if m is None:
            out.append(Parameter(name, default))
            continue
        try:
            smoke = ast.literal_eval(m.group("value"))
        except (ValueError, SyntaxError):
            raise ValueError(f"parameters cell, line {node.lineno}: 'smoke: {m.group('value')}' is not a "
                             "Python literal") from None
        if type(smoke) is not type(default):
            raise ValueError(f"parameters cell, line {node.lineno}: the smoke value of {name} is a "
                             f"{type(smoke).__name__}, its default a {type(default).__name__}")
        out.append(Parameter(name, default, smoke, True))
    return out


def notebook_parameters(name: str) -> list[Parameter]:
    """The parameters of notebook ``name`` (``<name>.ipynb`` in the working directory, as
    under JupyterLab and papermill, else in the repository's ``notebooks/``)."""
    for folder in (Path.cwd(), paths.NOTEBOOKS_DIR):
        nb = folder / f"{name}.ipynb"
        if nb.is_file():
            break
    else:
        raise FileNotFoundError(f"notebook {name}.ipynb not found in {Path.cwd()} or {paths.NOTEBOOKS_DIR}")
    for cell in json.loads(nb.read_text())["cells"]:
        if cell["cell_type"] == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            src = cell["source"]
            return parse_parameters("".join(src) if isinstance(src, list) else src)
    raise ValueError(f"{nb} has no code cell tagged 'parameters'")


@dataclass
class NotebookContext:
    name: str
    smoke: bool
    seed: int
    params: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # recorded data this run went without, and why
    changed: dict = field(default_factory=dict)  # parameters other than SMOKE that differ from the cell's

    @property
    def data_dir(self) -> Path:
        return paths.data_dir(self.name)

    @property
    def figures_dir(self) -> Path:
        return paths.figures_dir(self.name)

    def _prov(self, prov: dict) -> dict:
        prov.setdefault("params", self.params)
        prov.setdefault("seed", self.seed)
        prov.setdefault("producer", f"notebooks/{self.name}.ipynb")
        return prov

    def save_figure(self, fig, name: str, *, formats=("png",), **prov):
        return save_figure(fig, self.name, name, formats=formats, **self._prov(prov))

    def save_table(self, df, filename: str, **prov):
        return save_dataframe(df, self.data_dir / filename, **self._prov(prov))

    def save_json(self, obj, filename: str, **prov):
        return save_json(obj, self.data_dir / filename, **self._prov(prov))

    def recorded(self, *data, how_to_record: str | None = None, in_smoke: bool = True,
                 required: bool = True) -> list[Path] | None:
        """The committed recorded data this notebook reads, asked for in one line.

        ``data``: paths under ``data/`` (``"gpu/fma_sqrt.csv"``) or data sets with
        ``files`` and ``how_to_record`` (:class:`dora_num.repro.paths.DataSet`).
        Returns the files' paths; raises :class:`~dora_num.repro.paths.RecordedDataMissing`
        (every missing file and how to record it) if one is missing.  Returns ``None``
        instead, printing why and noting it in :attr:`skipped`, in SMOKE mode when
        ``in_smoke=False``, and for missing data when ``required=False``."""
        files, hows = [], []
        for d in data:
            if hasattr(d, "files"):
                files += list(d.files)
                hows.append(d.how_to_record)
            else:
                files.append(d)
        how = how_to_record or "; ".join(hows)
        if not how:
            raise ValueError("recorded(): say how the data is recorded (how_to_record=...)")
        if self.smoke and not in_smoke:
            return self._skip(f"SMOKE mode does not read {', '.join(map(str, files))}")
        if not required:
            gone = paths.missing(files)
            if gone:
                return self._skip(f"recorded data missing: {', '.join(map(str, gone))} (record it with: {how})")
        return paths.require(files, how)

    def _skip(self, why: str) -> None:
        print(f"{self.name}: running without recorded data: {why}")
        self.skipped.append(why)
        return None


def setup(name: str, namespace: dict | None = None, *, smoke: bool | None = None, seed: int | None = None,
          params: dict | None = None) -> NotebookContext:
    """Prepare a notebook run; ``name`` is the notebook's stem, e.g. ``"00_overview"``.

    With ``namespace`` (the notebook's ``globals()``) the parameters come from the
    notebook's ``parameters`` cell (module docstring); ``smoke``, ``seed`` and ``params``
    then override what the cell gives.  Without it, they are the whole story."""
    values, changed = {}, {}
    if namespace is not None:
        declared = notebook_parameters(name)
        undefined = [p.name for p in declared if p.name not in namespace]
        if undefined:
            raise NameError(f"parameters {undefined} of {name} are not defined: run the parameters cell first")
        is_smoke = bool(namespace.get("SMOKE", False)) if smoke is None else smoke
        for p in declared:
            if namespace[p.name] != p.default:  # passed (papermill -p) or edited in the cell
                changed[p.name] = namespace[p.name]
            elif is_smoke and p.has_smoke:  # not passed explicitly
                namespace[p.name] = p.smoke
            values[p.name] = namespace[p.name]
        smoke = is_smoke
        seed = int(values.get("SEED", 0)) if seed is None else seed
    values.update(params or {})
    smoke = bool(smoke)
    seed = 0 if seed is None else seed
    set_theme()
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    import torch

    torch.manual_seed(seed)
    _choose_output_root(name, smoke, changed)
    return NotebookContext(name=name, smoke=smoke, seed=seed, params=values,
                           changed={k: v for k, v in changed.items() if k != "SMOKE"})


_CHOSEN_ROOT: str | None = None  # the output root the last setup() chose itself (not the caller's)


def _choose_output_root(name: str, smoke: bool, changed: dict) -> Path:
    """Where this run's artifacts go, printed when this function chose it.

    ``DORA_NUM_OUTPUT_ROOT`` set by the caller (the runner's staging folder, a check run, a
    user) wins.  Otherwise a run with the committed parameters writes in place (``data/``,
    ``figures/``: the same bytes, a notebook being deterministic), and a SMOKE run or one with
    any parameter changed (papermill ``-p``) writes under ``build/runs/<notebook>-<digest>/``,
    never over the committed artifacts."""
    global _CHOSEN_ROOT
    env = os.environ.get(paths.OUTPUT_ROOT_ENV)
    if env and env != _CHOSEN_ROOT:
        return paths.output_root()
    if env:  # chosen by an earlier setup() in this kernel: decide again
        del os.environ[paths.OUTPUT_ROOT_ENV]
        _CHOSEN_ROOT = None
    if not smoke and not changed:
        return paths.output_root()
    digest = hashlib.sha256(json.dumps({"SMOKE": smoke, **changed}, sort_keys=True, default=repr).encode()).hexdigest()
    root = paths.REPO_ROOT / "build" / "runs" / f"{name}-{digest[:10]}"
    root.mkdir(parents=True, exist_ok=True)
    os.environ[paths.OUTPUT_ROOT_ENV] = _CHOSEN_ROOT = str(root)
    why = ", ".join(f"{k}={v!r}" for k, v in changed.items()) or "SMOKE"
    print(f"{name}: {why}; artifacts go to {root}/{{data,figures}}/{name}/ (the committed data/ and figures/ "
          f"are not touched; {paths.OUTPUT_ROOT_ENV}=DIR chooses the folder)")
    return root


WIDGETS_ENV = "DORA_NUM_WIDGETS"


def frontend_attached() -> bool:
    """Whether live widgets have a frontend to talk to (notebook 07's panel).

    ``DORA_NUM_WIDGETS=1`` / ``0`` decides (any other value is an error naming the variable).
    Otherwise: True only inside a kernel whose current request came from an interactive
    frontend, i.e. one that accepts ``input()`` (``allow_stdin``: JupyterLab, Notebook, VS Code
    send it true; papermill, nbclient and nbconvert send it false).  A headless run never opens
    a widget comm, so it cannot stall on one (nbclient waits on widget comms it cannot answer;
    the runner also sets ``DORA_NUM_WIDGETS=0``)."""
    env = os.environ.get(WIDGETS_ENV)
    if env is not None and env != "":
        if env not in ("0", "1"):
            raise ValueError(f"{WIDGETS_ENV} must be 0 or 1, got {env!r}")
        return env == "1"
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:
        return False
    parent = kernel.get_parent("shell") or {}  # ipykernel >= 6
    return bool(parent.get("content", {}).get("allow_stdin", False))
