# Quick start: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Without CUDA, pin the CPU build of torch first so the range below pulls nothing big.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q "torch==2.13.0"; fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check lmprog lmprog_runtime tests examples benchmarks
	$(VENV)/bin/ruff format --check lmprog lmprog_runtime tests examples benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format lmprog lmprog_runtime tests examples benchmarks
	$(VENV)/bin/ruff check --fix lmprog lmprog_runtime tests examples benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
