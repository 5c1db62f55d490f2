# Every target makes and uses a local virtualenv (.venv) by itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Extras installed into .venv; CI adds ray (`make test EXTRAS=dev,ray`) so the Ray tests run.
EXTRAS ?= dev
# TORCH=cpu also installs torch's CPU build (2.13.0), so the torch adapter's tests run without
# a GPU (CI does; elsewhere that version may be a large CUDA build: leave TORCH empty).
TORCH  ?=
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))$(if $(TORCH),-torch-$(TORCH))

.PHONY: demo test test-gpu bench lint format typecheck info dist wheel-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(if $(filter cpu,$(TORCH)),$(PY) -m pip install -q 'torch==2.13.0')
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/fanout.py

test: $(STAMP)
	$(PY) -m pytest tests

# CPython's own multiprocessing tests against gpushare (docs/compat.md); skips, exit 0,
# where this Python has no `test` package.
.PHONY: compat
compat: $(STAMP)
	$(PY) tests/compat/run.py

test-gpu: $(STAMP)
	$(PY) -m pytest tests -m gpu --require-gpu

bench: $(STAMP)
	$(PY) -m pip install -q 'matplotlib>=3.7' || echo "matplotlib not installed: the benchmark skips its plot"
	$(PY) -m gpushare.bench

info: $(STAMP)
	$(PY) -m gpushare info

lint: $(STAMP)
	$(PY) -m ruff check gpushare tests examples
	$(PY) -m ruff format --check gpushare tests examples

format: $(STAMP)
	$(PY) -m ruff format gpushare tests examples
	$(PY) -m ruff check --fix gpushare tests examples

typecheck: $(STAMP)
	$(PY) -m mypy

# sdist and wheel of the distribution gpushare-mp, in dist/
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .

# The built wheel, installed in a fresh virtualenv outside the checkout: the
# example and the CPU tests run against it (catches files missing from the package).
wheel-check: dist
	PYTHON=$(PYTHON) .ci/wheel-check dist

clean:
	rm -rf $(VENV) dist build *.egg-info .pytest_cache .mypy_cache .ruff_cache
