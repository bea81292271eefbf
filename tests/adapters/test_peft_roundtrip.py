"""Adapters saved by PEFT itself: loaded into DoRALinear and exported again, bitwise the same
files (tensors, key spelling, modules_to_save weights, saved biases, every config field);
entries that cannot be applied and unsupported module types raise, naming the problem."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dora_num.adapters import peft_io
from dora_num.adapters.peft_io import AdapterError, UnsupportedAdapterError, load_adapter, load_peft_dora
from dora_num.oracles import perturb_peft_dora, tiny_hf_model

FILES = ("adapter_model.safetensors", "adapter_config.json")

# (id, model kind, model dtype, LoraConfig fields, number of non-DoRA entries PEFT saves):
# patterns, dropout, bias modes, rsLoRA, heads
CASES = [
    ("bert-seqcls-bf16", "bert", torch.bfloat16,
     dict(r=4, lora_alpha=8, task_type="SEQ_CLS", lora_dropout=0.1, target_modules=["query", "value", "dense"],
          rank_pattern={"value": 2}, alpha_pattern={"query": 5}), 2),  # classifier weight, bias
    ("bert-regex-lora-only-bias", "bert", torch.float32,
     dict(r=3, lora_alpha=6, target_modules=r".*\.attention\.self\.(query|key)", bias="lora_only",
          modules_to_save=["classifier"]), 4 + 2),  # 2 layers x (query, key) biases + head
    ("bert-bias-all", "bert", torch.float32, dict(r=2, lora_alpha=3, target_modules=["query"], bias="all"),
     1 + 2 * 8 + 1 + 1),  # every bias: embeddings LayerNorm, 8 per layer, pooler, classifier
    ("llama-all-linear-rslora-head", "llama", torch.float32,
     dict(r=4, lora_alpha=16, use_rslora=True, target_modules="all-linear", modules_to_save=["lm_head"]), 1),
]


def _peft_saved(tmp_path, kind, dtype, fields, seed=0):
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(tiny_hf_model(kind, seed=seed, dtype=dtype), LoraConfig(use_dora=True, **fields))
    perturb_peft_dora(pm, seed=seed + 10)
    gen = torch.Generator().manual_seed(seed + 20)
    with torch.no_grad():  # the non-DoRA trainable entries (heads, biases) trained-looking too
        for n, p in pm.named_parameters():
            if p.requires_grad and "lora_" not in n:
                p.add_((0.1 * torch.randn(p.shape, generator=gen)).to(p.dtype))
    pm.save_pretrained(str(tmp_path / "peft"))
    return pm, tmp_path / "peft"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reexport_of_a_peft_adapter_is_bitwise(tmp_path, case):
    _, kind, dtype, fields, n_extra = case
    pm, adir = _peft_saved(tmp_path, kind, dtype, fields)
    model = load_adapter(tiny_hf_model(kind, dtype=dtype), adir)
    # what the file holds is applied: DoRA factors keep their dtype, the rest sits in the model
    extra = {k: t for k, t in load_file(str(adir / FILES[0])).items() if ".lora_" not in k}
    assert len(extra) == n_extra
    for k, t in extra.items():
        p = peft_io.model_parameter(model, k.removeprefix("base_model.model.").replace(".base_layer.", "."))
        assert p is not None and p.requires_grad and torch.equal(p.detach(), t), k
    for mod in peft_io.dora_linear_modules(model).values():
        assert mod.lora_A.dtype == mod.lora_B.dtype == mod.magnitude.dtype == torch.float32
        assert getattr(mod.dropout, "p", 0.0) == fields.get("lora_dropout", 0.0)
    out = peft_io.export_peft_dora(model, tmp_path / "ours")
    for f in FILES:
        assert (out / f).read_bytes() == (adir / f).read_bytes(), f


def test_reexport_after_training_writes_the_trained_values(tmp_path):
    pm, adir = _peft_saved(tmp_path, "bert", torch.float32, CASES[1][3])
    model = load_adapter(tiny_hf_model("bert"), adir)
    trainable = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in trainable:
            p.add_(1.0)
    out = load_file(str(peft_io.export_peft_dora(model, tmp_path / "ours") / FILES[0]))
    ref = load_file(str(adir / FILES[0]))
    assert sorted(out) == sorted(ref)
    assert all(torch.equal(out[k], ref[k] + 1.0) for k in ref)
    # and only the adapter is trainable: adapters, the classifier head, the saved biases
    n_file = sum(t.numel() for t in ref.values())
    assert sum(p.numel() for p in trainable) == n_file


def test_entry_that_cannot_be_applied_is_an_error(tmp_path):
    pm, adir = _peft_saved(tmp_path, "bert", torch.float32, CASES[1][3])
    t = load_file(str(adir / FILES[0]))
    t["base_model.model.bert.pooler.extra_head.weight"] = torch.zeros(3)
    save_file(t, str(adir / FILES[0]))
    with pytest.raises(AdapterError, match=r"'base_model\.model\.bert\.pooler\.extra_head\.weight' cannot be "
                                           r"applied: the model has no parameter 'bert\.pooler\.extra_head\.weight'"):
        load_adapter(tiny_hf_model("bert"), adir)


def test_head_in_another_dtype_is_not_rounded_silently(tmp_path):
    pm, adir = _peft_saved(tmp_path, "bert", torch.float32, CASES[1][3])
    model = tiny_hf_model("bert", dtype=torch.bfloat16)
    with pytest.raises(AdapterError, match="is torch.float32 but the model's parameter .* is torch.bfloat16: "
                                           "copying would round it"):
        load_adapter(model, adir)
    assert not peft_io.dora_linear_modules(model), "nothing is changed before every entry is checked"
    load_adapter(model, adir, round_extra=True)  # asked for: rounded as PEFT's loader rounds
    want = load_file(str(adir / FILES[0]))["base_model.model.classifier.weight"].to(torch.bfloat16)
    assert torch.equal(model.classifier.weight.detach(), want)


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.emb = nn.Embedding(10, 6)
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        return self.lin(self.emb(x))


@pytest.mark.parametrize("target,what", [("conv", "Conv DoRA"), ("emb", "Embedding DoRA")])
def test_conv_and_embedding_dora_are_called_unsupported(tmp_path, target, what):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    pm = get_peft_model(_ConvNet(), LoraConfig(r=2, use_dora=True, target_modules=[target, "lin"]))
    pm.save_pretrained(str(tmp_path / "a"))
    with pytest.raises(UnsupportedAdapterError, match=f"{what}.*not supported"):
        load_peft_dora(tmp_path / "a", _ConvNet())


def test_conv1d_base_is_called_unsupported_not_a_mismatch(tmp_path):
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    cfg = tf.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    torch.manual_seed(0)
    pm = get_peft_model(tf.GPT2LMHeadModel(cfg), LoraConfig(r=2, use_dora=True, target_modules=["c_attn"],
                                                            fan_in_fan_out=True))
    pm.save_pretrained(str(tmp_path / "a"))
    torch.manual_seed(0)
    with pytest.raises(UnsupportedAdapterError, match=r"transformer\.h\.0\.attn\.c_attn.*Conv1D.*"
                                                      r"fan_in_fan_out.*unsupported module type"):
        load_adapter(tf.GPT2LMHeadModel(cfg), tmp_path / "a")


def test_config_that_no_longer_describes_the_model_is_refused(tmp_path):
    pm, adir = _peft_saved(tmp_path, "bert", torch.float32, CASES[1][3])
    model = load_adapter(tiny_hf_model("bert"), adir)
    with torch.no_grad():
        next(iter(peft_io.dora_linear_modules(model).values())).alpha = 99.0
    with pytest.raises(AdapterError, match="no longer matches the adapter config.*alpha 99.0"):
        peft_io.export_peft_dora(model, tmp_path / "ours")


def test_config_fields_survive_a_new_base_model_name(tmp_path):
    pm, adir = _peft_saved(tmp_path, "bert", torch.bfloat16, CASES[0][3])
    model = load_adapter(tiny_hf_model("bert", dtype=torch.bfloat16), adir)
    out = peft_io.export_peft_dora(model, tmp_path / "ours", base_model_name_or_path="my/base")
    a, b = json.loads((adir / FILES[1]).read_text()), json.loads((out / FILES[1]).read_text())
    assert b.pop("base_model_name_or_path") == "my/base"
    a.pop("base_model_name_or_path")
    assert a == b
