# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python

.PHONY: setup demo test test-slow lint bench bench-full bench-gpu bench-scale

setup:
	./scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py

# Two pytest-xdist workers, whole files each (a file's engines are shared by its tests),
# the longest files first (tests/conftest.py); TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
	./scripts/client_pythons.sh

test-slow: setup
	$(PY) -m pytest -q --run-slow

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup
	$(PY) -m bench --quick

bench-full: setup
	$(PY) -m bench --full

# On a GPU machine (issue 16 item 5): its own venv with CUDA vLLM, a random-weight Llama 3.2 1B
# made locally, then every frontend side by side on it (CUDA graphs on) and at the
# zero-compute ceiling. Results land in bench/results/gpu_llama1b*. A GPU machine with no
# package index: scripts/gpu_offline_bundle.sh and scripts/gpu_offline_run.sh (README).
GPU_VENV ?= .venv-gpu
GPU_MODEL ?= $(HOME)/.cache/engine-gateway/llama-3.2-1b-random
GPU_BENCH = $(GPU_VENV)/bin/python -m bench --model $(GPU_MODEL) --cuda-graphs --no-ceiling \
	--targets gateway-ipc,gateway-tcp,vllm-http,direct --rounds 3

bench-gpu:
	VENV=$(GPU_VENV) ./scripts/setup.sh --gpu
	test -f $(GPU_MODEL)/config.json || \
		$(GPU_VENV)/bin/python -m bench.random_model llama-3.2-1b $(GPU_MODEL)
	$(GPU_BENCH) --name gpu_llama1b --concurrency 1,64,256,1024 --prompt-len 128 --output-len 256
	$(GPU_BENCH) --name gpu_llama1b_ceiling --executor zero --concurrency 256,1024,2048 \
		--prompt-len 32 --output-len 512

# Issue 38 item 3, on a host with 16+ cores (a GPU host's CPUs will do): 4 and 8
# zero-compute engines (one core each) behind one gateway and behind two, against vLLM's
# HTTP server with 1, 2 and 4 API servers, at c=1024-4096. The report's scale-out table
# gives each target's tok/s against N x one engine's (direct) and its frontend cores.
SCALE = $(PY) -m bench --executor zero --no-ceiling --prompt-len 32 --output-len 512 \
	--concurrency 1024,2048,4096 --rounds 2 --max-num-seqs 1024

bench-scale: setup
	$(SCALE) --name scale_dp4 --targets \
		direct,gateway-dp4,gateway-dp4-x2,vllm-http-dp4,vllm-http-dp4-x2,vllm-http-dp4-x4
	$(SCALE) --name scale_dp8 --targets \
		direct,gateway-dp8,gateway-dp8-x2,vllm-http-dp8,vllm-http-dp8-x2,vllm-http-dp8-x4
