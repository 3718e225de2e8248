#!/usr/bin/env bash
# One GPU session's worth of checks: every test marked `gpu` in the whole suite (pytest -m gpu), then, when
# bench names or BENCH_ARGS are given, the kernel benchmarks, and with E2E=<sets> the end-to-end benches (below).
# Run on the device machine from the repo root:
#   bash scripts/gpu_run.sh [bench names...]
#   TESTS=0 E2E=refactor,decode bash scripts/gpu_run.sh   # end-to-end benches only (a line may sit in several sets)
# E2E names sets of the list below, comma-separated: decode (a process's first chat against its later ones, at 1K and
# 40K), refactor (the structure change's three end-to-end benches), serve, video (a 720p clip), live (a live window
# asked every 0.1 s), latency (conversational latency: fp16 vs W4 first turns, follow-up questions at 1, 64 and 256 frames,
# a live window's question dense in fp16 and W4; the hf pipeline needs transformers, which the device lacks unless
# its wheels travel in .whl/), kernels (the W4 GEMV / GEMM rows against cuBLAS), followup (a later turn's split
# attention against the flash call, the device-time profiles of a follow-up question and of a W4 and an fp16 first
# turn, the W4 GEMM sweep at a follow-up's rows), attn (followup's first three: the attention bench and the
# follow-up profiles).
# ORDER="B A A B" runs each chosen bench in the tree at $BEFORE (an older commit, e.g. `git archive f86bed5 | tar -x
# -C .gpu/before`, carried) and in this one, in that order; JSON lines gain "tree": "A" or "B".
# WORKERS pytest-xdist workers (default 8) compile in parallel and share Triton's on-disk cache; the suite is
# sized to finish inside one ten-minute call. Logs go to $OUT (or ./gpu_out). Exit status: the tests'.
# The device has no network: wheels the benches need beyond its torch/triton/opencv (the server's: starlette,
# uvicorn, httpx and their dependencies) travel in .whl/ (git-ignored; pass it in the call's carry):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl starlette uvicorn h11 click anyio \
#     sniffio httpx httpcore certifi idna
# and, for the latency set's hf pipeline only, transformers and everything it imports in .whl/hf/ (~32 MB: the
# closure of `transformers` in the project's venv, as cp312 manylinux / py3 wheels, same versions; installed only
# when E2E names latency, so the GPU tests run without it as before).
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
wheels=$(ls .whl/*.whl 2>/dev/null)
case ",${E2E:-}," in *,latency,*) wheels="$wheels $(ls .whl/hf/*.whl 2>/dev/null)" ;; esac
if [ -n "${wheels// /}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $wheels \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"

rc=0
if [ "${TESTS:-1}" != 0 ]; then
echo "== GPU tests: pytest -m gpu over tests/, ${WORKERS:-8} workers =="
start=$SECONDS
# The server's test modules hold no gpu test and import client tools the device lacks (openai, selenium): not collected.
timeout -k 10 "${TEST_TIMEOUT:-540}" python3 -m pytest -m gpu --ignore=tests/test_serve.py --ignore=tests/test_serve_browser.py -n "${WORKERS:-8}" --timeout=300 -p no:cacheprovider -q \
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
  while read -r set limit cmd; do
    [ -z "$cmd" ] && continue
    hit=0; for one in ${set//,/ }; do case ",$E2E," in *",$one,"*) hit=1 ;; esac; done  # a line may be in several sets
    [ $hit = 1 ] || continue
    for tree in ${ORDER:-A}; do  # A: this tree; B: the tree in $BEFORE, run the old way (PYTHONPATH=. python PATH)
      echo "-- [$tree] python3 -m $cmd"
      if [ "$tree" = B ]; then
        (cd "$BEFORE" && PYTHONPATH=.:/tmp/site timeout "$limit" python3 "$(echo "${cmd%% *}" | tr . /).py" ${cmd#* }) \
          >"$out/run.log" 2>&1 || echo "   exit $? (log kept: $out/failed.log)"
      else
        timeout "$limit" python3 -m $cmd >"$out/run.log" 2>&1 || echo "   exit $? (log kept: $out/failed.log)"
      fi
      grep -v '^{' "$out/run.log" | tail -14
      grep '^{' "$out/run.log" | sed "s/^{/{\"tree\": \"$tree\", /" >>"$out/e2e.jsonl" || cp "$out/run.log" "$out/failed.log"
    done
  done <<'CMDS'
decode 60 scripts.first_chat_decode --chats 2 --repeats 3
decode,decode40k 70 scripts.first_chat_decode --chats 2 --repeats 3 --context 40000
refactor 60 scripts.bench --decode-context 1024 --new-tokens 256 --pipelines quant --repeats 3
refactor 60 scripts.bench --images 1 --rounds 4 --new-tokens 50 --pipelines quant,sparse --repeats 3
refactor,refactor256 110 scripts.bench --frames 256 --rounds 3 --new-tokens 250 --prefill-keep 0.25 --decode-keep 0.1 --pipelines quant,sparse
serve 90 scripts.bench_serve
video 200 scripts.bench_video --clip /tmp/clip720.mp4
live 90 scripts.bench_video --mode live --ask-every 0.1 --seconds 10
latency 120 scripts.bench --images 1 --rounds 4 --new-tokens 50 --repeats 3
latency 90 scripts.bench --frames 64 --rounds 4 --new-tokens 100 --prefill-keep 0.25 --decode-keep 0.1 --pipelines quant,sparse
latency 110 scripts.bench --frames 256 --rounds 4 --new-tokens 100 --prefill-keep 0.25 --decode-keep 0.1 --pipelines quant,sparse
latency 90 scripts.bench_video --mode live --pipelines fp16,quant --seconds 10
kernels 150 scripts.bench_kernels --only w4a16
followup,attn 70 scripts.bench_kernels --only rows_attention
followup,attn 60 scripts.bench_kernels --only prefill_graph --prefill-graph-t 46 --prefill-graph-start 600 --prefill-graph-profile 8
followup,attn 90 scripts.bench_kernels --only prefill_graph --prefill-graph-t 46 --prefill-graph-start 51000 --prefill-graph-profile 4
followup 60 scripts.bench_kernels --only prefill_graph --prefill-graph-t 588 --prefill-graph-profile 8
followup 60 scripts.bench_kernels --only prefill_graph --prefill-graph-t 588 --prefill-graph-quant none --prefill-graph-profile 6
followup 120 scripts.bench_kernels --only w4a16 --w4-gemm-sweep 16,48
followup 200 scripts.bench_kernels --only w4a16 --w4-wgmma-sweep 16,32,48
followup 90 scripts.bench_kernels --only prefill_graph --prefill-graph-t 46 --prefill-graph-start 600 --prefill-graph-profile 3 --prefill-graph-options w4_gemm_wgmma=0;w4_gemm_wgmma=1;w4_gemm_wgmma=0
CMDS
  rm -f "$out/run.log"
fi
exit $rc
