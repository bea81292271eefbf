"""Training corpus: (summary line, signature) pairs from the Python standard library.

Real text present on every machine: each public function, class and method of
the standard library's pure-Python modules contributes one pair

    summary   = the first line of its docstring
    signature = its qualified name and parameters, e.g.
                ``json.dumps(obj, *, skipkeys=False, ensure_ascii=True, ...)``

The method in full: docs/methods.md, adapters/corpus.py.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import io
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

CORPUS_NAME = "stdlib_pairs.jsonl.gz"
LICENSE_NAME = "PSF-LICENSE.txt"
VALIDATION_FRACTION = 0.1  # of top-level modules, by hash
MAX_SUMMARY_CHARS = 200
MAX_SIGNATURE_CHARS = 200
# Folders that are tests, tools or vendored code, not library API.
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "idlelib",
               "turtledemo", "ensurepip", "pydoc_data", "__pycache__", "config-3.11-x86_64-linux-gnu"}


@dataclass(frozen=True)
class Pair:
    module: str
    qualname: str
    kind: str  # "function" | "class" | "method"
    summary: str
    signature: str

    def to_json(self) -> dict:
        return {"module": self.module, "qualname": self.qualname, "kind": self.kind,
                "summary": self.summary, "signature": self.signature}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(root: Path, path: Path) -> str | None:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if any(p in _SKIP_PARTS or p.startswith("test") for p in parts):
        return None
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") for p in parts) or any(not p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def _summary(node) -> str | None:
    """First docstring line; None if missing, too short/long, or a signature itself
    (``"name(args) -> type"`` summaries would make the task a string match)."""
    doc = ast.get_docstring(node, clean=True)
    if not doc:
        return None
    line = doc.strip().splitlines()[0].strip()
    if len(line) < 8 or len(line) > MAX_SUMMARY_CHARS or f"{node.name}(" in line:
        return None
    return line


def _params(args: ast.arguments, drop_first: bool) -> str:
    a = ast.arguments(posonlyargs=list(args.posonlyargs), args=list(args.args), vararg=args.vararg,
                      kwonlyargs=list(args.kwonlyargs), kw_defaults=list(args.kw_defaults),
                      kwarg=args.kwarg, defaults=list(args.defaults))
    if drop_first:
        if a.posonlyargs:
            a.posonlyargs.pop(0)
        elif a.args:
            a.args.pop(0)
    for arg in a.posonlyargs + a.args + a.kwonlyargs + ([a.vararg] if a.vararg else []) + ([a.kwarg] if a.kwarg else []):
        arg.annotation = None
        arg.type_comment = None
    return ast.unparse(a)


def _is_static(fn) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def pairs_from_source(source: str, module: str) -> list[Pair]:
    """Every public (summary, signature) pair of one module's source (no import)."""
    tree = ast.parse(source)
    out: list[Pair] = []
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, funcs) and not node.name.startswith("_"):
            s = _summary(node)
            if s:
                out.append(Pair(module, node.name, "function", s, f"{module}.{node.name}({_params(node.args, False)})"))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            init = next((b for b in node.body if isinstance(b, funcs) and b.name == "__init__"), None)
            s = _summary(node)
            if s:
                params = _params(init.args, True) if init is not None else ""
                out.append(Pair(module, node.name, "class", s, f"{module}.{node.name}({params})"))
            for b in node.body:
                if isinstance(b, funcs) and not b.name.startswith("_"):
                    s = _summary(b)
                    if s:
                        q = f"{node.name}.{b.name}"
                        out.append(Pair(module, q, "method", s, f"{module}.{q}({_params(b.args, not _is_static(b))})"))
    return [p for p in out if len(p.signature) <= MAX_SIGNATURE_CHARS]


def _dedupe(pairs: list[Pair]) -> list[Pair]:
    pairs = sorted(pairs, key=lambda p: (p.module, p.qualname))
    seen_pair, seen_summary, seen_sig, out = set(), set(), set(), []
    for p in pairs:
        key_s, key_g = p.summary.casefold(), p.signature
        if (key_s, key_g) in seen_pair or key_s in seen_summary or key_g in seen_sig:
            continue
        seen_pair.add((key_s, key_g))
        seen_summary.add(key_s)
        seen_sig.add(key_g)
        out.append(p)
    return out


def split_of(group: str, validation_fraction: float = VALIDATION_FRACTION) -> str:
    """``"train"`` or ``"validation"``, by sha256 of ``group`` = ``module.TopLevelName``."""
    h = int.from_bytes(hashlib.sha256(group.encode()).digest()[:8], "big") / 2.0**64
    return "validation" if h < validation_fraction else "train"


def extract(root: str | Path | None = None) -> list[dict]:
    """All deduplicated pairs of the standard library at ``root``, each with its split."""
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"standard library folder not found: {root}")
    pairs: list[Pair] = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(root, path)
        if module is None:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            pairs.extend(pairs_from_source(source, module))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few files are deliberately invalid (bad-encoding fixtures)
    return [dict(p.to_json(), split=split_of(f"{p.module}.{p.qualname.split('.')[0]}")) for p in _dedupe(pairs)]


def encode_jsonl_gz(rows: list[dict]) -> bytes:
    """Deterministic gzip bytes (mtime 0, sorted keys)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as gz:
        for r in rows:
            gz.write((json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8"))
    return buf.getvalue()


def load_corpus(path: str | Path | None = None, split: str | None = None) -> list[dict]:
    """Read the committed corpus (or ``path``); optionally one split."""
    if path is None:
        from ..repro.paths import committed_data

        path = committed_data("corpus", CORPUS_NAME)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus not found: {path} (build it: python -m dora_num.adapters.corpus)")
    if split not in (None, "train", "validation"):
        raise ValueError(f"split must be 'train', 'validation' or None, got {split!r}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if split is None or r["split"] == split]


def write_corpus(out_dir: str | Path | None = None) -> Path:
    """Extract and write the corpus + the PSF licence, with provenance."""
    from ..repro.paths import data_dir
    from ..repro.provenance import write_artifact

    out_dir = Path(out_dir) if out_dir is not None else data_dir("corpus")
    rows = extract()
    counts = {s: sum(r["split"] == s for r in rows) for s in ("train", "validation")}
    params = {"stdlib": str(stdlib_dir()), "python": sys.version.split()[0],
              "validation_fraction": VALIDATION_FRACTION, "counts": counts}
    path = write_artifact(out_dir / CORPUS_NAME, encode_jsonl_gz(rows), params=params,
                          producer="dora_num.adapters.corpus",
                          extra={"license": "Python Software Foundation License (text: PSF-LICENSE.txt); "
                                            "docstrings and signatures of the CPython standard library"})
    lic = stdlib_dir() / "LICENSE.txt"
    if lic.is_file():
        write_artifact(out_dir / LICENSE_NAME, lic.read_bytes(), params={"source": str(lic)},
                       producer="dora_num.adapters.corpus")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m dora_num.adapters.corpus [--out DIR]``: extract the corpus again (with provenance)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dora_num.adapters.corpus",
                                 description="Extract the docstring/signature corpus from this Python's standard "
                                             "library and write it to data/corpus/ (with provenance).")
    ap.add_argument("--out", metavar="DIR", default=None, help="output folder (default: data/corpus)")
    p = write_corpus(ap.parse_args(argv).out)
    rows = load_corpus(p)
    print(f"wrote {p} ({p.stat().st_size} bytes): {len(rows)} pairs, "
          f"{sum(r['split'] == 'validation' for r in rows)} validation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
