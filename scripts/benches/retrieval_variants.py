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
from csrc_triton import retrieval_salience_wgmma as rw
from tinyvila import ops

H, HKV, D, S = 32, 8, 128, 32768
SPAN = range(1024, 1024 + 30000)
DEV = "cuda"
CALLS, REPLAYS = 16, 40
BUDGET_S = 150  # stop adding rows past this (compiles dominate)

# (label, idx kind, kwargs for retrieval_salience); idx kind "t": the case's slots as an int32 tensor (gathered),
# "r": the same slots as a range (read as one block; what the runtime passes when the retrievable slots are one
# run, kv_cache's kernel_idx). "form" picks the Gluon kernel's form (retrieval_salience_wgmma.FORM). The first
# variant of each case is the reference its rows are checked against.
VARIANTS_64 = [
    ("gather (default for slots)", "t", {}),
    ("wgmma pingpong (default for a range)", "r", {}),
    ("wgmma pingpong stages=3", "r", dict(impl="wgmma", num_stages=3)),
    ("wgmma pingpong stages=6", "r", dict(impl="wgmma", num_stages=6)),
    ("wgmma halves", "r", dict(impl="wgmma", form="halves")),
    ("wgmma halves stages=2", "r", dict(impl="wgmma", form="halves", num_stages=2)),
    ("gather, range", "r", dict(impl="gather")),
    ("gather tiles=7 (S5's launch: 2.2 waves)", "t", dict(tiles=7, impl="gather")),
    ("gather tiles=8 (2 waves)", "t", dict(tiles=8)),
    ("pipe", "t", dict(impl="pipe")),
    ("pipe, range", "r", dict(impl="pipe")),
    ("pipe stages=4", "t", dict(impl="pipe", num_stages=4)),
]
VARIANTS_SPAN = [
    ("gather, slot tensor", "t", {}),
    ("wgmma pingpong, range (default)", "r", {}),
    ("wgmma halves, range", "r", dict(impl="wgmma", form="halves")),
    ("gather, range", "r", dict(impl="gather")),
    ("pipe, range", "r", dict(impl="pipe")),
]
VARIANTS_ACC = [  # T=64, adding into `out` as kv_cache._score does
    ("gather +out", "t", {}),
    ("wgmma pingpong +out, range (default)", "r", {}),
    ("wgmma halves +out, range", "r", dict(impl="wgmma", form="halves")),
    ("gather +out, range", "r", dict(impl="gather")),
]
VARIANTS_16 = [
    ("gather", "t", {}),
    ("wgmma pingpong, range (default)", "r", {}),
    ("wgmma halves, range", "r", dict(impl="wgmma", form="halves")),
    ("gather per_sm=4 (whole waves)", "t", dict(per_sm=4)),
    ("pipe", "t", dict(impl="pipe")),
]
VARIANTS_256 = [
    ("pipe (default for slots: 4 launches)", "t", {}),
    ("wgmma pingpong, range (default: 4 launches)", "r", {}),
    ("wgmma halves, range", "r", dict(impl="wgmma", form="halves")),
    ("gather tiles=16", "t", dict(tiles=16)),
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


def _with_form(form, fn):
    """fn with the Gluon kernel's FORM set to `form` while it runs (None: as it is)."""
    def call():
        saved = rw.FORM
        rw.FORM = form or saved
        try:
            return fn()
        finally:
            rw.FORM = saved
    return call


def sweep(case, variants, q, k, lse, prefill_us, t0, rows, slots=range(S), accumulate=False):
    """Time each variant; rows get us, diff against the case's first row and the prefill share."""
    ref = None
    slot_t = torch.arange(slots.start, slots.stop, device=DEV, dtype=torch.int32)
    for label, kind, kw in variants:
        if time.time() - t0 > BUDGET_S:
            print(f"[budget] {case} / {label}: skipped ({BUDGET_S} s budget spent)", flush=True)
            continue
        kw = dict(kw)
        form = kw.pop("form", None)
        idx = slot_t if kind == "t" else slots
        out = torch.zeros(1, HKV, len(idx), device=DEV) if accumulate else None
        try:
            call = _with_form(form, functools.partial(rs.retrieval_salience, q, k, idx, lse, out=out, **kw))
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
    sweep("T=64 span 30K", VARIANTS_SPAN, q, k, lse, prefill_us, t0, rows, slots=SPAN)
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
