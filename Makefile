# The two set-up commands of the README. Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-dev

.PHONY: demo test check-peer-chat check-peer-sampling bench bench-plan bench-export bench-host bench-generate bench-peer bench-swap bench-ab bench-resume bench-structured bench-moe bench-peak bench-attention

# pip is quiet (-q: pages of resolver output otherwise), so each step says first what it does and how long it takes.
$(STAMP): pyproject.toml
	@echo "make: creating $(VENV) and installing pagefleet with its dev dependencies (JAX, Ray, transformers, CPU torch): 3 to 5 minutes, once"
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	@echo "make: building the CPU attention kernel (under a minute, once)"
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(VENV)/bin/python -m engine.kernels.kernel_build  # the CPU attention kernel, built once here rather than by the first job
	touch $(STAMP)

# The embedded default: a tiny random Llama (written once by init-model), the bundled corpus of 1,200 prompts,
# two slices on a local Ray started in-process, CPU JAX. Run it again and it finds every batch done.
DEMO_MODEL := models/tiny-llama
demo: $(STAMP)
	test -f $(DEMO_MODEL)/config.json || $(VENV)/bin/pagefleet init-model --preset tiny-llama --output $(DEMO_MODEL)
	@echo "make: running the demo (planning, then compiling and sampling on 2 slices: about 2 minutes on 2 cores)"
	JAX_PLATFORMS=cpu $(VENV)/bin/pagefleet run configs/demo.yaml

# Two pytest workers (pytest-xdist): much of a test's time is waiting (Ray start-up, subprocesses, compiling on one
# thread), so two share two cores well: 43 -> 31-34 minutes on a 2-core AVX2 machine (25 minutes since). Three are
# slower there (27 against 25 minutes, more CPU time in all). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python benchmarks/step_bench.py

# PLAN_ARGS overrides (the last value of a flag wins): PLAN_ARGS="--num-prompts 10000000 --repeats 1 --baseline-prompts 1000000",
# or "--num-prompts 2000000 --median-words 1500 --repeats 1 --baseline-prompts 50000" for prompts of ~2k tokens
bench-plan: $(STAMP)
	JAX_PLATFORMS=cpu RAY_AUTH_MODE=disabled $(VENV)/bin/python benchmarks/plan_bench.py --num-prompts 1000000 --num-cpus 2 --repeats 3 $(PLAN_ARGS)

bench-resume: $(STAMP)
	$(VENV)/bin/python benchmarks/resume_bench.py --batches 100000 --repeats 3

bench-export: $(STAMP)
	$(VENV)/bin/python benchmarks/export_bench.py --samples 1000000 --memory-gb 0.25 --repeats 3

bench-host: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python benchmarks/host_bench.py --repeats 5

bench-generate: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python benchmarks/generate_bench.py --repeats 3

# the yardstick: this machine's float32 matmul peak and memory bandwidth, the engine's prefill and decode rates against them
bench-peak: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python benchmarks/peak_bench.py --repeats 3

# the CPU attention kernel's decoding path alone against reading its K/V pool: how close decode attention is to memory
bench-attention: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python benchmarks/attention_bench.py

# a tiny mixture of experts (E = 8 and 32, top-2) against its dense twin: tokens/s and MLP FLOPs per step
bench-moe: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python benchmarks/moe_bench.py

# swap preemption against recompute on long generations, whole process (engine.preemption, engine.host_kv_pages)
bench-swap: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python benchmarks/swap_bench.py --repeats 3

# pagefleet against vLLM's CPU build on the same token ids (installs vLLM once into .peer/vllm-venv).
bench-peer: $(STAMP)
	$(VENV)/bin/python benchmarks/peer_bench.py --repeats 3

# chats rendered against vLLM's CPU build: the same prompt token ids for each chat, template and chat_template_kwargs
check-peer-chat: $(STAMP)
	$(VENV)/bin/python benchmarks/chat_peer.py

check-peer-sampling: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python benchmarks/sampling_peer.py

# structured outputs: generate throughput with a permissive constraint against none, and where the rest goes
bench-structured: $(STAMP)
	$(VENV)/bin/python benchmarks/structured_bench.py --repeats 3

# two revisions of pagefleet alternated on bench-peer's workloads: make bench-ab BASE=<commit> [NEW=<commit>]
BASE ?= HEAD
bench-ab: $(STAMP)
	$(VENV)/bin/python benchmarks/ab_bench.py --base $(BASE) $(if $(NEW),--new $(NEW)) --repeats 3
