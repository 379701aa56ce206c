VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 30000
ARGS ?=

.PHONY: install serve test test-fast lint bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# Structured output; --no-deps: what it requires (torch, triton) is installed above.
	$(PY) -m pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	touch $@

install: $(VENV)/.installed

serve: install
	$(PY) -m launch_server --host $(HOST) --port $(PORT) $(ARGS)

lint: install
	$(VENV)/bin/ruff check srt launch test benchmark pipeline

test: lint
	$(PY) -m pytest -q -x test

# The unit tier: everything that starts no server, engine or rank processes (about a minute).
test-fast: lint
	$(PY) -m pytest -q -x -m "not slow" test

bench: install
	$(PY) benchmark/offline/bench_one_batch.py $(ARGS)

# The GPU check (docs/gpu.md): on a machine with a CUDA GPU, with that machine's own python3
# (not the CPU virtual environment); under 8 minutes on an H100.
gpu-check:
	benchmark/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
