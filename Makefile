# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY      ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# torch is pinned to the CPU wheel that lies on these machines; an unpinned torch pulls a CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: install demo test lint bench fuzz-slow clean system-deps browser-deps test-torch

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Graphviz's `dot` draws every picture (demo and tests).
system-deps:
	@command -v dot >/dev/null 2>&1 || { echo "installing Debian graphviz (dot)"; \
	  (apt-get update -qq && apt-get install -y -qq graphviz) >/dev/null; }

# A real browser for the viewer's tests only (`make test`); `make demo` never needs it.
browser-deps:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  echo "installing Debian chromium + chromium-driver (browser tests)"; \
	  (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) >/dev/null || \
	  echo "warning: chromium not installed; browser tests will be skipped"; }

$(STAMP): $(BIN)/python setup.cfg setup.py
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH_PIN)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]' $(TORCH_PIN)
	touch $(STAMP)

install: system-deps $(STAMP)

demo: install
	$(BIN)/gradscope demo -o demo.svg

# The gates: lint (ruff.toml), format check, types (setup.cfg [mypy]), then the tests (doctests included).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check gradscope
	$(BIN)/mypy

test: lint browser-deps
	$(BIN)/python -m pytest

bench: install
	$(BIN)/pip install -q --disable-pip-version-check -e '.[bench]' $(TORCH_PIN)
	for b in bench/*_bench.py; do $(BIN)/python $$b || exit 1; done

# The suite on another torch release (slow; never part of `make test`): `make test-torch TORCH=2.14.1`
# (default 2.15.0). Its venv is built once outside the checkout (~15 minutes, ~5 GB for a CUDA build), with
# torch and the third-party deps of setup.cfg only; the checkout runs from PYTHONPATH, so every checkout
# shares it. PYTEST_ARGS picks tests (`PYTEST_ARGS="tests/trace -x"`). Releases above the machine's pip cap
# (2.14.1) install with PIP_CONFIG_FILE=/dev/null.
TORCH         ?= 2.15.0
TORCH_VENV    ?= $(HOME)/.cache/gradscope-torch/$(TORCH)
TORCH_PIP     := $(if $(filter 2.13.% 2.14.%,$(TORCH)),,PIP_CONFIG_FILE=/dev/null) $(TORCH_VENV)/bin/pip \
                 install -q --disable-pip-version-check
PYTEST_ARGS   ?=
# setup.cfg's install_requires and test extras, torch left out (read with the standard library)
DEPS = $(shell $(PY) -c "import configparser as c; p = c.ConfigParser(); p.read('setup.cfg'); \
  o = p['options']['install_requires'] + p['options.extras_require']['test']; \
  print(' '.join(repr(r) for r in map(str.strip, o.splitlines()) if r and r[0] != '\#' and not r.startswith('torch')))")

$(TORCH_VENV)/bin/python:
	$(PY) -m venv $(TORCH_VENV)

$(TORCH_VENV)/.gradscope-deps: setup.cfg | $(TORCH_VENV)/bin/python
	$(TORCH_PIP) torch==$(TORCH)
	$(TORCH_PIP) $(DEPS) torch==$(TORCH)
	touch $@

test-torch: system-deps browser-deps $(TORCH_VENV)/.gradscope-deps
	$(TORCH_VENV)/bin/python -c "import torch, sys; v = torch.__version__.split('+')[0]; \
	  sys.exit(0 if v == '$(TORCH)' else f'$(TORCH_VENV) has torch {v}, not $(TORCH)')"
	cd $(CURDIR) && PYTHONPATH=$(CURDIR) $(TORCH_VENV)/bin/python -m pytest $(PYTEST_ARGS)

fuzz-slow: install
	$(BIN)/python -m pytest tests/fuzz --slow

clean:
	rm -rf $(VENV) *.egg-info demo.svg
