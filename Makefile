# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY      ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# torch is pinned to the CPU wheel that lies on these machines; an unpinned torch pulls a CUDA build.
TORCH   := torch==2.13.0

.PHONY: install demo test lint bench fuzz-slow clean system-deps browser-deps

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
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]' $(TORCH)
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
	$(BIN)/pip install -q --disable-pip-version-check -e '.[bench]' $(TORCH)
	for b in bench/*_bench.py; do $(BIN)/python $$b || exit 1; done

fuzz-slow: install
	$(BIN)/python -m pytest tests/fuzz --slow

clean:
	rm -rf $(VENV) *.egg-info demo.svg
