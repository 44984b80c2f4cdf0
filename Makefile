# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python

.PHONY: setup demo test test-slow lint bench bench-full bench-gpu

setup:
	./scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest -q --durations=15
	./scripts/client_pythons.sh

test-slow: setup
	$(PY) -m pytest -q --run-slow

lint: setup
	$(PY) -m ruff check .

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
