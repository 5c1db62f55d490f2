# Every target makes and uses a local virtualenv (.venv) by itself; each installs only what it
# needs (`make demo`: gpushare alone; `make test`: the test tools; `make docs`: MkDocs).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Extras installed into .venv; CI adds ray (`make test EXTRAS=dev,ray`) so the Ray tests run.
EXTRAS ?= dev
# TORCH=cpu also installs torch's CPU build (2.13.0), so the torch adapter's tests run without
# a GPU (CI does; elsewhere that version may be a large CUDA build: leave TORCH empty).
TORCH  ?=
comma  := ,
# The Python that makes .venv, as "3.11"; a .venv made by another one is remade (see $(BASE)).
PYVER  := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
BASE   := $(VENV)/.base-$(PYVER)
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))$(if $(TORCH),-torch-$(TORCH))-$(PYVER)
DOCS_STAMP := $(VENV)/.installed-docs-$(PYVER)

.PHONY: demo test test-gpu bench lint format typecheck info docs docs-serve dist wheel-check clean

# .venv with gpushare alone. Python 3.10 or newer is checked first; a .venv left by another
# Python (or by a failed first run) is removed and made again, and says so.
$(BASE): pyproject.toml setup.py gpushare/_core.c gpushare/_region.c gpushare/_handoff.c gpushare/_cuda/_queries.c
	@test -n "$(PYVER)" || { echo "make: '$(PYTHON)' does not run; install Python >= 3.10 or pass PYTHON=python3.X" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "make: gpushare needs Python >= 3.10, and '$(PYTHON)' is $(PYVER); pass PYTHON=python3.X (3.10 or newer)" >&2; exit 1; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || { echo "make: '$(PYTHON)' has no venv/ensurepip module; install it (Debian/Ubuntu: apt install python$(PYVER)-venv)" >&2; exit 1; }
	@if [ -e $(VENV) ] && [ "$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" != "$(PYVER)" ]; then \
		echo "make: $(VENV) was made by another Python (or is broken); removing it and making it again with $(PYTHON) $(PYVER)"; \
		rm -rf $(VENV); fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(BASE)

$(STAMP): $(BASE)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(if $(filter cpu,$(TORCH)),$(PY) -m pip install -q 'torch==2.13.0')
	touch $(STAMP)

$(DOCS_STAMP): $(BASE)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

demo: $(BASE)
	$(PY) examples/fanout.py

# TESTS: what `make test` runs (default: the whole suite), e.g. `make test TESTS=tests/test_queues.py`.
TESTS  ?= tests

test: $(STAMP)
	$(PY) -m pytest $(TESTS)

# The queue, process and pickling tests on each Python from 3.10 to 3.13 (each in .venv-3.X, found by
# .ci/python-for), then once more with the compiled paths off (GPUSHARE_NATIVE=0).
MATRIX_PYTHONS ?= 3.10 3.11 3.12 3.13
MATRIX_TESTS   ?= tests/test_queue_edges.py tests/test_queues.py tests/test_queue_native.py \
	tests/test_queue_chaos.py tests/test_stdin_script.py tests/test_pickling_errors.py tests/test_process_args.py \
	tests/test_pipes.py tests/test_dtypes.py tests/test_shutdown_in_flight.py
.PHONY: test-matrix
test-matrix:
	@for v in $(MATRIX_PYTHONS); do \
		py=$$(.ci/python-for $$v) || exit 1; \
		echo "== Python $$v ($$py)"; \
		$(MAKE) --no-print-directory test PYTHON=$$py VENV=.venv-$$v TESTS="$(MATRIX_TESTS)" || exit 1; \
	done
	@echo "== the compiled paths off (GPUSHARE_NATIVE=0)"
	GPUSHARE_NATIVE=0 $(MAKE) --no-print-directory test TESTS="$(MATRIX_TESTS)"

# CPython's own multiprocessing tests against gpushare (docs/multiprocessing.md); skips, exit 0,
# where this Python has no `test` package.
.PHONY: compat
compat: $(STAMP)
	$(PY) tests/compat/run.py

test-gpu: $(STAMP)
	$(PY) -m pytest tests -m gpu --require-gpu

bench: $(STAMP)
	$(PY) -m pip install -q 'matplotlib>=3.7' || echo "matplotlib not installed: the benchmark skips its plot"
	$(PY) -m bench

info: $(BASE)
	$(PY) -m gpushare info

lint: $(STAMP)
	$(PY) -m ruff check setup.py gpushare bench tools tests examples
	$(PY) -m ruff format --check setup.py gpushare bench tools tests examples

format: $(STAMP)
	$(PY) -m ruff format setup.py gpushare bench tools tests examples
	$(PY) -m ruff check --fix setup.py gpushare bench tools tests examples

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

# The documentation site (MkDocs), in site/; --strict: a broken link or an API name that does not
# resolve fails the build.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

clean:
	rm -rf $(VENV) dist build site *.egg-info .pytest_cache .mypy_cache .ruff_cache
