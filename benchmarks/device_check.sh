#!/usr/bin/env bash
# Device check of the Triton kernels: one call of at most 5 minutes on one CUDA GPU.
#
#   bash benchmarks/device_check.sh [triton_decode.py options]
#
# Runs from the source tree (PYTHONPATH=., no datasets, no network): decode-attention timings on
# Llama-3.1-8B shapes, each timed kernel first checked against the reference attention of its
# cache, then quantize-and-pack of a flushed page (benchmarks/triton_decode.py; timing protocol of
# kvbench/measure/timer.py).  Correctness at random sizes is tests/kernels' job.  Methods come
# from kvbench's method registry (entry points), so kvbench is installed editable without
# dependencies or network first when it is not importable with its entry points and
# kvbench.kernels (kernels/, mapped by the install).  Results go under $OUT
# (default $TMPDIR/kvbench_device_check): rows.jsonl (appended row by row), RESULTS.md
# (rewritten after every row, so a timeout still leaves a partial table; commit it as
# docs/results/triton-decode.md), env.json, system.txt, bench.log.  Knobs: TIME_BUDGET (seconds after
# which no new shape starts, default 200), BENCH_TIMEOUT (hard limit, default 280), PYTHON
# (default python3).  A second call can tune: --skip-correctness --tune 32768,8
# --contexts 32768 --batches 8.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${TMPDIR:-/tmp}/kvbench_device_check}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
if ! "$PYTHON" -c "import kvbench.kernels.dispatch; kvbench.get_method('kivi')" >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . \
    || echo "warning: editable install failed; method lookups will fail" >&2
fi
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
  "$PYTHON" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/system.txt" 2>&1
cat "$OUT/system.txt"
timeout -k 10 "${BENCH_TIMEOUT:-280}" "$PYTHON" benchmarks/triton_decode.py --out "$OUT" \
  --time-budget "${TIME_BUDGET:-200}" "$@" > "$OUT/bench.log" 2>&1
rc=$?
tail -n 150 "$OUT/bench.log"
echo "triton_decode exit status: $rc (0 ok, 1 failed checks, 124 timed out: partial results in $OUT)"
exit "$rc"
