"""Atomic artifact writes with a provenance sidecar.

Every file under ``data/`` and ``figures/`` is written through :func:`write_artifact`
(or a typed helper built on it).  The file is written to a temporary name in the
same folder and renamed into place (atomic on POSIX); then ``<file>.provenance.json``
records: git sha + dirty flag, parameters, seed, device, library versions, sha256
of the inputs named, sha256 of the artifact.  A crash leaves the old file intact.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from .determinism import lock_hash
from .paths import REPO_ROOT

_UMASK = os.umask(0)
os.umask(_UMASK)

VERSIONED = ("torch", "triton", "numpy", "scipy", "mpmath", "pandas", "matplotlib", "seaborn", "peft", "transformers", "safetensors")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def git_state(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """``{"sha": ..., "dirty": ...}``: ``dirty`` means tracked files outside ``data/``,
    ``figures/`` and ``notebooks/rendered/`` differ from the commit; ``None`` values outside
    a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        # Artifacts themselves are excluded: a reproduce run rewrites data/, figures/ and the
        # rendered notebooks as it goes, which must not mark the code it runs as modified.
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":(exclude)data", ":(exclude)figures", ":(exclude)notebooks/rendered"], cwd=repo,
                                capture_output=True, text=True, check=True).stdout
        return {"sha": sha, "dirty": bool(status.strip())}
    except (OSError, subprocess.CalledProcessError):
        return {"sha": None, "dirty": None}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict[str, Any]:
    from .determinism import cpu_info

    info: dict[str, Any] = {"host_cpu": platform.processor() or platform.machine(), "cuda": False,
                            "cpu": cpu_info()}
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(cuda=True, name=p.name, capability=f"{p.major}.{p.minor}",
                        cuda_runtime=torch.version.cuda, driver=_nvidia_driver())
    except Exception as e:  # noqa: BLE001 - provenance must never break a write
        info["error"] = repr(e)
    return info


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; artifacts are ordinary files
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_artifact(
    path: str | os.PathLike,
    writer: Callable[[io.BytesIO], None] | bytes,
    *,
    params: dict[str, Any] | None = None,
    seed: int | None = None,
    inputs: dict[str, str | os.PathLike] | None = None,
    producer: str | None = None,
    extra: dict[str, Any] | None = None,
    device: dict[str, Any] | None = None,
) -> Path:
    """Write an artifact atomically and its ``.provenance.json`` sidecar.

    ``writer`` is bytes, or a function that writes the artifact into a BytesIO.
    ``inputs`` names files the artifact was derived from (hashed here).
    ``device`` overrides the local device description (for data measured on
    another machine and recorded here).

    An artifact whose bytes equal the file already at ``path`` (with a sidecar that
    names those bytes) is left alone, sidecar included: the sidecar records the
    run that produced these bytes, and a re-run that reproduces them changes no file.
    """
    path = Path(path)
    if isinstance(writer, (bytes, bytearray)):
        data = bytes(writer)
    else:
        buf = io.BytesIO()
        writer(buf)
        data = buf.getvalue()
    if unchanged(path, data):
        return path
    _atomic_write_bytes(path, data)
    input_hashes = {}
    for name, p in (inputs or {}).items():
        p = Path(p)
        if not p.is_file():
            raise FileNotFoundError(f"provenance input {name!r} is not a file: {p}")
        input_hashes[name] = {"path": _rel(p), "sha256": sha256_file(p)}
    sidecar = {
        "artifact": path.name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "producer": producer,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git": git_state(),
        "parameters": params or {},
        "seed": seed,
        "device": device if device is not None else device_info(),
        "versions": versions(),
        "lock_sha256": lock_hash(),
        "inputs": input_hashes,
        "argv": sys.argv[:1],
    }
    if extra:
        sidecar["extra"] = extra
    _atomic_write_bytes(Path(str(path) + ".provenance.json"),
                        (json.dumps(sidecar, indent=2, sort_keys=True, default=str) + "\n").encode())
    return path


def unchanged(path: str | os.PathLike, data: bytes) -> bool:
    """``path`` holds exactly ``data`` and its sidecar says so (nothing to rewrite)."""
    path, side = Path(path), Path(str(path) + ".provenance.json")
    if not (path.is_file() and side.is_file()) or path.stat().st_size != len(data):
        return False
    digest = hashlib.sha256(data).hexdigest()
    try:
        recorded = json.loads(side.read_text()).get("sha256")
    except (OSError, ValueError):
        return False
    return recorded == digest and sha256_file(path) == digest


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def _compressed(data: bytes, name: str) -> bytes:
    """``data`` as the file ``name`` holds it: gzip for ``.gz`` (no timestamp, so equal tables give equal
    bytes), xz for ``.xz`` (preset 9: about 0.6 of gzip's size on the recorded tables), else as is."""
    if name.endswith(".gz"):
        import gzip

        buf = io.BytesIO()
        with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
            gz.write(data)
        return buf.getvalue()
    if name.endswith(".xz"):
        import lzma

        return lzma.compress(data, preset=9)
    return data


def _decompressed(data: bytes, name: str) -> bytes:
    """The inverse of :func:`_compressed`."""
    if name.endswith(".gz"):
        import gzip

        return gzip.decompress(data)
    if name.endswith(".xz"):
        import lzma

        return lzma.decompress(data)
    return data


TABLE_SUFFIXES = (".csv", ".csv.gz", ".csv.xz")


def save_dataframe(df, path, *, float_format: str | None = None, **prov) -> Path:
    """A pandas DataFrame as CSV (``.csv``, ``.csv.gz``, ``.csv.xz``) or Parquet, with provenance.

    ``float_format`` (CSV only), e.g. ``"%.9g"``, which round-trips every float32
    value exactly at about half the digits of float64's shortest repr."""
    path = Path(path)
    name = path.name
    if name.endswith(TABLE_SUFFIXES):
        def w(buf):
            buf.write(_compressed(df.to_csv(index=False, lineterminator="\n", float_format=float_format).encode(), name))
    elif name.endswith(".parquet"):
        def w(buf):
            df.to_parquet(buf, index=False)
    else:
        raise ValueError(f"unsupported table format: {name} (use .csv, .csv.gz, .csv.xz or .parquet)")
    return write_artifact(path, w, **prov)


def recompress(src, dst) -> Path:
    """Move the recorded artifact ``src`` to ``dst`` under another compression (``.gz``, ``.xz`` or none), its
    content unchanged: the new file decompresses to exactly the bytes ``src`` decompresses to (checked before
    anything is written).  The sidecar is ``src``'s with the new name, size and hash, the former ones under
    ``extra.recompressed_from``; ``src`` and its sidecar are removed after ``dst`` is written.  For the data
    budget: a recording is never re-measured to change how it is stored."""
    src, dst = Path(src), Path(dst)
    side = Path(str(src) + ".provenance.json")
    prov = json.loads(side.read_text())
    if prov.get("sha256") != sha256_file(src):
        raise ValueError(f"{side} does not describe {src}: its sha256 differs")
    if dst.exists():
        raise FileExistsError(f"{dst} exists: recompress writes a new file only")
    content = _decompressed(src.read_bytes(), src.name)
    data = _compressed(content, dst.name)
    if _decompressed(data, dst.name) != content:
        raise RuntimeError(f"{dst.name} does not round-trip {src.name}'s content")
    extra = dict(prov.get("extra") or {})
    extra["recompressed_from"] = {"artifact": prov.get("artifact"), "sha256": prov.get("sha256"),
                                  "bytes": prov.get("bytes"), "content_sha256": hashlib.sha256(content).hexdigest()}
    prov.update(artifact=dst.name, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), extra=extra)
    _atomic_write_bytes(dst, data)
    _atomic_write_bytes(Path(str(dst) + ".provenance.json"),
                        (json.dumps(prov, indent=2, sort_keys=True, default=str) + "\n").encode())
    src.unlink()
    side.unlink()
    return dst


def save_json(obj, path, **prov) -> Path:
    return write_artifact(path, (json.dumps(obj, indent=2, sort_keys=True, default=float) + "\n").encode(), **prov)


def set_producer(path, producer: str) -> bool:
    """Rename the producer in ``path``'s sidecar (a recorder renamed since it recorded); the artifact and
    every other field stay, the former name is kept under ``extra.producer_when_recorded``.  Returns
    whether the sidecar changed."""
    side = Path(str(path) + ".provenance.json")
    prov = json.loads(side.read_text())
    if prov.get("producer") == producer:
        return False
    if prov.get("sha256") != sha256_file(path):
        raise ValueError(f"{side} does not describe {path}: its sha256 differs")
    extra = dict(prov.get("extra") or {})
    extra.setdefault("producer_when_recorded", prov.get("producer"))
    prov.update(producer=producer, extra=extra)
    _atomic_write_bytes(side, (json.dumps(prov, indent=2, sort_keys=True, default=str) + "\n").encode())
    return True


# Results of checks made on an artifact's content (``extra.<key>``): a run that reproduces the bytes
# brings the check's current result into the committed sidecar, which otherwise stays as it is.
CHECK_FIELDS = ("text_layout",)


def carry_checks(path, new_sidecar: dict) -> bool:
    """Copy :data:`CHECK_FIELDS` of ``new_sidecar`` (a run that wrote the same bytes) into ``path``'s
    sidecar where they differ; every other field stays.  Returns whether the sidecar changed."""
    side = Path(str(path) + ".provenance.json")
    prov = json.loads(side.read_text())
    if prov.get("sha256") != sha256_file(path) or new_sidecar.get("sha256") != prov.get("sha256"):
        raise ValueError(f"{side} and the new sidecar do not describe the same bytes of {path}")
    new_extra, extra = new_sidecar.get("extra") or {}, dict(prov.get("extra") or {})
    changes = {k: new_extra[k] for k in CHECK_FIELDS if k in new_extra and extra.get(k) != new_extra[k]}
    if not changes:
        return False
    prov["extra"] = {**extra, **changes}
    _atomic_write_bytes(side, (json.dumps(prov, indent=2, sort_keys=True, default=str) + "\n").encode())
    return True


def read_provenance(path) -> dict[str, Any]:
    side = Path(str(path) + ".provenance.json")
    if not side.is_file():
        raise FileNotFoundError(f"no provenance sidecar for {path} (expected {side})")
    return json.loads(side.read_text())
