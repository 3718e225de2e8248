#!/usr/bin/env bash
# One GPU session's worth of checks: every test marked `gpu` in the whole suite (pytest -m gpu), then, when
# bench names or BENCH_ARGS are given, the kernel benchmarks. Run on the device machine from the repo root:
#   bash scripts/gpu_run.sh [bench names...]
# WORKERS pytest-xdist workers (default 8) compile in parallel and share Triton's on-disk cache; the suite is
# sized to finish inside one ten-minute call. Logs go to $OUT (or ./gpu_out). Exit status: the tests'.
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"

echo "== GPU tests: pytest -m gpu over tests/, ${WORKERS:-8} workers =="
start=$SECONDS
timeout -k 10 "${TEST_TIMEOUT:-540}" python3 -m pytest -m gpu -n "${WORKERS:-8}" --timeout=300 -p no:cacheprovider -q \
  --continue-on-collection-errors --durations=20 --junitxml="$out/tests.xml" tests ${EXTRA_TESTS:-} \
  >"$out/tests.log" 2>&1
rc=$?
tail -45 "$out/tests.log"
[ $rc -eq 124 ] && echo "GPU tests: stopped at TEST_TIMEOUT=${TEST_TIMEOUT:-540} s; the log so far is $out/tests.log"
echo "GPU tests: exit $rc, $((SECONDS - start)) s wall (log: $out/tests.log)"

if [ $# -gt 0 ] || [ -n "${BENCH_ARGS:-}" ]; then
  echo "== benchmarks =="
  timeout "${BENCH_TIMEOUT:-300}" python3 scripts/bench_kernels.py ${BENCH_ARGS:-} ${1:+--only "$@"} 2>&1 \
    | tee "$out/bench.log" | grep -v '^{' | tail -80
  grep '^{' "$out/bench.log" >"$out/bench.jsonl" || true
fi
exit $rc
