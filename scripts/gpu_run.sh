#!/usr/bin/env bash
# One GPU session's worth of checks: kernel tests at real shapes, then the kernel benchmarks.
# Run on the device machine from the repo root:  bash scripts/gpu_run.sh [bench names...]
# Logs go to $OUT (or ./gpu_out); each step runs even when an earlier one fails.
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
echo "== kernel tests (CUDA, real shapes) =="
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --timeout=120 -p no:cacheprovider tests/kernels ${EXTRA_TESTS:-} 2>&1 | tee "$out/tests.log" | tail -25
echo "== benchmarks =="
timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_kernels.py ${BENCH_ARGS:-} ${1:+--only "$@"} 2>&1 | tee "$out/bench.log" | grep -v '^{' | tail -80
grep '^{' "$out/bench.log" > "$out/bench.jsonl" || true
