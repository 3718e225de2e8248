"""SparseVILA decode kernels at Llama-3-8B attention shapes (32 query heads, 8 KV heads, D=128, fp16).

    PYTHONPATH=. python scripts/bench_kernels.py --only decode_attention [--quick]

Rows: decoding attention over a packed buffer of L rows (GB/s against the measured copy bandwidth);
keep 0.25 / 0.1 of a 32K and 128K cache against SDPA (enable_gqa) over the full cache, next to the
ideal bytes ratio 1/keep; the retrieval-salience kernel (64-token question, 32K cache) against naive
recomputation of the attention matrix, flash-colreduce (causal, GQA keys expanded) if installed, and
the question's prefill attention; retrieval + packing of 32 layers against a 50-token turn's decode.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from benches import common
from tinyvila import ops

H, HKV, D, LAYERS = 32, 8, 128, 32
DT = torch.float16
# W4A16 Llama-3-8B decode step at 8K context at 4.3 TB/s (reference/perf.md sec. 2.1): what a
# 50-token turn costs at best; retrieval + packing are compared against 50 of these.
STEP_MS_8K_FLOOR = 1.356


def _kv(S, n):
    return [(torch.randn(1, HKV, S, D, device="cuda", dtype=DT), torch.randn(1, HKV, S, D, device="cuda", dtype=DT))
            for _ in range(n)]


def graph_ms(fn, inputs: list, calls: int = 16) -> float | None:
    """Per-call median ms of fn replayed from one CUDA graph of >= `calls` calls cycling through
    `inputs` (the decode loop replays a captured step, so this is its device time without Python
    launch overhead); None when the call cannot be captured."""
    n = max(calls, len(inputs))
    try:
        for args in inputs:  # compile and allocate outside the capture
            fn(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                fn(*inputs[i % len(inputs)])
    except RuntimeError as e:
        print(f"graph capture failed: {e}")
        return None
    ms = common.bench(graph.replay, [()], warmup=3, iters=20) / n
    del graph
    return ms


def decode_rows(lengths) -> list[dict]:
    rows, bw = [], common.copy_bandwidth_gbs()
    q = torch.randn(1, H, D, device="cuda", dtype=DT)
    for L in lengths:
        kv = _kv(L, common.n_copies(4 * HKV * L * D))
        lens = torch.tensor([L], dtype=torch.int32, device="cuda")
        fn = lambda k, v, lens=lens: ops.decode_attention(q, k, v, lens)  # noqa: E731
        eager = common.bench(fn, kv)
        graph = graph_ms(fn, kv) or eager
        gbs = 4 * HKV * L * D / graph / 1e6  # K and V, 2 bytes each
        rows.append({"case": "decode packed (graph)", "L": L, "keep": 1.0, "us": 1000 * graph,
                     "eager_us": 1000 * eager, "GB/s": gbs, "of_copy_bw": gbs / bw, "target": ">=0.75 for L>=8K"})
        del kv
    return rows


def sparse_vs_sdpa(caches, keeps) -> list[dict]:
    """Both sides timed the same two ways: replayed from a CUDA graph (us, sdpa_us) and eager."""
    rows = []
    q = torch.randn(1, H, D, device="cuda", dtype=DT)
    for S in caches:
        kv = _kv(S, common.n_copies(4 * HKV * S * D))
        sdpa_fn = lambda k, v: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)  # noqa: E731
        sdpa_eager, sdpa = common.bench(sdpa_fn, kv), graph_ms(sdpa_fn, kv)
        for keep in keeps:
            L = round(keep * S)
            lens = torch.tensor([L], dtype=torch.int32, device="cuda")
            fn = lambda k, v, lens=lens: ops.decode_attention(q, k, v, lens)  # noqa: E731
            eager = common.bench(fn, kv)
            ms = graph_ms(fn, kv) or eager
            speedup = sdpa / ms if sdpa and ms else None
            rows.append({"case": "keep vs SDPA full (graph)", "L": S, "keep": keep, "us": 1000 * ms,
                         "sdpa_us": 1000 * sdpa if sdpa else None, "speedup": speedup,
                         "of_ideal": speedup * keep if speedup else None,
                         "eager_us": 1000 * eager, "sdpa_eager_us": 1000 * sdpa_eager,
                         "eager_of_ideal": sdpa_eager / eager * keep, "target": ">=0.8 of ideal"})
        del kv
    return rows


SWEEP = [  # (block_n, num_warps, num_stages, ctas_per_sm)
    (64, 4, 3, 4), (64, 4, 2, 4), (64, 4, 4, 4), (32, 4, 4, 4), (128, 4, 2, 4), (128, 8, 3, 2),
    (64, 4, 3, 2), (64, 4, 3, 8), (32, 2, 4, 8), (64, 8, 3, 4),
]


def sweep_rows(lengths=(8192, 32768, 131072)) -> list[dict]:
    """Tile configurations of the decode kernel, graph-timed (set DECODE_SWEEP=1 to run)."""
    from csrc_triton.decode_attention import decode_attention, default_splits

    rows, bw = [], common.copy_bandwidth_gbs()
    q = torch.randn(1, H, D, device="cuda", dtype=DT)
    for L in lengths:
        kv = _kv(L, common.n_copies(4 * HKV * L * D))
        lens = torch.tensor([L], dtype=torch.int32, device="cuda")
        for bn, warps, stages, per_sm in SWEEP:
            splits = default_splits(L, HKV, q.device, per_sm)
            fn = functools.partial(decode_attention, q, lengths=lens, n_splits=splits, block_n=bn,
                                   num_warps=warps, num_stages=stages)
            try:
                ms = graph_ms(fn, kv)
            except Exception as e:  # a config that does not compile (shared memory) is a row, not a crash
                print(f"config {bn, warps, stages, per_sm} failed: {type(e).__name__}: {e}")
                ms = None
            gbs = 4 * HKV * L * D / ms / 1e6 if ms else None
            rows.append({"case": "sweep (graph)", "L": L, "config": f"n{bn}w{warps}s{stages}c{per_sm}",
                         "splits": splits, "us": 1000 * ms if ms else None, "GB/s": gbs,
                         "of_copy_bw": gbs / bw if gbs else None})
            print(rows[-1], flush=True)  # a sweep cut short by a time limit still reports
        del kv
    return rows


RETRIEVAL_SWEEP = [  # (block_m, block_n, num_warps, num_stages)
    (64, 64, 4, 2), (64, 128, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (128, 128, 8, 2),
    (32, 256, 8, 2), (64, 256, 8, 2), (128, 128, 8, 3), (32, 128, 4, 3), (256, 64, 8, 2),
]


def retrieval_sweep_rows(S=32768, T=64) -> list[dict]:
    """Tile configurations of the retrieval-salience kernel (64-token question, 32K cache)."""
    from csrc_triton.retrieval_salience import retrieval_salience

    sets = []
    for _ in range(common.n_copies(2 * HKV * (S + T) * D)):
        k = torch.randn(1, HKV, S + T, D, device="cuda", dtype=DT)
        q = torch.randn(1, H, T, D, device="cuda", dtype=DT)
        sets.append((q, k, ops.attention_lse(q, k, torch.randn_like(k), S)[1]))
    idx = torch.arange(S, device="cuda", dtype=torch.int32)
    prefill = common.bench(lambda q, k, lse: ops.attention_lse(q, k, k, S), sets)
    rows = []
    for bm, bn, warps, stages in RETRIEVAL_SWEEP:
        fn = functools.partial(retrieval_salience, idx=idx, block_m=bm, block_n=bn, num_warps=warps,
                               num_stages=stages)
        try:
            eager = common.bench(lambda q, k, lse, fn=fn: fn(q, k, lse=lse), sets)
            graph = graph_ms(lambda q, k, lse, fn=fn: fn(q, k, lse=lse), sets)
        except Exception as e:  # a config that does not compile is a row, not a crash
            print(f"config {bm, bn, warps, stages} failed: {type(e).__name__}: {e}")
            eager = graph = None
        rows.append({"case": "retrieval sweep", "L": S, "config": f"m{bm}n{bn}w{warps}s{stages}",
                     "us": 1000 * eager if eager else None, "graph_us": 1000 * graph if graph else None,
                     "prefill_us": 1000 * prefill, "share": eager / prefill if eager else None})
        print(rows[-1], flush=True)
    return rows


def _naive_salience(q, k, idx, scale):
    """Materialise softmax(q kᵀ) (1, H, T, S) over the whole prefix, then reduce it."""
    p = torch.softmax((q @ k.repeat_interleave(H // HKV, dim=1).transpose(-1, -2)).float() * scale, dim=-1)
    return p[..., idx.long()].sum(2).view(1, HKV, H // HKV, -1).sum(2)  # (1, Hkv, N)


def retrieval_rows(S=32768, T=64) -> list[dict]:
    scale = 1 / math.sqrt(D)
    n = common.n_copies(2 * HKV * (S + T) * D)
    sets = []
    for _ in range(n):
        k = torch.randn(1, HKV, S + T, D, device="cuda", dtype=DT)
        v = torch.randn_like(k)
        q = torch.randn(1, H, T, D, device="cuda", dtype=DT)
        sets.append((q, k, v))
    idx = torch.arange(S, device="cuda", dtype=torch.int32)
    lses = [ops.attention_lse(q, k, v, S)[1] for q, k, v in sets]
    inputs = [(q, k, lse) for (q, k, _), lse in zip(sets, lses)]
    kern = common.bench(lambda q, k, lse: ops.retrieval_salience(q, k, idx, lse), inputs)
    naive = common.bench(lambda q, k, lse: _naive_salience(q, k[:, :, :S], idx, scale), inputs, iters=20)
    prefill = common.bench(lambda q, k, v: ops.attention_lse(q, k, v, S), sets)
    rows = [{"case": "retrieval kernel", "L": S, "T": T, "us": 1000 * kern},
            {"case": "retrieval naive", "L": S, "T": T, "us": 1000 * naive, "kernel_speedup": naive / kern,
             "target": ">=5x"},
            {"case": "question prefill attn (flash+LSE)", "L": S, "T": T, "us": 1000 * prefill,
             "retrieval_share": kern / prefill, "target": "retrieval <=0.25"}]
    try:
        from flash_colreduce import flash_colreduce
    except ImportError:
        rows.append({"case": "flash-colreduce", "note": "not installed (pip install .whl/flash_colreduce-*.whl)"})
        return rows
    ex = [(q, k.repeat_interleave(H // HKV, dim=1)) for q, k, _ in sets[:2]]  # GQA keys expanded
    fc = common.bench(lambda q, kx: flash_colreduce(q, kx, reduction="sum", is_causal=True), ex)
    rows.append({"case": "flash-colreduce causal", "L": S, "T": T, "us": 1000 * fc, "kernel_speedup": fc / kern})
    return rows


def overhead_rows(S=8192, T=64, keep=0.1) -> list[dict]:
    """Per turn: retrieval salience + top-k + packing of K and V, for all 32 layers."""
    k = [torch.randn(1, HKV, S + T + 64, D, device="cuda", dtype=DT) for _ in range(LAYERS)]
    v = [torch.randn_like(x) for x in k]
    q = torch.randn(1, H, T, D, device="cuda", dtype=DT)
    lse = ops.attention_lse(q, k[0][:, :, :S + T], v[0][:, :, :S + T], S)[1]
    idx = torch.arange(S, device="cuda", dtype=torch.int32)
    n_keep = round(keep * S)
    dst = [torch.empty(1, HKV, n_keep + T + 64, D, device="cuda", dtype=DT) for _ in range(2)]
    tail = torch.arange(S, S + T, device="cuda", dtype=torch.int32).expand(1, HKV, -1)

    def turn():
        for layer in range(LAYERS):
            s = ops.retrieval_salience(q, k[layer], idx, lse)
            sel = s.topk(n_keep, dim=-1).indices.to(torch.int32)
            rows_idx = torch.cat([sel, tail], dim=-1).sort(dim=-1).values
            ops.kv_pack(k[layer], rows_idx, dst[0])
            ops.kv_pack(v[layer], rows_idx, dst[1])

    ms = common.bench(turn, [()], warmup=3, iters=20)
    turn_ms = 50 * STEP_MS_8K_FLOOR
    return [{"case": "retrieval+pack 32 layers", "L": S, "keep": keep, "us": 1000 * ms,
             "of_50tok_turn_floor": ms / turn_ms, "target": "<=0.05"}]


def run(args) -> list[dict]:
    quick = getattr(args, "quick", False)
    if os.environ.get("DECODE_SWEEP") == "1":  # tile sweeps first, then the quick rows
        return sweep_rows() + retrieval_sweep_rows() + run_rows(quick=True)
    return run_rows(quick)


def run_rows(quick: bool) -> list[dict]:
    rows = decode_rows([1024, 8192, 32768] if quick else [1024, 8192, 32768, 131072])
    rows += sparse_vs_sdpa([32768] if quick else [32768, 131072], [0.25, 0.1])
    rows += retrieval_rows()
    rows += overhead_rows()
    return rows
