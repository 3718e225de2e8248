"""SparseVILA decode kernels at Llama-3-8B attention shapes (32 query heads, 8 KV heads, D=128, fp16).

    python -m scripts.bench_kernels --only decode_attention [--quick]
    python -m scripts.bench_kernels --only decode_attention --decode-sweep decode,retrieval,pack
    python -m scripts.bench_kernels --only decode_attention --decode-sweep prefetch
    python -m scripts.bench_kernels --only decode_attention --decode-sweep decode --decode-sweep-cases 4096:3277,16384:13107

Rows: decoding attention over a packed buffer of L rows (graph-replayed, GB/s against the measured
copy bandwidth; the fused split merge and the older two-kernel merge side by side); keep 0.25 / 0.1
of a 32K and 128K cache against SDPA (enable_gqa) over the full cache, next to the ideal bytes ratio
1/keep, in the packed buffer the runtime allocates (kept rows + a 50-token turn, rounded up to a power of
two) and in a cache-long buffer; the retrieval-salience kernel (64-token question, 32K cache) against naive recomputation of
the attention matrix, flash-colreduce (causal, GQA keys expanded) if installed, and the question's
prefill attention (share, eager and graph); per question over 32 layers at 8K, keep 0.1: retrieval
(per layer, as the prefill launches it) + the layer-batched selection and pack of Retrieval.pack,
against a 50-token turn's decode. --decode-sweep runs the named tile sweeps instead (all: all four);
its prefetch sweep times the decode kernel with 0, 2 and 4 K/V tiles per split prefetched into L2 before
the PDL wait (the launch parameter CONFIG_BY_LENGTH picks by buffer length) at 1K, 1K keys in a 4K buffer (the
decode step's shape), 4K, 8K, 12K, 16K, 32K, 128K and keep 0.1 / 0.25 of a 32K cache.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from scripts.benches import common
from tinyvila import ops
from tinyvila.config import TextConfig
from tinyvila.kv_cache import KVCache
from tinyvila.retrieval import PACKED_ROOM, Retrieval, packed_slots

H, HKV, D, LAYERS = 32, 8, 128, 32
DT = torch.float16
# W4A16 Llama-3-8B decode step at 8K context at 4.3 TB/s (reference/perf.md sec. 2.1): what a
# 50-token turn costs at best; retrieval + packing are compared against 50 of these, and against
# 50 steps of graph decode at ~400 tok/s (an estimate of the real turn).
STEP_MS_8K_FLOOR = 1.356
STEP_MS_400TPS = 2.5


def _kv(S, n):
    return [(torch.randn(1, HKV, S, D, device="cuda", dtype=DT), torch.randn(1, HKV, S, D, device="cuda", dtype=DT))
            for _ in range(n)]


def decode_rows(lengths) -> list[dict]:
    from csrc_triton.decode_attention import decode_attention

    rows, bw = [], common.copy_bandwidth_gbs()
    q = torch.randn(1, H, D, device="cuda", dtype=DT)
    for L in lengths:
        kv = _kv(L, common.n_copies(4 * HKV * L * D))
        lens = torch.tensor([L], dtype=torch.int32, device="cuda")
        fn = lambda k, v, lens=lens: ops.decode_attention(q, k, v, lens)  # noqa: E731
        eager = common.bench(fn, kv)
        graph = common.graph_ms(fn, kv) or eager
        two = common.graph_ms(lambda k, v, lens=lens: decode_attention(q, k, v, lens, fused=False), kv)
        gbs = 4 * HKV * L * D / graph / 1e6  # K and V, 2 bytes each
        rows.append({"case": "decode packed (graph)", "L": L, "keep": 1.0, "us": 1000 * graph,
                     "eager_us": 1000 * eager, "two_kernel_us": 1000 * two if two else None,
                     "GB/s": gbs, "of_copy_bw": gbs / bw, "target": ">=0.75 for L>=8K"})
        del kv
    return rows


# The decode rows a packed buffer keeps past its packed ones: the runtime's default (generate.Decoder).
TURN_ROOM = PACKED_ROOM


def sparse_vs_sdpa(caches, keeps, room=TURN_ROOM) -> list[dict]:
    """Both sides timed the same two ways: replayed from a CUDA graph (us, sdpa_us) and eager. Each keep runs
    twice: in the buffer Retrieval.pack allocates for it (retrieval.packed_slots: the kept rows plus a turn's room,
    rounded up to a power of two; its length picks the kernel's tile and split count), and with the kept rows at
    the head of a buffer as long as the whole cache. Each rotates through enough input sets that the bytes it
    READS exceed L2 (two cache-sized sets are not enough: keep 0.1 of 32K reads 13 MB a call, which L2 holds)."""
    rows = []
    q = torch.randn(1, H, D, device="cuda", dtype=DT)
    for S in caches:
        kv = _kv(S, common.n_copies(4 * HKV * S * D))
        sdpa_fn = lambda k, v: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)  # noqa: E731
        sdpa_eager, sdpa = common.bench(sdpa_fn, kv), common.graph_ms(sdpa_fn, kv)
        del kv
        for keep in keeps:
            L = round(keep * S)
            lens = torch.tensor([L], dtype=torch.int32, device="cuda")
            fn = lambda k, v, lens=lens: ops.decode_attention(q, k, v, lens)  # noqa: E731
            slots = min(S, packed_slots(L, room))
            n_sets = common.n_copies(4 * HKV * L * D)
            for buffer, L_max in ((f"packed ({slots} slots)", slots), (f"cache-long ({S} slots)", S)):
                sets = _kv(L_max, n_sets)
                eager = common.bench(fn, sets)
                ms = common.graph_ms(fn, sets) or eager
                speedup = sdpa / ms if sdpa and ms else None
                rows.append({"case": "keep vs SDPA full (graph)", "L": S, "keep": keep, "buffer": buffer,
                             "us": 1000 * ms, "sdpa_us": 1000 * sdpa if sdpa else None, "speedup": speedup,
                             "of_ideal": speedup * keep if speedup else None,
                             "eager_us": 1000 * eager, "sdpa_eager_us": 1000 * sdpa_eager,
                             "eager_of_ideal": sdpa_eager / eager * keep, "target": ">=0.8 of ideal"})
                del sets
    return rows


SWEEP = [  # (block_n, num_warps, num_stages, ctas_per_sm, fused merge)
    (64, 4, 2, 4, False), (64, 4, 2, 4, True), (64, 4, 3, 2, True), (64, 4, 4, 2, True),
    (64, 4, 3, 1, True), (64, 4, 4, 1, True), (128, 4, 3, 1, True), (128, 8, 3, 1, True),
    (128, 4, 2, 2, True), (32, 4, 4, 2, True), (64, 8, 4, 1, True), (64, 4, 2, 8, True),
]


def _sweep_cases(spec: str = "") -> list[tuple[int, int]]:
    """(buffer slots, keys) of the decode sweep: --decode-sweep-cases "SLOTS:KEYS,..." (e.g. the packed buffers of
    keep 0.1 of 32K and 128K, "4096:3277,16384:13107"), else full buffers of 1K, 8K, 32K and 128K."""
    if not spec:
        return [(L, L) for L in (1024, 8192, 32768, 131072)]
    return [tuple(int(x) for x in c.split(":")) for c in spec.split(",") if c.strip()]


def sweep_rows(cases: str = "") -> list[dict]:
    """Tile configurations and split counts of the decode kernel, graph-timed, at the _sweep_cases."""
    from csrc_triton.decode_attention import decode_attention, default_config, default_splits

    rows, bw = [], common.copy_bandwidth_gbs()
    q = torch.randn(1, H, D, device="cuda", dtype=DT)
    for L, n in _sweep_cases(cases):
        kv = _kv(L, common.n_copies(4 * HKV * n * D))
        lens = torch.tensor([n], dtype=torch.int32, device="cuda")
        for pf in sorted({0, default_config(L)[4]}):
            for bn, warps, stages, per_sm, fused in SWEEP:
                splits = default_splits(L, HKV, q.device, per_sm)
                fn = functools.partial(decode_attention, q, lengths=lens, n_splits=splits, block_n=bn,
                                       num_warps=warps, num_stages=stages, fused=fused, prefetch=pf)
                name = f"n{bn}w{warps}s{stages}c{per_sm}p{pf}{'f' if fused else ''}"
                try:
                    ms = common.graph_ms(fn, kv)
                except Exception as e:  # a config that does not compile (shared memory) is a row, not a crash
                    print(f"config {name} failed: {type(e).__name__}: {e}")
                    ms = None
                gbs = 4 * HKV * n * D / ms / 1e6 if ms else None
                rows.append({"case": "sweep (graph)", "L": L, "keys": n, "config": name, "splits": splits,
                             "picked": (bn, warps, stages, per_sm, pf) == default_config(L) and fused,
                             "us": 1000 * ms if ms else None, "GB/s": gbs, "of_copy_bw": gbs / bw if gbs else None})
                print(rows[-1], flush=True)  # a sweep cut short by a time limit still reports
        del kv
    return rows


PREFETCH_SWEEP = (0, 2, 4)  # K/V tiles of each split asked into L2 before the PDL wait
# (case, buffer slots L_max, keys attended): Llama-3-8B shapes, one query token. The keep cases attend the
# packed rows in a 32K buffer; the runtime packs them into a buffer of the kept rows
# plus the turn's room, whose length picks the prefetch (the kernel is otherwise the same: same tiles, splits).
PREFETCH_CASES = [("1K", 1024, 1024), ("1K in 4K", 4096, 1024), ("4K", 4096, 4096), ("8K", 8192, 8192),
                  ("12K", 12288, 12288), ("16K", 16384, 16384), ("32K", 32768, 32768), ("128K", 131072, 131072),
                  ("keep .1 of 32K", 32768, 3277), ("keep .25 of 32K", 32768, 8192)]


def prefetch_rows() -> list[dict]:
    """The decode kernel at each L2 prefetch count, graph-replayed (16+ back-to-back calls, PDL on as in
    the decode step), per case: us, fraction of copy bandwidth, speedup over no prefetch, whether the
    count is the one CONFIG_BY_LENGTH picks for the buffer (`picked`); the keep cases also against SDPA
    over the full 32K cache (of_ideal: speedup x keep, target 0.8)."""
    from csrc_triton.decode_attention import decode_attention, default_config

    rows, bw = [], common.copy_bandwidth_gbs()
    q = torch.randn(1, H, D, device="cuda", dtype=DT)
    sdpa_us = {}
    for case, L_max, n in PREFETCH_CASES:
        # Sets rotated so that the bytes READ exceed L2 (keep 0.1 of 32K reads 13 MB of each 134 MB buffer:
        # two sets, as sparse_vs_sdpa rotates, could stay L2-resident).
        kv = _kv(L_max, common.n_copies(4 * HKV * n * D))
        if L_max == 32768 and n < L_max and L_max not in sdpa_us:
            sdpa = common.graph_ms(lambda k, v: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True), kv)
            sdpa_us[L_max] = 1000 * sdpa if sdpa else None
        lens = torch.tensor([n], dtype=torch.int32, device="cuda")
        base = None
        for pf in PREFETCH_SWEEP:
            fn = functools.partial(decode_attention, q, lengths=lens, prefetch=pf)
            try:
                ms = common.graph_ms(fn, kv)
            except Exception as e:  # a launch that fails is a row, not a crash
                print(f"prefetch {pf} failed: {type(e).__name__}: {e}")
                ms = None
            us = 1000 * ms if ms else None
            base = us if pf == 0 else base
            gbs = 4 * HKV * n * D / ms / 1e6 if ms else None
            row = {"case": case, "L_max": L_max, "keys": n, "prefetch": pf, "picked": pf == default_config(L_max)[4],
                   "us": us, "GB/s": gbs, "of_copy_bw": gbs / bw if gbs else None,
                   "vs_pf0": base / us if base and us else None}
            if n < L_max and sdpa_us.get(L_max) and us:
                row["of_ideal"] = sdpa_us[L_max] / us * n / L_max
            rows.append(row)
            print(row, flush=True)  # a run cut short by a time limit still reports
        del kv
    return rows


RETRIEVAL_SWEEP = [  # (block_m (None: all rows), block_n, tiles (None: from the SM count), num_warps, num_stages,
    # key_rows: S^T = K Q^T (True) or S = Q K^T (False), see csrc_triton/retrieval_salience._tile_mass)
    (None, 32, None, 8, 1, False), (None, 32, 8, 8, 1, False), (None, 64, None, 8, 1, False),
    (None, 64, None, 8, 1, True), (None, 64, 4, 8, 1, True), (None, 64, 8, 8, 1, True),
    (None, 64, 16, 8, 1, True), (None, 128, None, 8, 1, True), (None, 128, 4, 8, 1, True),
    (None, 64, None, 4, 1, True), (None, 128, None, 4, 1, True), (None, 64, None, 8, 2, True),
    (128, 64, None, 4, 1, True), (None, 32, None, 4, 1, True),
]


def _question(S, T, n):
    """n (q, k, v) sets of a T-row question at the end of an S+T cache, and each row's LSE."""
    sets = []
    for _ in range(n):
        k = torch.randn(1, HKV, S + T, D, device="cuda", dtype=DT)
        q = torch.randn(1, H, T, D, device="cuda", dtype=DT)
        v = torch.randn_like(k)
        sets.append((q, k, v, ops.attention_lse(q, k, v, S)[1]))
    return sets


def retrieval_sweep_rows(S=32768, T=64) -> list[dict]:
    """Tile configurations of the retrieval-salience kernel (64-token question, 32K cache)."""
    from csrc_triton.retrieval_salience import retrieval_salience

    sets = _question(S, T, common.n_copies(2 * HKV * (S + T) * D))
    idx = torch.arange(S, device="cuda", dtype=torch.int32)
    prefill = common.graph_ms(lambda q, k, v, lse: ops.attention_lse(q, k, v, S), sets)
    rows = []
    for bm, bn, tiles, warps, stages, key_rows in RETRIEVAL_SWEEP:
        fn = functools.partial(retrieval_salience, idx=idx, block_m=bm, block_n=bn, tiles=tiles,
                               num_warps=warps, num_stages=stages, key_rows=key_rows)
        call = lambda q, k, v, lse, fn=fn: fn(q, k, lse=lse)  # noqa: E731
        try:
            eager, graph = common.bench(call, sets), common.graph_ms(call, sets)
        except Exception as e:  # a config that does not compile is a row, not a crash
            print(f"config {bm, bn, tiles, warps, stages, key_rows} failed: {type(e).__name__}: {e}")
            eager = graph = None
        name = f"m{bm or 'all'}n{bn}t{tiles or 'auto'}w{warps}s{stages}{'K' if key_rows else 'Q'}"
        rows.append({"case": "retrieval sweep", "L": S, "config": name,
                     "us": 1000 * eager if eager else None, "graph_us": 1000 * graph if graph else None,
                     "prefill_graph_us": 1000 * prefill if prefill else None,
                     "graph_share": graph / prefill if graph and prefill else None})
        print(rows[-1], flush=True)
    return rows


def _naive_salience(q, k, idx, scale):
    """Materialise softmax(q kᵀ) (1, H, T, S) over the whole prefix, then reduce it."""
    p = torch.softmax((q @ k.repeat_interleave(H // HKV, dim=1).transpose(-1, -2)).float() * scale, dim=-1)
    return p[..., idx.long()].sum(2).view(1, HKV, H // HKV, -1).sum(2)  # (1, Hkv, N)


def retrieval_rows(S=32768, T=64) -> list[dict]:
    scale = 1 / math.sqrt(D)
    sets = _question(S, T, common.n_copies(2 * HKV * (S + T) * D))
    idx = torch.arange(S, device="cuda", dtype=torch.int32)
    kern_fn = lambda q, k, v, lse: ops.retrieval_salience(q, k, idx, lse)  # noqa: E731
    prefill_fn = lambda q, k, v, lse: ops.attention_lse(q, k, v, S)  # noqa: E731
    kern, kern_g = common.bench(kern_fn, sets), common.graph_ms(kern_fn, sets)
    prefill, prefill_g = common.bench(prefill_fn, sets), common.graph_ms(prefill_fn, sets)
    # The same slots as a range: what the runtime passes when the retrievable slots are one run (kv_cache's
    # kernel_idx): the keys are read as one block and no slot is loaded.
    span_fn = lambda q, k, v, lse: ops.retrieval_salience(q, k, range(0, S), lse)  # noqa: E731
    span, span_g = common.bench(span_fn, sets), common.graph_ms(span_fn, sets)
    naive = common.bench(lambda q, k, v, lse: _naive_salience(q, k[:, :, :S], idx, scale), sets, iters=20)
    rows = [{"case": "retrieval kernel", "L": S, "T": T, "us": 1000 * kern,
             "graph_us": 1000 * kern_g if kern_g else None},
            {"case": "retrieval kernel, range", "L": S, "T": T, "us": 1000 * span,
             "graph_us": 1000 * span_g if span_g else None, "kernel_speedup": naive / span if naive else None},
            {"case": "retrieval naive", "L": S, "T": T, "us": 1000 * naive, "kernel_speedup": naive / kern,
             "target": ">=5x"},
            {"case": "question prefill attn (flash+LSE)", "L": S, "T": T, "us": 1000 * prefill,
             "graph_us": 1000 * prefill_g if prefill_g else None, "retrieval_share": kern / prefill,
             "graph_share": kern_g / prefill_g if kern_g and prefill_g else None, "target": "retrieval <=0.25",
             "range_share": span / prefill, "range_graph_share": span_g / prefill_g if span_g and prefill_g else None}]
    try:
        from flash_colreduce import flash_colreduce
    except ImportError:
        rows.append({"case": "flash-colreduce", "note": "not installed (pip install .whl/flash_colreduce-*.whl)"})
        return rows
    ex = [(q, k.repeat_interleave(H // HKV, dim=1)) for q, k, _, _ in sets[:2]]  # GQA keys expanded
    fc = common.bench(lambda q, kx: flash_colreduce(q, kx, reduction="sum", is_causal=True), ex)
    rows.append({"case": "flash-colreduce causal", "L": S, "T": T, "us": 1000 * fc, "kernel_speedup": fc / kern})
    return rows


def _timed(setup, fn, iters: int = 20) -> float:
    """Median ms of fn() (device events, host gaps included: eager) after an untimed setup()."""
    times = []
    for _ in range(iters + 3):
        setup()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[3:])[iters // 2]


def question_cache(S: int, T: int, turn: int, device="cuda", dtype=DT):
    """A 32-layer Llama-3-8B-head cache of S slots (32 system, then S - 32 retrievable visual ones) with a T-token
    question after them and room for a `turn`-token answer, random K/V, and its Retrieval; the question's q
    (1, H, T, D) and its LSE (the prefill attention's). What a question's scoring and packing run on
    (overhead_rows)."""
    cfg = TextConfig(dim=H * D, n_layers=LAYERS, n_heads=H, n_kv_heads=HKV, max_seq_len=S + T + turn)
    cache = KVCache(cfg, dtype=dtype, device=device)
    cache.k_stack.normal_()
    cache.v_stack.normal_()
    cache.add_span("system", 0, 32)
    cache.add_span("visual", 32, S)  # N = S - 32 retrievable slots
    cache.add_span("question", S, S + T)
    q = torch.randn(1, H, T, D, device=device, dtype=dtype)
    lse = ops.attention_lse(q, cache.k[0][:, :, :S + T], cache.v[0][:, :, :S + T], S)[1]
    return cache, Retrieval(cache), q, lse


def overhead_rows(S=8192, T=64, keep=0.1, turn=50) -> list[dict]:
    """Per question, 32 layers: retrieval (per layer, as the prefill launches it beside attention)
    + Retrieval.pack (one selection over the stacked scores, one pack launch for all K and V)."""
    cache, ret, q, lse = question_cache(S, T, turn)

    def score():
        ret.begin_scoring(S)
        for layer in range(LAYERS):
            ret.scoring.add(layer, S, q, cache.k[layer][:, :, :S + T], lse)

    def pack():
        ret.pack(keep, S + T)
        ret.unpack()

    score_ms = _timed(lambda: None, score)
    pack_ms = _timed(score, pack)
    score()
    rows_n = ret.pack(keep, S + T)  # one checked pack: every layer's K and V rows are the gathered slots
    idx = ret.packed.idx.long()[..., None].expand(-1, -1, -1, -1, D)
    exact = all(torch.equal(p[..., :rows_n, :], torch.gather(f, 3, idx))
                for p, f in ((ret.packed.k_stack, cache.k_stack), (ret.packed.v_stack, cache.v_stack)))
    ret.unpack()
    score()
    out = ret.scoring.scores
    idx = ret.scoring.kernel_idx  # what Scoring.add passes: the span when the slots are one run
    retr_g = common.graph_ms(lambda: [ops.retrieval_salience(q, cache.k[i][:, :, :S + T], idx, lse, out=out[i])
                               for i in range(LAYERS)], [()], calls=1)
    rows, total = [], score_ms + pack_ms
    for name, ms in (("retrieval 32 layers (eager)", score_ms), ("retrieval 32 layers (graph)", retr_g),
                     ("select+pack 32 layers, batched (eager)", pack_ms), ("retrieval+pack (eager)", total)):
        rows.append({"case": name, "L": S, "keep": keep, "rows": rows_n, "pack_exact": exact, "us": 1000 * ms if ms else None,
                     "of_50tok_turn_floor": ms / (turn * STEP_MS_8K_FLOOR) if ms else None,
                     "of_50tok_turn_400tps": ms / (turn * STEP_MS_400TPS) if ms else None, "target": "<=0.05"})
    return rows


def pack_sweep_rows(S=8192, T=64, keep=0.1) -> list[dict]:
    """kv_pack's rows per program for all 32 layers' K and V in one launch (graph-timed)."""
    from csrc_triton.kv_pack import kv_pack

    src = [torch.randn(LAYERS, 1, HKV, S + T, D, device="cuda", dtype=DT) for _ in range(2)]
    L = round(keep * S) + T
    idx = torch.rand(LAYERS, 1, HKV, S + T, device="cuda").argsort(-1)[..., :L].sort(-1).values.to(torch.int32)
    dst = [torch.empty(LAYERS, 1, HKV, L + 64, D, device="cuda", dtype=DT) for _ in range(2)]
    rows, bw = [], common.copy_bandwidth_gbs()
    for block_l in (16, 32, 64, 128):
        ms = common.graph_ms(lambda b=block_l: kv_pack(tuple(src), idx, tuple(dst), block_l=b), [()])
        gbs = 2 * 2 * LAYERS * HKV * L * D * 2 / ms / 1e6 if ms else None  # read + write, K and V
        rows.append({"case": "pack sweep (graph)", "L": S, "keep": keep, "block_l": block_l,
                     "us": 1000 * ms if ms else None, "GB/s": gbs, "of_copy_bw": gbs / bw if gbs else None})
        print(rows[-1], flush=True)
    return rows


SWEEPS = ("decode", "retrieval", "pack", "prefetch")


def add_args(p) -> None:
    p.add_argument("--decode-sweep", default="", metavar="NAMES",
                   help=f"run these tile sweeps instead of the rows: comma-separated from {', '.join(SWEEPS)}, or all")
    p.add_argument("--decode-sweep-cases", default="", metavar="SLOTS:KEYS,...",
                   help="the decode sweep's (buffer slots, keys attended), e.g. 4096:3277,16384:13107 "
                        "(default: full buffers of 1K, 8K, 32K, 128K)")


def run(args) -> list[dict]:
    sweep = set(args.decode_sweep.split(",")) - {""}
    sweep = set(SWEEPS) if "all" in sweep else sweep
    if sweep - set(SWEEPS):
        raise ValueError(f"--decode-sweep: unknown {sorted(sweep - set(SWEEPS))}; choose from {SWEEPS} or all")
    if sweep:  # the tile sweeps only (each row is printed as it is measured)
        rows = []
        if "decode" in sweep:
            rows += sweep_rows(args.decode_sweep_cases)
        if "retrieval" in sweep:
            rows += retrieval_sweep_rows()
        if "pack" in sweep:
            rows += pack_sweep_rows()
        if "prefetch" in sweep:
            rows += _shown(prefetch_rows())
        return rows
    return run_rows(args.quick)


def _shown(rows: list[dict]) -> list[dict]:
    """Print one group's table as soon as it is measured (the final table shows the first
    group's columns only; the JSON line has every row)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))  # every column of the group
    common.print_table([{k: r.get(k) for k in keys} for r in rows])
    print(flush=True)
    return rows


def run_rows(quick: bool) -> list[dict]:
    rows = _shown(decode_rows([1024, 8192, 32768] if quick else [1024, 8192, 32768, 131072]))
    rows += _shown(sparse_vs_sdpa([32768] if quick else [32768, 131072], [0.25, 0.1]))
    rows += _shown(retrieval_rows())
    rows += _shown(overhead_rows())
    return rows
