"""Fixtures for the adapter tests: the tiny model of :mod:`._tiny`, exported to a PEFT folder."""

import pytest

from dora_num.adapters import peft_io

from ._tiny import make_base, make_dora


@pytest.fixture
def tiny_export(tmp_path):
    """(base model, DoRA model, adapter dir, base weights file)."""
    from safetensors.torch import save_file

    base = make_base()
    model = make_dora(base)
    adir = peft_io.export_peft_dora(model, tmp_path / "adapter")
    bfile = tmp_path / "base" / "model.safetensors"
    bfile.parent.mkdir()
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(bfile))
    return base, model, adir, bfile.parent
