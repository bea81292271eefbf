"""PEFT DoRA adapter IO: round trip, PEFT loads our export, malformed input."""

import json
import math
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from dora_num.adapters import peft_io
from dora_num.adapters.peft_io import AdapterError, load_peft_dora

from ._tiny import D_HID, D_IN, D_OUT, RANK, make_base, make_dora

NAMES = ["encoder.q", "encoder.up"]
MAG = peft_io.NEW_MAGNITUDE_KEY  # how a new export spells the magnitude key


def test_round_trip_is_bitwise(tiny_export):
    base, model, adir, bdir = tiny_export
    states = load_peft_dora(adir, bdir)
    assert [s.name for s in states] == NAMES
    for st in states:
        mod = model.get_submodule(st.name)
        assert torch.equal(st.A, mod.lora_A) and torch.equal(st.B, mod.lora_B) and torch.equal(st.m, mod.magnitude)
        assert torch.equal(st.W, mod.base.weight) and torch.equal(st.bias, mod.base.bias)
        assert st.scale == mod.scale and st.rank == RANK
    # back into DoRALinear on a fresh base: identical module outputs
    rebuilt = peft_io.apply_to_model(make_base(), states)
    x = torch.randn(5, D_IN)
    assert torch.equal(rebuilt(x), model(x))


@pytest.mark.parametrize("base_kind", ["folder", "file", "module", "state_dict"])
def test_base_model_forms(tiny_export, base_kind):
    base, model, adir, bdir = tiny_export
    arg = {"folder": bdir, "file": bdir / "model.safetensors", "module": base, "state_dict": base.state_dict()}[base_kind]
    assert [s.W.shape for s in load_peft_dora(adir, arg)] == [(D_HID, D_IN), (D_OUT, D_HID)]


def _fp64_reference(states, x):
    """The tiny model evaluated in float64 from the loaded states (dora_num.oracles oracle)."""
    from dora_num.oracles import dora_linear_ref64

    st = {s.name: s for s in states}
    h = x.double()
    for name, act in (("encoder.q", torch.relu), ("encoder.up", lambda t: t)):
        s = st[name]
        h = act(dora_linear_ref64(h, s.W.double(), s.bias.double(), s.A.double(), s.B.double(), s.m.double(), s.scale))
    return h


def test_peft_loads_our_export_and_matches(tiny_export):
    """PEFT's own loader on our files; outputs held to the fp64 reference by the
    same-dtype baseline (flash-attention style): PEFT's fp32 error is at most twice
    the error of our fp32 DoRALinear model, plus one fp32 rounding of the output."""
    from peft import PeftModel

    base, model, adir, _ = tiny_export
    peft_model = PeftModel.from_pretrained(make_base(), str(adir))
    peft_model.eval()
    x = torch.randn(64, D_IN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(x), peft_model(x)
    ref = _fp64_reference(load_peft_dora(adir, base), x)
    e_ours = (ours.double() - ref).abs().max().item()
    e_peft = (theirs.double() - ref).abs().max().item()
    floor = 2.0**-24 * ref.abs().max().item()  # one fp32 rounding of the largest output
    assert e_peft <= 2 * e_ours + floor, (e_peft, e_ours)
    # g agrees: PEFT's magnitude is ours, bit for bit
    for n in NAMES:
        lyr = peft_model.base_model.model.get_submodule(n)
        assert torch.equal(lyr.lora_magnitude_vector["default"].weight, model.get_submodule(n).magnitude)


def test_bin_adapter_reads_like_safetensors(tiny_export, tmp_path):
    base, model, adir, bdir = tiny_export
    d = tmp_path / "bin_adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text((adir / "adapter_config.json").read_text())
    torch.save(load_file(str(adir / "adapter_model.safetensors")), str(d / "adapter_model.bin"))
    a, b = load_peft_dora(adir, bdir), load_peft_dora(d, bdir)
    for s1, s2 in zip(a, b, strict=True):
        assert s1.name == s2.name and torch.equal(s1.A, s2.A) and torch.equal(s1.B, s2.B) and torch.equal(s1.m, s2.m)


@pytest.mark.parametrize("use_rslora", [False, True], ids=["alpha_over_r", "rslora"])
def test_scale_from_config(tmp_path, use_rslora):
    base = make_base()
    model = make_dora(base, rank=4, alpha=6.0, use_rslora=use_rslora)
    adir = peft_io.export_peft_dora(model, tmp_path / "a")
    want = 6.0 / math.sqrt(4) if use_rslora else 6.0 / 4
    assert [s.scale for s in load_peft_dora(adir, base)] == [want, want]


def test_rank_and_alpha_patterns(tiny_export):
    base, model, adir, bdir = tiny_export
    cfg = json.loads((adir / "adapter_config.json").read_text())
    cfg["alpha_pattern"] = {"up": 9.0}
    (adir / "adapter_config.json").write_text(json.dumps(cfg))
    s = {st.name: st for st in load_peft_dora(adir, bdir)}
    assert s["encoder.up"].scale == 9.0 / RANK and s["encoder.q"].scale == cfg["lora_alpha"] / RANK
    cfg["rank_pattern"] = {"up": RANK + 1}
    (adir / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="rank 3 but the config says r = 4"):
        load_peft_dora(adir, bdir)


# --------------------------------------------------------------------------
# Malformed input: each case names the problem.
# --------------------------------------------------------------------------

def _edit_weights(adir, fn):
    p = adir / "adapter_model.safetensors"
    t = load_file(str(p))
    fn(t)
    save_file(t, str(p))


def _edit_config(adir, **changes):
    p = adir / "adapter_config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


CASES = {
    "missing_lora_B": (lambda a: _edit_weights(a, lambda t: t.pop("base_model.model.encoder.up.lora_B.weight")),
                       r"missing key\(s\) base_model\.model\.encoder\.up\.lora_B\.weight"),
    "missing_magnitude": (lambda a: _edit_weights(a, lambda t: t.pop(f"base_model.model.encoder.q.{MAG}")),
                          "no lora_magnitude_vector: not a DoRA adapter"),
    "B_wrong_shape": (lambda a: _edit_weights(a, lambda t: t.__setitem__("base_model.model.encoder.up.lora_B.weight",
                                                                          torch.zeros(D_OUT, RANK + 1))),
                      "shape mismatch"),
    "magnitude_wrong_shape": (lambda a: _edit_weights(a, lambda t: t.__setitem__(
        f"base_model.model.encoder.q.{MAG}", torch.ones(D_HID + 1))), "shape mismatch"),
    "use_dora_false": (lambda a: _edit_config(a, use_dora=False), "not DoRA"),
    "not_lora": (lambda a: _edit_config(a, peft_type="IA3"), "not 'LORA'"),
    "bad_rank": (lambda a: _edit_config(a, r=0), "r must be a positive integer"),
    "not_in_target_modules": (lambda a: _edit_config(a, target_modules=["q"]), "'encoder.up' is not covered by the config"),
    "regex_target_excludes": (lambda a: _edit_config(a, target_modules=r".*\.q"), "'encoder.up' is not covered"),
    "no_config": (lambda a: (a / "adapter_config.json").unlink(), "adapter_config.json is missing"),
    "config_not_json": (lambda a: (a / "adapter_config.json").write_text("{not json"), "cannot parse"),
    "no_weights": (lambda a: (a / "adapter_model.safetensors").unlink(), "has neither adapter_model.safetensors"),
    "weights_garbage": (lambda a: (a / "adapter_model.safetensors").write_bytes(b"\x00\x01garbage" * 10),
                        "cannot read .* as safetensors"),
    "no_dora_keys": (lambda a: save_file({"x": torch.zeros(2)}, str(a / "adapter_model.safetensors")),
                     "no lora_A/lora_B/lora_magnitude_vector keys"),
    "nan_in_A": (lambda a: _edit_weights(a, lambda t: t["base_model.model.encoder.up.lora_A.weight"].view(-1).__setitem__(
        3, float("nan"))), r"encoder\.up\.lora_A\.weight contains non-finite values \(1 NaN, 0 Inf\)"),
    "inf_in_magnitude": (lambda a: _edit_weights(a, lambda t: t[f"base_model.model.encoder.q.{MAG}"].view(
        -1).__setitem__(0, float("inf"))), r"encoder\.q\.lora_magnitude_vector contains non-finite values \(0 NaN, 1 Inf\)"),
    "integer_magnitude": (lambda a: _edit_weights(a, lambda t: t.__setitem__(
        f"base_model.model.encoder.q.{MAG}", torch.ones(D_HID, dtype=torch.int32))),
        "lora_magnitude_vector has dtype torch.int32; adapter tensors must be floating point"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_adapter(tiny_export, case):
    base, model, adir, bdir = tiny_export
    edit, msg = CASES[case]
    edit(adir)
    with pytest.raises(AdapterError, match=msg):
        load_peft_dora(adir, bdir)


def test_base_mismatch_missing_module(tiny_export):
    base, model, adir, bdir = tiny_export
    sd = {k: v for k, v in base.state_dict().items() if not k.startswith("encoder.up")}
    with pytest.raises(AdapterError, match="base model mismatch: the adapter targets 'encoder.up'"):
        load_peft_dora(adir, sd)


def test_base_mismatch_shape(tiny_export):
    base, model, adir, bdir = tiny_export
    sd = dict(base.state_dict())
    sd["encoder.q.weight"] = torch.zeros(D_HID, D_IN + 2)
    with pytest.raises(AdapterError, match=r"base model mismatch: module 'encoder.q'.*\[7, 12\]"):
        load_peft_dora(adir, sd)


def test_missing_base(tiny_export, tmp_path):
    base, model, adir, bdir = tiny_export
    with pytest.raises(AdapterError, match="base model not found"):
        load_peft_dora(adir, tmp_path / "nowhere")
    with pytest.raises(AdapterError, match="base_model is required"):
        load_peft_dora(adir, None)


class _Exploit:
    """Unpickling this runs ``open(marker, 'w')``: what a hostile .bin does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_bin_that_executes_code_is_refused(tiny_export, tmp_path):
    base, model, adir, bdir = tiny_export
    marker = tmp_path / "pwned"
    (adir / "adapter_model.safetensors").unlink()
    with open(adir / "adapter_model.bin", "wb") as f:
        pickle.dump({"base_model.model.encoder.q.lora_A.weight": _Exploit(str(marker))}, f)
    # the plain pickle really is hostile (sanity check that the test can fail):
    with open(adir / "adapter_model.bin", "rb") as f:
        for v in pickle.load(f).values():
            v.close()
    assert marker.exists()
    marker.unlink()
    with pytest.raises(AdapterError, match="refused to load"):
        load_peft_dora(adir, bdir)
    assert not marker.exists()


def test_export_refuses_model_without_dora():
    with pytest.raises(AdapterError, match="no DoRALinear modules"):
        peft_io.export_peft_dora(make_base(), "/nonexistent")


def test_reads_an_adapter_written_by_peft(tmp_path):
    """An adapter saved by PEFT's own save_pretrained (rsLoRA, trained-looking values)."""
    from peft import LoraConfig, get_peft_model

    base = make_base()
    pm = get_peft_model(make_base(), LoraConfig(r=RANK, lora_alpha=4, use_dora=True, use_rslora=True,
                                                target_modules=["q", "up"]))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
    pm.save_pretrained(str(tmp_path / "peft_saved"))
    states = {s.name: s for s in load_peft_dora(tmp_path / "peft_saved", base)}
    assert sorted(states) == NAMES
    for n, st in states.items():
        lyr = pm.base_model.model.get_submodule(n)
        assert torch.equal(st.A, lyr.lora_A["default"].weight) and torch.equal(st.B, lyr.lora_B["default"].weight)
        assert torch.equal(st.m, lyr.lora_magnitude_vector["default"].weight)
        assert st.scale == lyr.scaling["default"] == 4 / math.sqrt(RANK)


# --------------------------------------------------------------------------
# PEFT's fields filled; provenance outside the adapter folder
# --------------------------------------------------------------------------

def _wrapped_llama(tmp_path):
    import dora_num as dn
    from dora_num.oracles import tiny_hf_model
    from transformers import LlamaForCausalLM

    tiny_hf_model("llama").save_pretrained(str(tmp_path / "base"))
    model = dn.wrap(LlamaForCausalLM.from_pretrained(str(tmp_path / "base")), ["q_proj", "v_proj"], r=2,
                    verbose=False)
    return model


def test_export_fills_peft_s_fields_and_auto_peft_loads_it(tmp_path):
    """``base_model_name_or_path`` from the model (as PEFT's save_pretrained takes it), ``auto_mapping``
    where ``task_type`` is None (PEFT's own rule), or the ``task_type`` given: ``AutoPeftModelForCausalLM``
    loads both folders (a PeftModelForCausalLM with the task type)."""
    from peft import AutoPeftModelForCausalLM, PeftModelForCausalLM

    model = _wrapped_llama(tmp_path)
    auto = json.loads((peft_io.export_peft_dora(model, tmp_path / "auto") / "adapter_config.json").read_text())
    assert auto["base_model_name_or_path"] == str(tmp_path / "base") and auto["task_type"] is None
    assert auto["auto_mapping"] == {"base_model_class": "LlamaForCausalLM",
                                    "parent_library": "transformers.models.llama.modeling_llama"}
    typed_dir = peft_io.export_peft_dora(model, tmp_path / "typed", task_type="CAUSAL_LM",
                                         base_model_name_or_path=str(tmp_path / "base"))
    typed = json.loads((typed_dir / "adapter_config.json").read_text())
    assert typed["task_type"] == "CAUSAL_LM" and typed["auto_mapping"] is None  # as PEFT writes a typed config
    for d in ("auto", "typed"):
        loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / d))
        assert type(loaded) is PeftModelForCausalLM
    with pytest.raises(ValueError, match="task_type must be one of PEFT's task types"):
        peft_io.export_peft_dora(model, tmp_path / "bad", task_type="CAUSAL")


def test_a_loaded_config_gets_the_fields_peft_fills(tmp_path, tiny_export):
    """A loaded adapter is written back as loaded, except where PEFT's save_pretrained fills a field it left
    empty (the base model's name where the model knows it) or the caller sets one (task_type)."""
    base, model, adir, bdir = tiny_export
    loaded = peft_io.load_adapter(make_base(), adir)
    same = peft_io.export_peft_dora(loaded, tmp_path / "same")
    assert (same / "adapter_config.json").read_bytes() == (adir / "adapter_config.json").read_bytes()
    loaded.name_or_path = "org/tiny"  # what a transformers model loaded from "org/tiny" knows
    named = json.loads((peft_io.export_peft_dora(loaded, tmp_path / "named", task_type="FEATURE_EXTRACTION")
                        / "adapter_config.json").read_text())
    want = json.loads((adir / "adapter_config.json").read_text())
    assert named == {**want, "base_model_name_or_path": "org/tiny", "task_type": "FEATURE_EXTRACTION"}


def test_provenance_goes_outside_the_adapter_folder(tmp_path):
    """By default the folder holds exactly PEFT's two files (an upload of it carries nothing else) and the
    provenance records sit in ``<folder>.provenance/``; with provenance arguments (a recorder of data/)
    they sit beside each file, as every artifact under data/ has them; ``sidecars="none"`` writes none."""
    import hashlib

    model = make_dora(make_base())
    out = peft_io.export_peft_dora(model, tmp_path / "adapter")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    side_dir = tmp_path / "adapter.provenance"
    for f in out.iterdir():
        side = json.loads((side_dir / f"{f.name}.provenance.json").read_text())
        assert side["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
        assert side["producer"] == "dora_num.adapters.peft_io.export_peft_dora"
    rec = peft_io.export_peft_dora(model, tmp_path / "recorded", params={"run": 1}, seed=0)
    assert sorted(p.name for p in rec.iterdir()) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", "adapter_config.json.provenance.json",
         "adapter_model.safetensors.provenance.json"])
    none = peft_io.export_peft_dora(model, tmp_path / "plain", sidecars="none")
    assert len(list(none.iterdir())) == 2 and not (tmp_path / "plain.provenance").exists()
    with pytest.raises(ValueError, match="sidecars must be one of"):
        peft_io.export_peft_dora(model, tmp_path / "x", sidecars="inside")
