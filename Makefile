# Two commands do everything on a fresh machine:  make demo  |  make test
# Each creates or updates .venv itself (torch 2.13.0, the CPU build: scripts/install-torch.sh).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test wheel-test arm-test arm-test-ci lint bench site venv clean

# The kernels (src/qkv/csrc) are compiled here, once per CPU level (4.6 min for the four x86
# levels on 2 cores of an Intel Xeon; ninja recompiles only what changed), against the venv's torch: hence
# --no-build-isolation. They are built in a step of their own, which says which level is
# compiling and for how long (pip -q would show nothing for minutes; the compiler's commands
# go to build/kernels.log, shown if it fails; the libraries to build/venv-lib, not where a
# wheel's build looks); the editable install then finds the objects built and only links
# them again.
$(STAMP): pyproject.toml setup.py Makefile scripts/setup-system.sh scripts/install-torch.sh \
         web/package-lock.json \
         $(wildcard src/qkv/csrc/*)
	bash scripts/setup-system.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	bash scripts/install-torch.sh $(PY) torch==2.13.0 setuptools ninja
	@mkdir -p build
	$(PY) setup.py -q build_ext --inplace --build-lib build/venv-lib > build/kernels.log \
	    || { tail -n 60 build/kernels.log; exit 1; }
	$(PY) -m pip install -q --no-build-isolation -e '.[dev,web]'
	@# ONNX Runtime Web, pinned by web/package-lock.json: the static site's engine and its tests
	npm ci --prefix web --no-audit --no-fund --silent
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
# qemu-user, debootstrap, binfmt_misc; ~1.3 GB kept in ~/.cache/qkv-arm): all of tests/kernels;
# arm-test-ci, what CI runs: every kernel family once (the subset in scripts/arm-test.sh)
arm-test: $(STAMP)
	bash scripts/arm-test.sh

arm-test-ci: $(STAMP)
	bash scripts/arm-test.sh --ci

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'  # the peers: ONNX Runtime, OpenVINO, CTranslate2
	$(PY) bench/attention.py

# the docs and, under them, the explorer running in the page (site/live/), as GitHub Pages
# serves them (.github/workflows/pages.yml): mkdocs first (it empties site/), then qkv web
# build, whose in-page engine needs the [web] extra and ONNX Runtime Web from web/'s lock file
SITE ?= site
site: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m mkdocs build --strict --site-dir $(SITE)
	HF_HUB_OFFLINE=1 $(VENV)/bin/qkv web build $(SITE)/live
	@echo "make site: $(SITE)/ (the explorer: $(SITE)/live/); try: $(PY) -m http.server -d $(SITE)"

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info src/qkv/_C_*.kernels src/qkv/kernels/_built.json
