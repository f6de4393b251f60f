# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0, installed before the project so that nothing else picks a torch for us. On this
# workplace's machines and CI, pip's configured find-links (/opt/wheels) hold the CPU build of exactly
# this release (2.13.0+cpu), so the pin installs that local wheel instead of downloading PyPI's
# multi-GB CUDA build; everything here runs on CPU. Elsewhere PyPI serves the CUDA build of 2.13.0,
# which works too. On a GPU machine, choose your own build: make TORCH_SPEC='torch==X.Y.Z'.
TORCH_SPEC ?= torch==2.13.0
# pytest workers: most tests are single-threaded Python (the Triton interpreter), so one per core.
TEST_WORKERS ?= 2
DEMO_HOME ?= $(CURDIR)/.kb-demo
DEMO_SPEC ?= examples/specs/sliding_window.py
KB := KB_HOME=$(DEMO_HOME) $(VENV)/bin/kb

.PHONY: venv demo test clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# Offline except for the package index: ingest the pinned corpus, answer a query, generate a verified kernel.
demo: venv
	$(KB) init
	$(KB) ingest --all
	$(KB) stats
	$(KB) query $(DEMO_SPEC) -k 3
	$(KB) generate $(DEMO_SPEC) --out $(DEMO_HOME)/out

# lint, types (pyproject's [tool.mypy] files), the layer contract ([tool.importlinter]), then the suite
test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	bash tests/install_services.sh
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

clean:
	rm -rf $(VENV) $(DEMO_HOME)
