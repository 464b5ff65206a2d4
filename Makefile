# Two commands do everything on a fresh machine:  make demo  |  make test
# Each creates or updates .venv itself (torch is pinned to the CPU wheel 2.13.0).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test wheel-test arm-test lint bench venv clean

# The kernels (src/qkv/csrc) are compiled here, once per CPU level (~5 min on 2 cores; ninja
# recompiles only what changed), against the venv's torch: hence --no-build-isolation.
$(STAMP): pyproject.toml setup.py Makefile scripts/setup-system.sh $(wildcard src/qkv/csrc/*)
	bash scripts/setup-system.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 setuptools ninja
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# the tour's pages and pictures go into one folder that git ignores, not the repository root
DEMO_OUT ?= demo-out
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/qkv tour --out-dir $(DEMO_OUT)
	@echo "make demo: pages and pictures written to $(DEMO_OUT)/ (translation.html, attention.html, *.png)"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench

test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m pytest -q -n 2

# the wheel, installed into a fresh venv with no compiler on PATH, its kernel tests run there
wheel-test: $(STAMP)
	bash scripts/wheel-test.sh

# the kernel tests on the Arm level, cross-compiled and run under QEMU (root the first time:
# qemu-user, debootstrap, binfmt_misc; ~1.3 GB kept in ~/.cache/qkv-arm)
arm-test: $(STAMP)
	bash scripts/arm-test.sh

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'  # the peers: ONNX Runtime, OpenVINO, CTranslate2
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info src/qkv/_C_*.kernels src/qkv/kernels/_built.json
