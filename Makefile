# The two set-up commands of the README. Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-dev

.PHONY: demo test bench bench-plan

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pagefleet demo

test: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python benchmarks/step_bench.py

bench-plan: $(STAMP)
	JAX_PLATFORMS=cpu RAY_AUTH_MODE=disabled $(VENV)/bin/python benchmarks/plan_bench.py --num-prompts 1000000 --num-cpus 2
