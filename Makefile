# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: demo check test slow-tlc lint typecheck unit fast bench mutants extras-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -U pip
	# torch==2.13.0 is pinned: its CPU wheel is local; a range would pull a CUDA build.
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,torch,hf,vlm,accelerate,lightning,peft,trl]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/odb demo

lint: $(STAMP)
	$(VENV)/bin/ruff check odb_core simulator tests benchmarks tools examples
	$(VENV)/bin/ruff format --check odb_core simulator tests benchmarks tools examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy odb_core simulator benchmarks

# The fast tier (tests/conftest.py, README "Tests"): the pure and in-process tests,
# no TLC, no ranks or examples as processes; `make check` adds lint and types
# (target: under 2 minutes on a quiet 2-core box). `make test` still runs every test.
# Both tiers run on two pytest-xdist workers, a group per module (tests/conftest.py).
UNIT_JOBS ?= 2
FAST := not tlc and not procs and not slow
fast: $(STAMP)
	$(VENV)/bin/pytest -n $(UNIT_JOBS) --dist loadgroup -m "$(FAST)"

check: lint typecheck fast

# Every test, TLC and the torchrun examples included, but the manifest's four slow
# TLC models (bounded-domain inductive checks, about 4 min of both cores):
# `make slow-tlc` runs those, and CI (.ci/run) runs it after `make test`.
# Includes the fixed mutation regression (tests/test_oracle_overshoot.py,
# tests/test_core_edges.py; docs/VERIFICATION.md); `make mutants` is the full run.
# The process tests wait on timers and peers much of the time, which the other
# worker fills.
unit: $(STAMP)
	$(VENV)/bin/pytest -n $(UNIT_JOBS) --dist loadgroup -m "not slow_tlc" --durations=15

test: lint typecheck unit

slow-tlc: $(STAMP)
	$(VENV)/bin/pytest -m slow_tlc

bench: $(STAMP)
	$(VENV)/bin/pytest benchmarks --benchmark-enable --benchmark-columns=median,mean,rounds

# Each trainer extra alone ([torch,hf], [torch,accelerate], [torch,lightning],
# [torch,trl], [torch,peft]) in a fresh venv under .venv-extras/ builds its trainer
# on a tiny model and steps it once (tools/extras_check.py): a dependency the test
# venv, holding every extra, hides. Not part of `make test`; CI (.ci/run) runs it.
EXTRAS ?=
extras-check:
	$(PYTHON) tools/extras_check.py $(EXTRAS)

# Mutation testing (docs/VERIFICATION.md): mutmut mutates a copy of the runtime core
# and the torch pipeline under mutants/ (never the working tree) and runs the fast
# test selection of [tool.mutmut] in pyproject.toml. Long: hours on 2 cores.
# MUTANTS='odb_core.window.*' narrows the run; MUTANT_JOBS sets the workers.
MUTANT_JOBS ?= 2
MUTANTS ?=
mutants: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[mutants]'
	$(VENV)/bin/mutmut run --max-children $(MUTANT_JOBS) $(MUTANTS)
	$(PY) tools/mutation_score.py --survivors

clean:
	rm -rf $(VENV) .venv-extras .pytest_cache .mypy_cache .ruff_cache mutants
