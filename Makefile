# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; override on a machine with a GPU (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
DEMO_HOME ?= $(CURDIR)/.kb-demo

.PHONY: venv demo test clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: venv
	KB_HOME=$(DEMO_HOME) $(VENV)/bin/kb init
	KB_HOME=$(DEMO_HOME) $(VENV)/bin/kb stats

test: venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(DEMO_HOME)
