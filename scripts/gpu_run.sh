#!/usr/bin/env bash
# One GPU session's worth of checks: every test marked `gpu` in the whole suite (pytest -m gpu), then, when
# bench names or BENCH_ARGS are given, the kernel benchmarks, and with E2E=1 the end-to-end benches (below).
# Run on the device machine from the repo root:
#   bash scripts/gpu_run.sh [bench names...]
#   TESTS=0 E2E=1 bash scripts/gpu_run.sh          # the end-to-end benches only (~8 min): a call of their own
# WORKERS pytest-xdist workers (default 8) compile in parallel and share Triton's on-disk cache; the suite is
# sized to finish inside one ten-minute call. Logs go to $OUT (or ./gpu_out). Exit status: the tests'.
# The device has no network: wheels the benches need beyond its torch/triton/opencv (the server's: starlette,
# uvicorn, httpx and their dependencies) travel in .whl/ (git-ignored; pass it in the call's carry):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl starlette uvicorn h11 click anyio \
#     sniffio httpx httpcore certifi idna
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"

rc=0
if [ "${TESTS:-1}" != 0 ]; then
echo "== GPU tests: pytest -m gpu over tests/, ${WORKERS:-8} workers =="
start=$SECONDS
timeout -k 10 "${TEST_TIMEOUT:-540}" python3 -m pytest -m gpu -n "${WORKERS:-8}" --timeout=300 -p no:cacheprovider -q \
  --continue-on-collection-errors --durations=20 --junitxml="$out/tests.xml" tests ${EXTRA_TESTS:-} \
  >"$out/tests.log" 2>&1
rc=$?
tail -45 "$out/tests.log"
[ $rc -eq 124 ] && echo "GPU tests: stopped at TEST_TIMEOUT=${TEST_TIMEOUT:-540} s; the log so far is $out/tests.log"
echo "GPU tests: exit $rc, $((SECONDS - start)) s wall (log: $out/tests.log)"
fi

if [ $# -gt 0 ] || [ -n "${BENCH_ARGS:-}" ]; then
  echo "== benchmarks =="
  timeout "${BENCH_TIMEOUT:-300}" python3 scripts/bench_kernels.py ${BENCH_ARGS:-} ${1:+--only "$@"} 2>&1 \
    | tee "$out/bench.log" | grep -v '^{' | tail -80
  grep '^{' "$out/bench.log" >"$out/bench.jsonl" || true
fi
if [ -n "${E2E:-}" ]; then
  echo "== end-to-end benches (JSON lines: $out/e2e.jsonl) =="
  while read -r limit cmd; do
    [ -z "$cmd" ] && continue
    echo "-- python3 -m $cmd"
    timeout "$limit" python3 -m $cmd >"$out/run.log" 2>&1 || echo "   exit $? (log kept: $out/failed.log)"
    grep -v '^{' "$out/run.log" | tail -14
    grep '^{' "$out/run.log" >>"$out/e2e.jsonl" || cp "$out/run.log" "$out/failed.log"
  done <<'CMDS'
60 scripts.first_chat_decode --chats 2 --repeats 3
70 scripts.first_chat_decode --chats 2 --repeats 3 --context 40000
60 scripts.bench --decode-context 1024 --new-tokens 256 --pipelines quant --repeats 3
60 scripts.bench --images 1 --rounds 4 --new-tokens 50 --pipelines quant,sparse --repeats 3
110 scripts.bench --frames 256 --rounds 3 --new-tokens 250 --prefill-keep 0.25 --decode-keep 0.1 --pipelines quant,sparse
90 scripts.bench_serve
200 scripts.bench_video --clip /tmp/clip720.mp4
90 scripts.bench_video --mode live --ask-every 0.1 --seconds 10
CMDS
  rm -f "$out/run.log"
fi
exit $rc
