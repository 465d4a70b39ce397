# The two set-up commands of the README. Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-dev

.PHONY: demo test bench

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
