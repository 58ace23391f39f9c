# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -U pip
	# torch==2.13.0 is pinned: its CPU wheel is local; a range would pull a CUDA build.
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,torch,hf,accelerate,lightning]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/odb demo

lint: $(STAMP)
	$(VENV)/bin/ruff check odb_core simulator tests benchmarks
	$(VENV)/bin/ruff format --check odb_core simulator tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy odb_core

unit: $(STAMP)
	$(VENV)/bin/pytest

test: lint typecheck unit

bench: $(STAMP)
	$(VENV)/bin/pytest benchmarks --benchmark-enable --benchmark-columns=median,mean,rounds

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
