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

# The embedded default: a tiny random Llama (written once by init-model) and the bundled prompts,
# sampled by the engine on CPU JAX. (`pagefleet run configs/demo.yaml` on Ray replaces this once the run path lands.)
DEMO_MODEL := models/tiny-llama
demo: $(STAMP)
	test -f $(DEMO_MODEL)/config.json || $(VENV)/bin/pagefleet init-model --preset tiny-llama --output $(DEMO_MODEL)
	JAX_PLATFORMS=cpu $(VENV)/bin/pagefleet generate --model $(DEMO_MODEL) --input configs/data/demo_prompts.jsonl \
		--output manifests/demo/samples.jsonl --sampling.max_new_tokens=32 --engine.max_seq_len=512 --engine.max_pages=256

test: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python benchmarks/step_bench.py

bench-plan: $(STAMP)
	JAX_PLATFORMS=cpu RAY_AUTH_MODE=disabled $(VENV)/bin/python benchmarks/plan_bench.py --num-prompts 1000000 --num-cpus 2
