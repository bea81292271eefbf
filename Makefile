# Two entry points (README): `make reproduce` and `make test`. Both build .venv
# from scratch when it is missing. torch and triton are pinned (docs/platform.md):
# an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test reproduce lab clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" "triton==3.7.1" -e ".[test]"
	$(PY) -m ipykernel install --sys-prefix --name dora-num --display-name "Python (dora-num)" >/dev/null
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q

reproduce: venv
	$(PY) -m dora_num reproduce

lab: venv
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks

clean-venv:
	rm -rf $(VENV)
