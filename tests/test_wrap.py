"""``dn.wrap`` (PEFT's target conventions, freezing, counts), the PEFT round trip of a wrapped
model, ``DoRALinear``'s adapter dtypes and given parameters, and merge / unmerge with the
fidelity report."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import dora_num as dn
import dora_num.wrapper
from dora_num.adapters import peft_io
from dora_num.adapters.peft_io import AdapterError, UnsupportedAdapterError
from dora_num.oracles import DoRALinearRef64, dora_linear_ref64, peft_dora_linear, peft_dora_params, \
    perturbed_adapter, set_dora_state, tiny_hf_model

U32, U_BF16 = 2.0**-24, 2.0**-8


def _peft_targets(model, **fields):
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(copy.deepcopy(model), LoraConfig(use_dora=True, r=4, **fields))
    return pm, sorted(n.removeprefix("base_model.model.") for n in pm.base_model.targeted_module_names)


@pytest.mark.parametrize("fields", [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(target_modules=r".*layers\.1\.mlp\.(up|down)_proj"),
    dict(target_modules="all-linear"),
    dict(target_modules="all-linear", exclude_modules=["o_proj"]),
    dict(target_modules=["q_proj", "lm_head"], modules_to_save=["lm_head"]),
], ids=["suffixes", "regex", "all-linear", "exclude", "modules_to_save"])
def test_wrap_targets_freezing_and_counts_are_peft_s(fields, capsys):
    base = tiny_hf_model("llama")
    pm, want = _peft_targets(base, **fields)
    model = dn.wrap(base, r=4, **fields)
    assert sorted(peft_io.dora_linear_modules(model)) == want
    counts = dn.trainable_parameters(model)
    assert counts.trainable == pm.get_nb_trainable_parameters()[0]
    assert str(counts) in capsys.readouterr().out
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B", "magnitude") or n.startswith("lm_head") for n in trainable)


def test_wrap_refuses_what_it_cannot_do():
    import transformers as tf

    with pytest.raises(ValueError, match="match no module"):
        dn.wrap(tiny_hf_model("llama"), ["nothing"], verbose=False)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        dn.wrap(tiny_hf_model("llama"), "(", verbose=False)
    gpt = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16))
    with pytest.raises(UnsupportedAdapterError, match="c_attn.*Conv1D: unsupported module type"):
        dn.wrap(gpt, ["c_attn"], verbose=False)
    model = dn.wrap(tiny_hf_model("llama"), ["q_proj"], verbose=False)
    with pytest.raises(AdapterError, match="already has DoRALinear"):
        dn.wrap(model, ["k_proj"], verbose=False)


@torch.no_grad()
def _perturb(model, seed=0):
    for i, (n, m) in enumerate(sorted(peft_io.dora_linear_modules(model).items())):
        B, mm = perturbed_adapter(m.base.weight.double().cpu(), m.lora_A.double().cpu(), m.scale, seed=seed + i)
        m.lora_B.copy_(B)
        m.magnitude.copy_(mm)


def test_wrapped_model_round_trips_through_peft(tmp_path):
    """Our export loads in PEFT (same logits within the oracle-derived tolerance), and our loader
    reads it back bitwise (same logits, same file bytes)."""
    from peft import PeftModel

    model = dn.wrap(tiny_hf_model("bert"), ["query", "value"], r=4, alpha=8, use_rslora=True, lora_dropout=0.1,
                    modules_to_save=["classifier"], verbose=False)
    _perturb(model)
    with torch.no_grad():
        for p in model.classifier.parameters():
            p.add_(0.3)
    model.eval()
    out = peft_io.export_peft_dora(model, tmp_path / "ours")
    pm = PeftModel.from_pretrained(tiny_hf_model("bert"), str(out)).eval()
    assert pm.peft_config["default"].lora_dropout == 0.1 and pm.peft_config["default"].use_rslora
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model).double()
    for n, m in peft_io.dora_linear_modules(model).items():
        parent, _, leaf = n.rpartition(".")
        setattr(ref.get_submodule(parent), leaf,
                DoRALinearRef64(m.base.weight, m.base.bias, m.lora_A, m.lora_B, m.magnitude, m.scale))
    with torch.no_grad():
        y_ours, y_peft, y_ref = model(input_ids=ids).logits, pm(input_ids=ids).logits, ref(input_ids=ids).logits
    e_ours, e_peft = float((y_ours.double() - y_ref).abs().max()), float((y_peft.double() - y_ref).abs().max())
    floor = U32 * float(y_ref.abs().max())
    assert e_ours <= 2 * e_peft + floor and float((y_ours - y_peft).abs().max()) <= 3 * e_peft + floor
    back = dn.load_adapter(tiny_hf_model("bert"), out).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, y_ours)
    again = peft_io.export_peft_dora(back, tmp_path / "again")
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        assert (again / f).read_bytes() == (out / f).read_bytes(), f


# --------------------------------------------------------------------------
# Adapter dtypes and given parameters
# --------------------------------------------------------------------------

def test_adapters_keep_their_dtypes():
    lin = nn.Linear(12, 7).to(torch.bfloat16)
    layer = dn.DoRALinear(copy.deepcopy(lin), 3)
    assert layer.lora_A.dtype == layer.lora_B.dtype == layer.magnitude.dtype == torch.float32
    assert dn.DoRALinear(copy.deepcopy(lin), 3, adapter_dtype=None).lora_A.dtype == torch.bfloat16
    A, B, m = nn.Parameter(torch.randn(3, 12)), nn.Parameter(torch.randn(7, 3)), nn.Parameter(torch.rand(7) + 1)
    given = dn.DoRALinear(copy.deepcopy(lin), 3, lora_A=A, lora_B=B, magnitude=m)
    assert given.lora_A is A and given.lora_B is B and given.magnitude is m
    with pytest.raises(ValueError, match="given together"):
        dn.DoRALinear(copy.deepcopy(lin), 3, lora_A=A)
    with pytest.raises(ValueError, match=r"lora_B has shape \(7, 3\); the layer needs \[7, 4\]"):
        dn.DoRALinear(copy.deepcopy(lin), 4, lora_A=torch.zeros(4, 12), lora_B=B, magnitude=m)
    with pytest.raises(TypeError, match="adapter_dtype must be one of"):
        dn.DoRALinear(copy.deepcopy(lin), 3, adapter_dtype=torch.int8)


def test_base_out_seam_and_from_peft_share_peft_s_parameters():
    """``forward(x, base_out=x W^T)`` (no bias) is bitwise ``forward(x)``; with a bias the
    layer returns ``base_out + delta`` with ``delta`` on ``base_out - b`` (PEFT's arithmetic).
    ``from_peft`` holds PEFT's very parameter objects and dropout module."""
    torch.manual_seed(0)
    lin = nn.Linear(20, 9, bias=False)
    layer = dn.DoRALinear(lin, 3)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    x = torch.randn(4, 20)
    assert torch.equal(layer(x, base_out=nn.functional.linear(x, lin.weight)), layer(x))
    peft_layer = peft_dora_linear(nn.Linear(20, 9), 3, 6.0)
    ours = dn.DoRALinear.from_peft(peft_layer)
    A, B, m = peft_dora_params(peft_layer)
    assert ours.lora_A is A and ours.lora_B is B and ours.magnitude is m
    assert ours.dropout is peft_layer.lora_dropout["default"] and ours.scale == peft_layer.scaling["default"]
    base = peft_layer.get_base_layer()
    assert ours.base is base and not any(p.requires_grad for p in base.parameters())
    with torch.no_grad():
        B.normal_(0, 0.1)
        y = ours(x, base_out=base(x))
        delta = dn.compose(base(x) - base.bias, nn.functional.linear(nn.functional.linear(x, A), B),
                           ours.magnitude_scale(), ours.scale)
    assert torch.equal(y, base(x) + delta)
    with pytest.raises(TypeError, match="not a PEFT DoRA Linear"):
        dn.DoRALinear.from_peft(nn.Linear(3, 3))


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-model", "fp32-model-bf16-autocast"])
def test_fp32_adapters_on_16bit_compute_like_peft(autocast):
    """fp32 A, B, m with a bf16 W (autocast off: the compose runs in fp32, rounded once), or an
    fp32 model under bf16 autocast: output and gradients held to PEFT's in the same setting by
    the oracle criteria (``e_ours <= 2 e_peft + u max|ref|``, ``d <= 3 e_peft + u max|ref|``)."""
    torch.manual_seed(0)
    dt = torch.float32 if autocast else torch.bfloat16
    lin = nn.Linear(48, 40).to(dt)
    peft_layer = peft_dora_linear(lin, 8, 16.0)
    ours = dn.DoRALinear.from_linear(copy.deepcopy(lin), 8, 16.0)
    A = peft_dora_params(peft_layer)[0].detach().clone()
    assert A.dtype == torch.float32 and ours.lora_A.dtype == torch.float32
    B, m = perturbed_adapter(lin.weight.double(), A.double(), ours.scale, seed=1)
    set_dora_state(peft_layer, A, B, m)
    set_dora_state(ours, A, B, m)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 48, generator=gen).to(dt)
    D = torch.randn(16, 40, generator=gen).to(dt)

    def run(layer, params):
        xr = x.clone().requires_grad_(True)
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(xr)
        (y.float() * D.float()).sum().backward()
        assert y.dtype == torch.bfloat16
        return [y.detach().double()] + [t.grad.double() for t in (xr, *params)]

    got = run(ours, (ours.lora_A, ours.lora_B, ours.magnitude))
    want = run(peft_layer, peft_dora_params(peft_layer))
    leaves = [t.detach().double().requires_grad_(True) for t in (x, A, B, m)]
    y = dora_linear_ref64(leaves[0], lin.weight.double(), lin.bias.double(), *leaves[1:], ours.scale)
    (y * D.double()).sum().backward()
    ref = [y.detach()] + [t.grad for t in leaves]
    for name, a, b, r in zip(("y", "dx", "dA", "dB", "dm"), got, want, ref):
        floor = U_BF16 * float(r.abs().max())
        e_ours, e_peft = float((a - r).abs().max()), float((b - r).abs().max())
        assert e_ours <= 2 * e_peft + floor, (name, e_ours, e_peft, floor)
        assert float((a - b).abs().max()) <= 3 * e_peft + floor, name


# --------------------------------------------------------------------------
# Merge
# --------------------------------------------------------------------------

MERGE_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
               (torch.float16, torch.float32)]
MERGE_IDS = ["fp32", "bf16-fp32-adapters", "bf16-bf16-adapters", "fp16-fp32-adapters"]


@pytest.mark.parametrize("device,dtype,adapter_dtype",
                         [("cpu", *c) for c in MERGE_CASES]
                         + [pytest.param("cuda", *c, marks=pytest.mark.gpu) for c in MERGE_CASES],
                         ids=[f"cpu-{i}" for i in MERGE_IDS] + [f"cuda-{i}" for i in MERGE_IDS])
def test_merge_report_within_bound_and_unmerge_is_bitwise(device, dtype, adapter_dtype):
    """On CUDA the bound takes cuBLAS's reduced-precision reductions and TF32 from torch's flags."""
    model = tiny_hf_model("llama", dtype=dtype).to(device)
    dn.wrap(model, "all-linear", r=4, alpha=8, adapter_dtype=adapter_dtype, verbose=False)
    _perturb(model)
    mods = peft_io.dora_linear_modules(model)
    W0 = {n: m.base.weight.detach().clone() for n, m in mods.items()}
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        y_unmerged = model(input_ids=ids).logits
    report = dn.merge(model, {"input_ids": ids})
    assert len(report.rows) == len(mods) == 14 and report.within_bound, str(report)
    assert all(r.probe_rows == 18 for r in report.rows)  # the layers' own inputs in that forward
    assert all(r.err_merged_vs_unmerged > 0 for r in report.rows) or dtype == torch.float32
    df = report.to_frame()
    assert {"rel_err", "rel_bound", "worst_ratio"} <= set(df.columns)
    with torch.no_grad():
        for m in mods.values():  # merged forward = the base layer with W'
            x = torch.randn(3, m.in_features, device=device).to(dtype)
            assert torch.equal(m(x), nn.functional.linear(x, m.base.weight, m.base.bias))
        y_merged = model(input_ids=ids).logits
    assert y_merged.shape == y_unmerged.shape
    assert dn.unmerge(model) == len(mods)
    assert all(torch.equal(m.base.weight, W0[n]) for n, m in mods.items())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, y_unmerged)


def test_merge_errors():
    layer = dn.DoRALinear(nn.Linear(8, 5), 2)
    with pytest.raises(RuntimeError, match="not merged"):
        layer.unmerge()
    layer.merge()
    with pytest.raises(RuntimeError, match="already merged"):
        layer.merge()
    with pytest.raises(RuntimeError, match="unmerge"):
        layer.weight_norm()
    layer.unmerge()
    half = dn.DoRALinear(nn.Linear(8, 5).half(), 2)
    with torch.no_grad():  # g = 1.5 on a row of 6e4: W' = 9e4 > fp16's max 65504
        half.base.weight[0] = 6e4
        half.magnitude[0] = 1.5 * float(half.weight_norm()[0])
    with pytest.raises(ValueError, match="merged weight .* is not finite in float16"):
        half.merge()
    assert not half.merged


# --------------------------------------------------------------------------
# At initialisation the wrapped model is its base model, bit for bit
# --------------------------------------------------------------------------

def _minilm(dtype=torch.float32):
    from dora_num.adapters.model import load_base_model

    return load_base_model(dtype=dtype)[0]


INIT_MODELS = {  # the real MiniLM (BERT: every linear has a bias) and the tiny Llama (no biases)
    "minilm": (_minilm, ["query", "key", "value", "dense"]),
    "llama": (lambda dtype: tiny_hf_model("llama", dtype=dtype), "all-linear"),
}


def _hidden(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(INIT_MODELS))
def test_wrapped_model_at_init_is_its_base_bitwise(kind, dtype, device):
    """A fresh adapter (B = 0, m from the layer's own norm: g == 1 exactly): every wrapped layer's output
    and the model's output are the base model's, bit for bit, with and without a bias (the base output
    ``x W^T + b`` is formed as the base layer forms it and ``delta`` added to it, PEFT's order)."""
    build, targets = INIT_MODELS[kind]
    base = build(dtype).to(device)  # wrapped where it runs: m from the norm of that device
    ids = torch.randint(0, 1000 if kind == "minilm" else 64, (3, 11), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    want = _hidden(base, ids)
    model = dn.wrap(copy.deepcopy(base), targets, r=4, verbose=False)
    mods = peft_io.dora_linear_modules(model)
    assert mods and (kind == "llama" or all(m.base.bias is not None for m in mods.values()))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, m in mods.items():
            x = torch.randn(3, 7, m.in_features, generator=gen).to(device=device, dtype=dtype)
            assert torch.equal(m.magnitude_scale(), torch.ones(m.out_features, device=device)), n
            y, y0 = m(x), m.base(x)
            assert torch.equal(y.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               y0.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), n
    got = _hidden(model, ids)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------
# The way back to a plain checkpoint, and save_pretrained in PEFT's format
# --------------------------------------------------------------------------

def _saved_base(kind, tmp_path, dtype=torch.float32):
    """The base model saved and loaded back, so that it knows its name_or_path (as a hub model does)."""
    base = _minilm(dtype) if kind == "minilm" else tiny_hf_model("llama", dtype=dtype)
    base.save_pretrained(str(tmp_path / "base"))
    return type(base).from_pretrained(str(tmp_path / "base")).eval()


def _ids(kind):
    return torch.randint(0, 1000 if kind == "minilm" else 64, (2, 9), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("kind,dtype", [("minilm", torch.float32), ("llama", torch.float32),
                                        ("llama", torch.bfloat16)], ids=["minilm", "llama", "llama-bf16"])
def test_merge_and_unload_gives_the_plain_model(kind, dtype, tmp_path):
    """Every wrapped module back to a plain ``nn.Linear`` holding the merged weight in the base dtype, the
    merge report within its bound, and ``save_pretrained`` / ``from_pretrained`` of the original class give
    back the merged model's outputs bit for bit (no missing or unexpected keys)."""
    model = _saved_base(kind, tmp_path, dtype)
    cls = type(model)
    targets = INIT_MODELS[kind][1]
    dn.wrap(model, targets, r=4, verbose=False)
    _perturb(model)
    names = sorted(peft_io.dora_linear_modules(model))
    ids = _ids(kind)
    plain = dora_num.wrapper.merge_and_unload(model, {"input_ids": ids})
    assert plain is model and not peft_io.dora_linear_modules(plain)
    assert all(type(plain.get_submodule(n)) is nn.Linear and plain.get_submodule(n).weight.dtype == dtype
               for n in names)
    report = plain.dora_num_merge_report
    assert len(report.rows) == len(names) and report.within_bound, str(report)
    assert not hasattr(plain, peft_io.SPEC_ATTR) and "save_pretrained" not in plain.__dict__
    want = _hidden(plain, ids)
    plain.save_pretrained(str(tmp_path / "plain"))
    assert not (tmp_path / "plain" / peft_io.CONFIG_NAME).exists()
    back, info = cls.from_pretrained(str(tmp_path / "plain"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(_hidden(back.eval(), ids), want)
    with pytest.raises(ValueError, match="no DoRALinear modules"):
        dora_num.wrapper.merge_and_unload(plain)


@pytest.mark.parametrize("kind", ["minilm", "llama"])
def test_save_pretrained_of_a_wrapped_model_writes_peft_s_format(kind, tmp_path):
    """``save_pretrained`` (and the HF Trainer's ``save_model``) of a wrapped model write PEFT's adapter
    folder: PEFT's ``PeftModel.from_pretrained``, ``AutoPeftModel*``, transformers' own ``from_pretrained``
    of the adapter folder (which reads the magnitude key only as ``lora_magnitude_vector.weight``) and
    this package's loader all give back the model: PEFT's three bitwise alike and held to the fp64 oracle
    as tests/test_wrap.py's round trip holds them; ours bitwise the wrapped model.  A folder with the
    wrapped model's own keys is refused by the loader with what to do."""
    from peft import AutoPeftModel, AutoPeftModelForCausalLM, PeftModel
    from transformers import Trainer, TrainingArguments

    model = _saved_base(kind, tmp_path)
    cls = type(model)
    dn.wrap(model, INIT_MODELS[kind][1], r=4, verbose=False)
    _perturb(model)
    ids = _ids(kind)
    y_ours = _hidden(model, ids)
    model.save_pretrained(str(tmp_path / "saved"))
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [peft_io.CONFIG_NAME, peft_io.SAFETENSORS_NAME]
    cfg = json.loads((tmp_path / "saved" / peft_io.CONFIG_NAME).read_text())
    assert cfg["base_model_name_or_path"] == str(tmp_path / "base")
    assert cfg["auto_mapping"] == {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
            ).save_model(str(tmp_path / "trainer"))
    assert (tmp_path / "trainer" / peft_io.SAFETENSORS_NAME).read_bytes() == \
        (tmp_path / "saved" / peft_io.SAFETENSORS_NAME).read_bytes()

    y_peft = _hidden(PeftModel.from_pretrained(cls.from_pretrained(str(tmp_path / "base")),
                                               str(tmp_path / "saved")).eval(), ids)
    auto = AutoPeftModel if kind == "minilm" else AutoPeftModelForCausalLM
    assert torch.equal(_hidden(auto.from_pretrained(str(tmp_path / "saved")).eval(), ids), y_peft)
    assert torch.equal(_hidden(cls.from_pretrained(str(tmp_path / "saved")).eval(), ids), y_peft)
    back = dn.load_adapter(cls.from_pretrained(str(tmp_path / "base")), tmp_path / "saved").eval()
    assert torch.equal(_hidden(back, ids), y_ours)
    ref = copy.deepcopy(model).double()
    for n, m in peft_io.dora_linear_modules(model).items():
        parent, _, leaf = n.rpartition(".")
        setattr(ref.get_submodule(parent), leaf,
                DoRALinearRef64(m.base.weight, m.base.bias, m.lora_A, m.lora_B, m.magnitude, m.scale))
    y_ref = _hidden(ref, ids)
    e_ours, e_peft = float((y_ours.double() - y_ref).abs().max()), float((y_peft.double() - y_ref).abs().max())
    floor = U32 * float(y_ref.abs().max())
    assert e_ours <= 2 * e_peft + floor and float((y_ours - y_peft).abs().max()) <= 3 * e_peft + floor

    type(model).save_pretrained(model, str(tmp_path / "wrapped_keys"))  # the class's own method: wrapped keys
    with pytest.raises(AdapterError, match=r"holds a dora_num-wrapped model's own state dict .*merge_and_unload"):
        dn.load_adapter(cls.from_pretrained(str(tmp_path / "base")), tmp_path / "wrapped_keys")


def test_nonfinite_error_of_a_wrapped_model_names_the_module_and_step():
    model = dn.wrap(tiny_hf_model("llama"), "all-linear", r=4, verbose=False)
    ids = _ids("llama")
    for _ in range(2):
        _hidden(model, ids)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.lora_B[3, 1] = float("inf")
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.mlp\.up_proj \(DoRALinear\(32->48, r=4\)\), forward "
                                         r"call 3: B contains non-finite values \(0 NaN, 1 Inf\)"):
        _hidden(model, ids)


def test_trainer_checkpoints_of_a_wrapped_model_are_adapter_folders(tmp_path):
    """The HF Trainer saves a wrapped model's checkpoints through its save_pretrained: PEFT adapter folders.
    transformers resumes adapter checkpoints only into a PeftModel and refuses the folder loudly; deleting
    the instance's save_pretrained gives back transformers' own (the wrapped state dict), which resumes
    (docs/peft.md)."""
    from transformers import Trainer, TrainingArguments

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": (i := torch.randint(0, 64, (8,), generator=gen)), "labels": i} for _ in range(6)]

    def run(model, out, steps, resume=None):
        args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=2, report_to=[],
                                 use_cpu=True, save_strategy="steps", save_steps=2, logging_strategy="no",
                                 disable_tqdm=True, dataloader_num_workers=0)
        Trainer(model=model, args=args, train_dataset=data).train(resume_from_checkpoint=resume)

    wrapped = lambda: dn.wrap(tiny_hf_model("llama"), "all-linear", r=4, verbose=False)  # noqa: E731
    run(wrapped(), tmp_path / "a", 2)
    assert (tmp_path / "a" / "checkpoint-2" / peft_io.CONFIG_NAME).is_file()
    with pytest.raises(ValueError, match="Can't find a checkpoint index"):
        run(wrapped(), tmp_path / "a", 4, resume=str(tmp_path / "a" / "checkpoint-2"))
    first = wrapped()
    del first.save_pretrained
    run(first, tmp_path / "b", 2)
    second = wrapped()
    del second.save_pretrained
    run(second, tmp_path / "b", 4, resume=str(tmp_path / "b" / "checkpoint-2"))
