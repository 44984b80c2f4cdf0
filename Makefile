# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python

.PHONY: setup demo test test-slow lint bench bench-full

setup:
	./scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q --run-slow

lint: setup
	$(PY) -m ruff check .

bench: setup
	$(PY) -m bench --quick

bench-full: setup
	$(PY) -m bench --full
