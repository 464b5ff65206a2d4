# Two commands do everything on a fresh machine:  make demo  |  make test
# Each creates or updates .venv itself (torch is pinned to the CPU wheel 2.13.0).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench venv clean

$(STAMP): pyproject.toml Makefile scripts/setup-system.sh
	bash scripts/setup-system.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/qkv tour

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench

test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m pytest -q -n 2

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'  # the peers: ONNX Runtime, OpenVINO, CTranslate2
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
