# Every target makes and uses a local virtualenv (.venv) by itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-gpu bench lint format typecheck info clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
