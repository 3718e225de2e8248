"""Retrieval-salience variants on the GPU (issue 6): the default kernel against each variant, graph-replayed.

    PYTHONPATH=. python3 scripts/benches/retrieval_variants.py     (one H200, < 2 minutes incl. compiles)

Llama-3-8B shapes (32 query heads, 8 KV heads, D=128, fp16), a T-token question after a 32K-slot cache.
Each row: median us per call over REPLAYS replays of one CUDA graph of CALLS back-to-back calls (K is
67 MB, past L2, so inputs are not rotated), the max abs difference from the default kernel's output
(and relative to its largest value), and the share of the question's prefill attention (PyTorch flash
+ LSE over the same cache, graph-timed the same way; issue 6's target: <= 0.25). Cases: T=64 with idx =
every slot (a slot tensor) and idx = one 30K span (the slot tensor vs a range), T=16 and T=256; "+out"
rows add into a given `out` as the runtime does (kv_cache._score). Prints a table, then one JSON line.
"""
import functools
import json
import subprocess
import sys
import time

import torch
import triton

from csrc_triton import retrieval_salience as rs
from tinyvila import ops

H, HKV, D, S = 32, 8, 128, 32768
SPAN = range(1024, 1024 + 30000)
DEV = "cuda"
CALLS, REPLAYS = 16, 40
BUDGET_S = 105  # stop adding rows past this (compiles dominate; the lead's run must stay < 2 minutes)

# (label, kwargs for retrieval_salience); the first of each case is the reference its rows are checked against
VARIANTS_64 = [
    ("default", {}),
    ("gather tiles=7 (S5's launch: 2.2 waves)", dict(tiles=7, impl="gather")),
    ("gather tiles=16 (1 wave)", dict(tiles=16, impl="gather")),
    ("gather tiles=8 (2 waves)", dict(tiles=8)),
    ("pipe", dict(impl="pipe")),
    ("pipe stages=2", dict(impl="pipe", num_stages=2)),
    ("pipe stages=4", dict(impl="pipe", num_stages=4)),
    ("pipe per_sm=1", dict(impl="pipe", per_sm=1)),
    ("pipe tiles=8 (2 waves)", dict(impl="pipe", tiles=8)),
    ("pipe tiles=4 (4 waves)", dict(impl="pipe", tiles=4)),
    ("pipe n128 w8", dict(impl="pipe", block_n=128, num_warps=8)),
    ("pipe half=64 (2 launches)", dict(impl="pipe", block_m=64)),
]
VARIANTS_SPAN = [  # idx: "t" = the span's slots as a tensor (as the runtime passes them today), "r" = range
    ("default, slot tensor", "t", {}),
    ("gather, range", "r", {}),
    ("gather tiles=16, range", "r", dict(tiles=16)),
    ("pipe, slot tensor", "t", dict(impl="pipe")),
    ("pipe, range", "r", dict(impl="pipe")),
    ("pipe stages=2, range", "r", dict(impl="pipe", num_stages=2)),
    ("pipe stages=4, range", "r", dict(impl="pipe", num_stages=4)),
]
VARIANTS_ACC = [  # T=64, idx = every slot, adding into `out`
    ("default +out", {}),
    ("gather tiles=16 +out", dict(tiles=16)),
    ("pipe +out", dict(impl="pipe")),
]
VARIANTS_16 = [
    ("default", {}),
    ("gather per_sm=4 (whole waves)", dict(per_sm=4)),
    ("pipe", dict(impl="pipe")),
    ("pipe per_sm=4", dict(impl="pipe", per_sm=4)),
]
VARIANTS_256 = [
    ("default", {}),
    ("gather tiles=16", dict(tiles=16)),
    ("pipe (4 launches)", dict(impl="pipe")),
]


def graph_us(fn) -> float:
    """Median us per call: CALLS calls captured in one graph, REPLAYS replays each timed with events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    del graph
    return sorted(times)[len(times) // 2]


def question(T: int, seed: int = 0):
    """q (1, H, T, D), k and v (1, HKV, S+T, D) fp16 and the question's LSE from the real prefill attention."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, H, T, D, device=DEV, dtype=torch.float16, generator=g)
    k = torch.randn(1, HKV, S + T, D, device=DEV, dtype=torch.float16, generator=g)
    v = torch.randn(1, HKV, S + T, D, device=DEV, dtype=torch.float16, generator=g)
    return q, k, v, ops.attention_lse(q, k, v, S)[1]


def sweep(case, variants, q, k, lse, prefill_us, t0, rows, idx_of=None, accumulate=False):
    """Time each variant; rows get us, diff against the case's first row and the prefill share."""
    ref = None
    for label, *rest in variants:
        if time.time() - t0 > BUDGET_S:
            print(f"[budget] {case} / {label}: skipped ({BUDGET_S} s budget spent)", flush=True)
            continue
        kind, kw = rest if len(rest) == 2 else ("t", rest[0])
        idx = idx_of(kind) if idx_of else torch.arange(S, device=DEV, dtype=torch.int32)
        out = torch.zeros(1, HKV, len(idx), device=DEV) if accumulate else None
        try:
            call = functools.partial(rs.retrieval_salience, q, k, idx, lse, out=out, **kw)
            if accumulate:
                out.zero_()
            got = call().clone()
            us = graph_us(call)
        except Exception as e:  # a config that does not compile or fit is a row, not a crash
            print(f"{case} / {label}: failed: {type(e).__name__}: {e}", flush=True)
            continue
        if ref is None:
            ref = got
        diff = (got - ref).abs().max().item()
        row = dict(case=case, variant=label, us=round(us, 2), max_abs_diff=diff,
                   rel_diff=diff / max(ref.abs().max().item(), 1e-30),
                   share_of_prefill=round(us / prefill_us, 3) if prefill_us else None)
        rows.append(row)
        print(f"{case:<22} {label:<34} {us:8.2f} us  diff {diff:9.2e} (rel {row['rel_diff']:8.1e})  "
              f"share {row['share_of_prefill']}", flush=True)


def measure(t0: float) -> list[dict]:
    """Every row of the module docstring, printed as measured."""
    rows = []
    q, k, v, lse = question(64)
    prefill_us = graph_us(functools.partial(ops.attention_lse, q, k, v, S))
    print(f"question prefill attention (flash + LSE), T=64 over {S}: {prefill_us:.2f} us (graph)", flush=True)
    sweep("T=64 all slots", VARIANTS_64, q, k, lse, prefill_us, t0, rows)
    span_t = torch.arange(SPAN.start, SPAN.stop, device=DEV, dtype=torch.int32)
    sweep("T=64 span 30K", VARIANTS_SPAN, q, k, lse, prefill_us, t0, rows,
          idx_of=lambda kind: span_t if kind == "t" else SPAN)
    sweep("T=64 all slots +out", VARIANTS_ACC, q, k, lse, prefill_us, t0, rows, accumulate=True)
    for T, variants in ((16, VARIANTS_16), (256, VARIANTS_256)):
        q = k = v = lse = None  # free the previous question's 134 MB first
        q, k, v, lse = question(T, seed=T)
        pre = graph_us(functools.partial(ops.attention_lse, q, k, v, S))
        print(f"question prefill attention, T={T}: {pre:.2f} us (graph)", flush=True)
        sweep(f"T={T} all slots", variants, q, k, lse, pre, t0, rows)
    print(f"resident programs per SM of the compiled pipe configurations: {sorted(rs._RESIDENT.values())}")
    return rows


def run(args) -> list[dict]:
    """scripts/bench_kernels.py's entry (`--only retrieval_variants`; --quick changes nothing)."""
    return measure(time.time())


def main():
    t0 = time.time()
    rows = measure(t0)
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    print(json.dumps(dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else DEV, torch=torch.__version__,
                          triton=triton.__version__, commit=git("rev-parse", "--short", "HEAD"),
                          dirty=bool(git("status", "--porcelain", "csrc_triton")), wall_s=round(time.time() - t0, 1),
                          rows=rows)))


if __name__ == "__main__":
    sys.exit(main())
