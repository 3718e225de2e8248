"""W4A16 GEMV (decode) and GEMM (prefill) against fp16 cuBLAS at Llama-3-8B layer shapes (group 128).

    python -m scripts.bench_kernels --only w4a16 [--quick]

Times are device times: a GPU spin is queued before each timed call so the CPU launch cost (Python
checks, the autotuner's dispatch; hidden by CUDA graphs in decode) is not counted, for both sides alike.
GEMV rows (M = 1, 4, 8): time, GB/s counting packed weights + scales + zeros + x + y, the fraction of the
measured device-copy bandwidth, the speed-up over F.linear on the fp16 weight. GEMM rows: TFLOP/s and the
ratio to cuBLAS, per path ("auto": the default dispatch, i.e. the fused dequantizing Triton GEMM below
DEQUANT_MIN_M rows; "dequant": w4a16_dequant + cuBLAS, the default from DEQUANT_MIN_M rows). Targets:
GEMV at M=1 >= 3.0x cuBLAS and >= 70% of copy bandwidth; GEMM at M=2048 >= 0.8x cuBLAS.

GEMM tile sweep (replaces the rows above; ~2 min on an H200, mostly Triton compiling ~32 tile variants):

    python -m scripts.bench_kernels --only w4a16 --w4-gemm-sweep 16,32,64,128,256,512

prints each fused config's time per shape and M (checked against the dequant path first), then the
CONFIG_TABLE to paste into csrc_triton/w4a16_gemm.py, the DEQUANT_MIN_M crossover, and summary rows.

Programmatic dependent launch (csrc_triton/pdl.py) off and on, M=1 (~30 s):

    python -m scripts.bench_kernels --only w4a16 --w4-pdl-sweep

per shape: per-call time of 16 back-to-back GEMVs, and of 16 (add+RMSNorm -> GEMV) pairs, the decode step's
pattern (the norm's output is the GEMV's input), both replayed from a CUDA graph, each output checked.

Gluon GEMM sweep (replaces the rows above; ~3 min):
    python -m scripts.bench_kernels --only w4a16 --w4-wgmma-sweep 16,32,48
prints, per shape and M, the Triton GEMM's time (its table tile) and each Gluon tile's (csrc_triton/w4a16_gemm_wgmma.py),
both per call from a CUDA graph, then the TILE_TABLE to paste (shapes where the Gluon kernel wins) and totals x32.
GEMV config sweep (replaces the rows above; for M = 1: 22 variants compiled in 12 worker processes, 136 configs
timed, then the chosen table checked at fp16/bf16, M = 1, 2, 4, 8; ~190 configs took ~70 s on an H200):

    python -m scripts.bench_kernels --only w4a16 --w4-gemv-sweep 1 [--w4-table-out table.txt] [--w4-sweep-tiles ...]

prints, per layer shape (largest first) and M, each config's per-call time replayed from a CUDA graph (16
back-to-back calls, decode's situation), GB/s, share of the copy bandwidth and speed-up over cuBLAS (also
replayed) next to the read floor (a plain kernel reading the same bytes, replayed), then the GEMV_TABLE to
paste into csrc_triton/w4a16_gemv.py (also written to --w4-table-out after every shape), the check
of that table, and summary rows (launcher default vs best, and their sum over the 4 layers).
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from csrc_triton.w4a16_gemm import DEQUANT_MIN_M, Config, config_ok, m_bucket, rule_config, split_for, w4a16_gemm
from csrc_triton.w4a16_gemm_wgmma import SMEM_LIMIT, TILE_TABLE, Tile, fit_tile, smem_bytes, tile_ok
from scripts.benches import common
from tinyvila import ops
from tinyvila.quant import dequantize_w4, quantize_w4

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]  # (K, N)
GROUP = 128
SPIN_CYCLES = 200_000  # ~100 us at H200 clocks: longer than any launch below


def _w4_bytes(N: int, K: int) -> int:
    return N * K // 2 + N * (K // GROUP) * (2 + 4)  # int4 payload + fp16 scale + fp32 zero per group


def _weights(N: int, K: int, copies: int) -> list[tuple]:
    """`copies` independent (dense fp16 W, qweight, scales, zeros) sets, so rotation defeats L2."""
    sets = []
    for _ in range(copies):
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        p = quantize_w4(w, GROUP, dtype=torch.float16)
        sets.append((w, p["qweight"], p["scales"], p["zeros"]))
    return sets


def device_ms(fn, inputs: list, iters: int = 50) -> float:
    """Median device milliseconds, launch latency hidden behind a GPU spin."""
    return common.bench(fn, inputs, iters=iters, spin_cycles=SPIN_CYCLES)


def _row(name: str, M: int, N: int, K: int, sets: list[tuple], iters: int, path: str | None) -> dict:
    xs = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _ in sets]
    w4_in = [(x, q, s, z) for x, (_, q, s, z) in zip(xs, sets)]
    fp_in = [(x, w) for x, (w, _, _, _) in zip(xs, sets)]
    if path is None:
        fn = lambda x, q, s, z: ops.w4a16_linear(x, q, s, z)  # noqa: E731
    else:
        fn = lambda x, q, s, z: w4a16_gemm(x, q, s, z, path=path)  # noqa: E731
    t_w4 = device_ms(fn, w4_in, iters=iters)
    t_fp = device_ms(F.linear, fp_in, iters=iters)
    gemv = M <= ops.GEMV_MAX_M
    w4_gbs = (_w4_bytes(N, K) + 2 * M * (K + N)) / t_w4 / 1e6
    # Every row has every key (None where it does not apply) so the table shows all columns.
    return {"layer": name, "kernel": "gemv" if gemv else f"gemm:{path or 'auto'}", "M": M, "N": N, "K": K,
            "w4_us": 1e3 * t_w4, "cublas_us": 1e3 * t_fp, "speedup": t_fp / t_w4,
            "w4_GBs": w4_gbs if gemv else None,
            "copy_frac": w4_gbs / common.copy_bandwidth_gbs() if gemv else None,
            "cublas_GBs": (2 * N * K + 2 * M * (K + N)) / t_fp / 1e6 if gemv else None,
            "w4_TFLOPs": None if gemv else 2 * M * N * K / t_w4 / 1e9,
            "cublas_TFLOPs": None if gemv else 2 * M * N * K / t_fp / 1e9}


def add_args(p) -> None:
    p.add_argument("--w4-gemv-sweep", type=common.ints, metavar="M,...",
                   help="instead of the rows: the GEMV config sweep at these row counts (e.g. 1 or 1,2,4,8)")
    p.add_argument("--w4-sweep-tiles", metavar="W,N,G,S[,R];...",
                   help="the GEMV sweep's tiles (warps, rows, groups per K step, stages, register cap) instead of "
                        "GEMV_SWEEP_TILES")
    p.add_argument("--w4-table-out", metavar="PATH", help="the GEMV sweep also writes its GEMV_TABLE literal here")
    p.add_argument("--w4-gemm-sweep", type=common.ints, metavar="M,...",
                   help="instead of the rows: the fused GEMM tile sweep at these prompt row counts")
    p.add_argument("--w4-gemm-unpack", type=common.ints, default=[1], metavar="U,...",
                   help="the GEMM sweep times each tile in these dequantization forms (1: fp32 FMAs, 2: 16-bit pairs)")
    p.add_argument("--w4-wgmma-sweep", type=common.ints, metavar="M,...",
                   help="instead of the rows: the Gluon GEMM's tiles against the Triton GEMM's table tile at these "
                        "prompt row counts, each replayed from a CUDA graph; prints its TILE_TABLE")
    p.add_argument("--w4-wgmma-install", action="store_true",
                   help="the Gluon sweep also puts the table it found into TILE_TABLE in this process, so that a "
                        "bench after it (--only w4a16 prefill_graph) runs those tiles")
    p.add_argument("--w4-pdl-sweep", action="store_true",
                   help="instead of the rows: the GEMVs and (norm -> GEMV) pairs with PDL off and on, M = 1")


def run(args) -> list[dict]:
    if args.w4_pdl_sweep:
        return pdl_sweep()
    if args.w4_gemv_sweep:
        return gemv_sweep(args.w4_gemv_sweep, gemv_sweep_tiles(args.w4_sweep_tiles), args.w4_table_out)
    if args.w4_gemm_sweep:
        return gemm_sweep(args.w4_gemm_sweep, args.w4_gemm_unpack)
    if args.w4_wgmma_sweep:
        return wgmma_sweep(args.w4_wgmma_sweep, install=args.w4_wgmma_install)
    quick = args.quick
    gemv_ms = [1] if quick else [1, 4, 8]
    # GEMM rows: path None = the default dispatch (fused below DEQUANT_MIN_M rows, dequant + cuBLAS above).
    gemm_cases = [(256, None), (2048, "dequant")] if quick else [(16, None), (64, None), (256, None), (256, "dequant"),
                                                                 (512, None), (512, "dequant"), (2048, "dequant")]
    iters = 20 if quick else 100
    rows = []
    for name, K, N in SHAPES:
        copies = common.n_copies(_w4_bytes(N, K))  # enough packed sets to exceed L2; fp16 sets are 4x larger
        sets = _weights(N, K, copies)
        rows += [_row(name, M, N, K, sets, iters, None) for M in gemv_ms]
        rows += [_row(name, M, N, K, sets, iters, path) for M, path in gemm_cases]
        del sets
        torch.cuda.empty_cache()
    return rows


# -- GEMM tile sweep: --w4-gemm-sweep 16,32,64,128,256,512 (prompt rows) -----------------------------------
LAYERS_8B = 32  # Llama-3-8B: each SHAPES entry runs once per layer


def gemm_sweep_configs(M: int, N: int, K: int, n_sm: int = 132) -> list[Config]:
    """The fused-kernel tiles the sweep times at M rows: the rule's pick first, then BLOCK_M = the M bucket
    (<= 256) and half of it (from 64 rows), 64 or 128 weight rows (4 / 8 warps), BLOCK_W 8 / 16, 3 / 4 stages
    (those config_ok keeps), each with split-K by the rule and at half and double that (split-K is a
    runtime argument: no extra compilation)."""
    top = min(m_bucket(M), 256)
    out = [rule_config(M, N, K, n_sm)]
    for bm in [top] + ([top // 2] if top >= 64 else []):
        for bn, warps in ((64, 4), (128, 8), (256, 16)):
            for bw in (8, 16):
                for stages in (3, 4):
                    cfg = Config(bm, bn, bw, 1, warps, stages)
                    if not config_ok(cfg):
                        continue
                    n_k = K // (8 * bw)
                    tiles = -(-M // bm) * -(-N // bn)
                    split = split_for(tiles, n_k, n_sm * (2 if bm <= 64 else 1))
                    for s in sorted({max(1, split // 2), split, split * 2}):
                        if n_k // s >= 2:
                            out.append(cfg._replace(split_k=s))
    return list(dict.fromkeys(out))


def _time_configs(M: int, N: int, K: int, sets: list[tuple], n_sm: int, iters: int,
                  unpacks: list[int]) -> list[tuple[list[dict], dict]]:
    """Times every sweep config in every dequantization form of `unpacks` (checked first against the dequant path's
    output), the dequant path and fp16 cuBLAS at one (M, N, K); prints one line per config, returns per form the
    config rows and the summary row."""
    xs = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _ in sets]
    w4_in = [(x, q, s, z) for x, (_, q, s, z) in zip(xs, sets)]
    ref = w4a16_gemm(*w4_in[0], path="dequant")
    t_deq = device_ms(lambda x, q, s, z: w4a16_gemm(x, q, s, z, path="dequant"), w4_in, iters=iters)
    t_fp = device_ms(F.linear, [(x, w) for x, (w, _, _, _) in zip(xs, sets)], iters=iters)
    return [_time_form(M, N, K, w4_in, ref, t_deq, t_fp, n_sm, iters, u) for u in unpacks]


def _time_form(M, N, K, w4_in, ref, t_deq, t_fp, n_sm, iters, unpack) -> tuple[list[dict], dict]:
    flop = 2 * M * N * K
    rows = []
    for cfg in gemm_sweep_configs(M, N, K, n_sm):
        name = f"{cfg.name}u{unpack}"
        try:  # a config that fails to compile or launch is reported, not fatal to the sweep
            y = w4a16_gemm(*w4_in[0], config=cfg, unpack=unpack)
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t = device_ms(lambda x, q, s, z, c=cfg: w4a16_gemm(x, q, s, z, config=c, unpack=unpack), w4_in, iters=iters)
        except Exception as e:
            print(f"  M={M:<5} N={N:<6} K={K:<6} {name:<24} FAILED: {str(e).splitlines()[0][:120]}", flush=True)
            rows.append({"config": cfg, "us": float("inf"), "ok": False, "err": float("nan")})
            continue
        rows.append({"config": cfg, "us": 1e3 * t, "ok": err < 1e-2, "err": err})
        print(f"  M={M:<5} N={N:<6} K={K:<6} {name:<24} {1e3 * t:9.1f} us {flop / t / 1e9:6.0f} TFLOP/s "
              f"x{t_deq / t:5.2f} vs dequant x{t_fp / t:5.2f} vs fp16{'' if err < 1e-2 else f'  WRONG (rel err {err:.2g})'}",
              flush=True)
    good = [r for r in rows if r["ok"]]
    best = min(good, key=lambda r: r["us"]) if good else None
    summary = {"M": M, "N": N, "K": K, "unpack": unpack, "best": best["config"].name if best else None,
               "best_us": best["us"] if best else None, "rule_us": rows[0]["us"] if rows[0]["ok"] else None,
               "dequant_us": 1e3 * t_deq, "fp16_us": 1e3 * t_fp,
               "best_TFLOPs": flop / best["us"] / 1e6 if best else None,
               "vs_dequant": 1e3 * t_deq / best["us"] if best else None,
               "vs_fp16": 1e3 * t_fp / best["us"] if best else None, "wrong": sum(not r["ok"] for r in rows)}
    return rows, {**summary, "_config": best["config"] if best else None}


def gemm_sweep(ms: list[int], unpacks: list[int] = (1,), iters: int = 30) -> list[dict]:
    """Per Llama-3-8B shape and M: every sweep config's time, TFLOP/s and ratios (printed as it goes), then
    the CONFIG_TABLE literal to paste into csrc_triton/w4a16_gemm.py, the suggested DEQUANT_MIN_M, and one
    summary row per (shape, M) plus a per-M total over the 4 shapes (and x32 layers: the 8B prefill's linears)."""
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    summaries = []
    for name, K, N in SHAPES:
        sets = _weights(N, K, common.n_copies(_w4_bytes(N, K)))
        for M in ms:
            for _, summary in _time_configs(M, N, K, sets, n_sm, iters, list(unpacks)):
                summaries.append({"layer": name, **summary})
        del sets
        torch.cuda.empty_cache()
    totals = []
    for unpack in unpacks:
        totals += _sweep_totals([r for r in summaries if r["unpack"] == unpack], ms, unpack)
    return [{k: v for k, v in r.items() if k != "_config"} for r in summaries] + totals


def _sweep_totals(summaries: list[dict], ms: list[int], unpack: int) -> list[dict]:
    """One form's CONFIG_TABLE literal, its DEQUANT_MIN_M crossover and per-M totals over the 4 shapes x 32 layers."""
    table = {(m_bucket(r["M"]), r["N"], r["K"]): r["_config"] for r in summaries if r["_config"] is not None}
    print(f"\nCONFIG_TABLE = {{  # {torch.cuda.get_device_name()} sweep, fp16, group 128, unpack={unpack}")
    for key, cfg in sorted(table.items()):
        print(f"    {key}: Config{tuple(cfg)},  # {cfg.name}")
    print("}")
    totals = []
    for M in ms:
        rs = [r for r in summaries if r["M"] == M]
        fused = sum(r["best_us"] or float("inf") for r in rs)
        deq, fp = sum(r["dequant_us"] for r in rs), sum(r["fp16_us"] for r in rs)
        totals.append({"layer": "all x32 (ms)", "M": M, "unpack": unpack, "best_us": LAYERS_8B * fused / 1e3,
                       "rule_us": LAYERS_8B * sum(r["rule_us"] or float("inf") for r in rs) / 1e3,
                       "dequant_us": LAYERS_8B * deq / 1e3, "fp16_us": LAYERS_8B * fp / 1e3,
                       "vs_dequant": deq / fused, "vs_fp16": fp / fused})
    worse = [t["M"] for t in totals if t["vs_dequant"] < 1]
    print(f"DEQUANT_MIN_M: {min(worse) if worse else f'> {max(ms)} (fused wins at every swept M)'}  "
          f"(smallest swept M where dequant + cuBLAS beats the best fused tiles, summed over the 4 shapes)")
    return totals


# -- Gluon GEMM tile sweep: --w4-wgmma-sweep 16,32,64 -------------------------------------------------------
def wgmma_sweep_tiles(M: int, K: int) -> list[Tile]:
    """The Gluon kernel's tiles timed at M rows. Short prompts (M <= 64): one row tile (BLOCK_M = the M bucket), 64
    weight rows a warpgroup, one or two warpgroups with one or two m64 blocks each (two also warp-specialised: ws),
    rings of 4 to 8 stages, splits of 1 to 8; and each (weight rows, split, warps) with the weights
    through shared memory (smem_a: 3 stages, the buffers take the ring's room) where that fits at K. Long prompts:
    row tiles of 64 and 128 (smem_a or ws; 128 with one m64 block a warpgroup), K steps of 64 or 128, rings of 3 or
    4, splits of 1 or 2 (the scales of a whole K range may not fit shared memory)."""
    fit = lambda ts: [t for t in dict.fromkeys(ts) if tile_ok(t) and  # noqa: E731
                      smem_bytes(fit_tile(t, K, GROUP), K, GROUP) <= SMEM_LIMIT]
    if M > 64:
        return fit([Tile(bm, bn, bw, sp, st, w, True) for bm in (64, 128) for bn, w in ((64, 4), (128, 8))
                    for bw in (8, 16) for sp in (1, 2) for st in (3, 4)]
                   + [Tile(64, 128, 16, sp, 4, 4) for sp in (1, 2)] + [Tile(64, 256, 16, 1, 4, 8)]
                   + [Tile(bm, 128, bw, sp, st, 8, ws=True) for bm in (64, 128) for bw in (8, 16) for sp in (1, 2)
                      for st in (3, 4)])
    bm = m_bucket(M)
    base = ([Tile(bm, 64, 16, sp, st, 4) for sp in (2, 4, 8) for st in (6, 8)]
            + [Tile(bm, 128, 16, sp, 4, 4) for sp in (1, 2, 4)]
            + [Tile(bm, 128, 16, sp, st, 8) for sp in (1, 2, 4) for st in (4, 6)]
            + [Tile(bm, 256, 16, sp, 4, 8) for sp in (1, 2)]
            + fit([Tile(bm, 128, 16, sp, st, 8, ws=True) for sp in (1, 2, 4) for st in (4, 6)]
                  + [Tile(bm, 256, 16, sp, 4, 8, ws=True) for sp in (1, 2)]))
    return base + fit(t._replace(smem_a=True, stages=3) for t in base)


def _wgmma_compile(job: tuple) -> str | None:
    """Worker: one Gluon GEMM call at (M, N, K, tile) on zero weights, so Triton compiles it into its disk cache."""
    M, N, K, tile = job
    try:
        x = torch.zeros(M, K, device="cuda", dtype=torch.float16)
        w4a16_gemm(x, torch.zeros(N, K // 8, device="cuda", dtype=torch.int32),
                   torch.ones(N, K // GROUP, device="cuda", dtype=torch.float16),
                   torch.zeros(N, K // GROUP, device="cuda"), path="wgmma", config=Tile(*tile))
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return str(e).splitlines()[0][:120]


def wgmma_sweep(ms: list[int], calls: int = 16, install: bool = False) -> list[dict]:
    """Per Llama-3-8B shape and M: the Triton GEMM (its table tile, pair form) and every Gluon tile, each checked
    against the dequant path and timed per call from a CUDA graph of `calls` back-to-back calls over rotating weight
    copies (a prefill graph's situation: no host cost). Prints each time, then the TILE_TABLE literal (the shapes
    where the best Gluon tile beats the Triton kernel) and per-M totals x32 layers. `install`: that table replaces
    TILE_TABLE's entries at the swept buckets in this process."""
    jobs = [(M, N, K, tuple(t)) for _, K, N in SHAPES for M in ms for t in wgmma_sweep_tiles(M, K)]
    with _pool(14) as pool:  # compiled in parallel (16 cores), then found in the disk cache below
        fails = [(j, r) for j, r in zip(jobs, pool.map(_wgmma_compile, jobs)) if r]
    print(f"precompiled {len(jobs)} Gluon variants, {len(fails)} failed", flush=True)
    rows = []
    for name, K, N in SHAPES:
        sets = _weights(N, K, common.n_copies(_w4_bytes(N, K)))
        for M in ms:
            ins = [(torch.randn(M, K, device="cuda", dtype=torch.float16), q, s, z) for _, q, s, z in sets]
            ref = w4a16_gemm(*ins[0], path="dequant").float()
            # What runs without this kernel: the Triton GEMM (pair form) below DEQUANT_MIN_M rows, dequant + cuBLAS
            # from there; and, for long prompts, the fp16 model's cuBLAS call (W4 prefill's target).
            other = "fused" if M < DEQUANT_MIN_M else "dequant"
            triton_gemm = lambda x, q, s, z, p=other: w4a16_gemm(x, q, s, z, path=p, unpack=2)  # noqa: E731
            t_tr = common.graph_ms(triton_gemm, ins, calls)
            t_fp = (common.graph_ms(F.linear, [(x, w) for (x, _, _, _), (w, _, _, _) in zip(ins, sets)], calls)
                    if M >= DEQUANT_MIN_M else None)
            best = (float("inf"), None)
            for tile in wgmma_sweep_tiles(M, K):
                try:
                    y = w4a16_gemm(*ins[0], path="wgmma", config=tile).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    t = common.graph_ms(lambda x, q, s, z, c=tile: w4a16_gemm(x, q, s, z, path="wgmma", config=c),
                                        ins, calls)
                except Exception as e:  # a tile that does not fit is reported, not fatal
                    print(f"  M={M:<4} {name:<8} {tile.name:<22} FAILED: {str(e).splitlines()[0][:120]}",
                          flush=True)
                    continue
                ok = err < 1e-2 and t is not None
                vs_fp = f"  x{t_fp / t:4.2f} vs fp16" if t_fp else ""
                print(f"  M={M:<4} {name:<8} {tile.name:<22} {1e3 * t:8.1f} us  x{t_tr / t:4.2f} vs {other}{vs_fp}"
                      f"{'' if ok else f'  WRONG (rel err {err:.2g})'}", flush=True)
                if ok and t < best[0]:
                    best = (t, tile)
            t_ro = _read_only_ms(best[1], ins, N, K, calls) if best[1] else None
            if t_ro:
                print(f"  M={M:<4} {name:<8} {best[1].name:<22} read-only: {1e3 * t_ro:8.1f} us "
                      f"({best[0] / t_ro:.2f}x of it)", flush=True)
            rows.append({"layer": name, "M": M, "N": N, "K": K, "triton_us": 1e3 * t_tr, "baseline": other,
                         "fp16_us": 1e3 * t_fp if t_fp else None, "read_only_us": 1e3 * t_ro if t_ro else None,
                         "wgmma_us": 1e3 * best[0], "best": best[1].name if best[1] else None,
                         "speedup": t_tr / best[0], "_tile": best[1]})
        del sets
        torch.cuda.empty_cache()
    print(f"\nTILE_TABLE = {{  # {torch.cuda.get_device_name()}, fp16, group 128: where the Gluon kernel wins")
    for r in rows:
        if r["_tile"] is not None and r["speedup"] > 1.0:
            print(f"    ({m_bucket(r['M'])}, {r['N']}, {r['K']}): Tile{tuple(r['_tile'])},  # x{r['speedup']:.2f}")
    print("}")
    if install:
        for r in rows:
            key = (m_bucket(r["M"]), r["N"], r["K"])
            TILE_TABLE.pop(key, None)
            if r["_tile"] is not None and r["speedup"] > 1.0:
                TILE_TABLE[key] = r["_tile"]
        print(f"installed in TILE_TABLE for this process ({len(TILE_TABLE)} shapes)", flush=True)
    totals = []
    for M in ms:
        rs = [r for r in rows if r["M"] == M]
        tr = sum(r["triton_us"] for r in rs)
        both = sum(min(r["triton_us"], r["wgmma_us"]) for r in rs)
        fp = sum(r["fp16_us"] for r in rs) if M >= DEQUANT_MIN_M else None
        ro = sum(r["read_only_us"] or 0.0 for r in rs)
        totals.append({"layer": "all x32 (ms)", "M": M, "triton_us": LAYERS_8B * tr / 1e3,
                       "read_only_us": LAYERS_8B * ro / 1e3,
                       "fp16_us": LAYERS_8B * fp / 1e3 if fp else None,
                       "wgmma_us": LAYERS_8B * both / 1e3, "speedup": tr / both})
    return [{k: v for k, v in r.items() if k != "_tile"} for r in rows] + totals


def _read_only_ms(tile: Tile, ins: list, N: int, K: int, calls: int) -> float | None:
    """The Gluon kernel's floor at a tile: its launch with READ_ONLY (the same TMA ring of words and x, scales and
    split-K epilogue, no dequantization or wgmma; the one-partition form, which READ_ONLY applies to), per call from
    a graph as the sweep times."""
    from csrc_triton.w4a16_gemm_wgmma import WgmmaLaunch

    M = ins[0][0].shape[0]
    tile = fit_tile(tile._replace(ws=False), K, GROUP)  # a ws tile's ring, in the one-partition form
    launch = WgmmaLaunch(M, N, K, GROUP, tile, torch.float16, False, N)
    launch.meta["READ_ONLY"] = True
    out = torch.empty(M, N, device="cuda", dtype=torch.float16)
    ws = torch.empty(max(1, tile.split_k * M * N), device="cuda", dtype=torch.float32)
    cnt = torch.zeros(triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n), device="cuda", dtype=torch.int32)
    try:
        return common.graph_ms(lambda x, q, s, z: launch(x, q, s, z, None, out, ws, cnt), ins, calls)
    except Exception as e:  # a floor that does not compile is reported, not fatal
        print(f"  read-only {tile.name} FAILED: {str(e).splitlines()[0][:120]}", flush=True)
        return None


# -- GEMV config sweep: --w4-gemv-sweep 1 (or a list of M: 1,2,4,8) -------------------------------------------
N_SM = 132
# Tensor-core tiles the sweep times: (num_warps, BLOCK_N rows, GPS groups per K step, STAGES in flight[, maxnreg]):
# the tiles of the earlier sweeps (docs/perf_notes.md), several of them timed there only in kernel forms since
# removed. The last is capped at 168 registers so that 3 of its programs fit an SM (gate_up 32.5 us, 24.4 uncapped).
GEMV_SWEEP_TILES = [(2, 32, 8, 3), (2, 64, 4, 3), (4, 64, 8, 3), (4, 64, 4, 2), (4, 64, 4, 3), (4, 128, 4, 3),
                    (8, 128, 2, 3), (8, 128, 4, 3), (8, 256, 2, 3), (8, 256, 4, 2), (4, 128, 4, 3, 168)]
GEMV_SWEEP_SPLITS = (1, 2, 4, 8)
def gemv_sweep_tiles(spec: str | None = None) -> list[tuple[int, ...]]:
    """GEMV_SWEEP_TILES, or the tiles of `spec` ("w,n,g,s[,r];...", --w4-sweep-tiles: the same tuple order, the
    register cap r (0 or left out: none) last), as 5-tuples (w, n, g, s, r)."""
    spec = (spec or "").strip()
    tiles = GEMV_SWEEP_TILES if not spec else [tuple(int(v) for v in t.split(",")) for t in spec.split(";") if t.strip()]
    # a 5th number below 32 is no register cap: most likely a tile of the older form (w,n,g,s,chains,...)
    if any(not 4 <= len(t) <= 5 or (len(t) == 5 and 0 < t[4] < 32) for t in tiles):
        raise ValueError("--w4-sweep-tiles wants 'warps,rows,gps,stages[,maxnreg]' tiles separated by ';' "
                         f"(maxnreg 0 or >= 32), got {spec!r}")
    return [tuple(t) + (0,) * (5 - len(t)) for t in tiles]


def gemv_sweep_configs(N: int, K: int, M: int = 1, tiles: list[tuple[int, ...]] | None = None) -> list[dict]:
    """The GEMV configs the sweep times at an (M, N, K) call (group 128): the launcher's pick first, then every
    tile (`gemv_sweep_tiles()` by default) at each split-K (a runtime argument; split > 1 is one more compiled
    variant) that leaves every split >= 2 K steps and the grid <= 8 programs per SM."""
    from csrc_triton.w4a16_gemv import gemv_config

    groups = K // GROUP
    out = [gemv_config(M, N, K, GROUP)]
    for warps, bn, gps, stages, maxnreg in tiles or gemv_sweep_tiles():
        for split in GEMV_SWEEP_SPLITS:
            if groups // split >= 2 * gps and (split == 1 or -(-N // bn) * split <= 8 * N_SM):
                cfg = {"kernel": "mma", "BLOCK_N": bn, "num_warps": warps, "STAGES": stages, "SPLIT_K": split,
                       "GPS": gps}
                out.append({**cfg, "maxnreg": maxnreg} if maxnreg else cfg)
    unique = {tuple(sorted(c.items())): c for c in out}  # the launcher's pick is not timed twice
    return list(unique.values())


def gemv_config_name(cfg: dict) -> str:
    if cfg["kernel"] == "mma":
        cap = f" r{cfg['maxnreg']}" if cfg.get("maxnreg") else ""
        return (f"mma w{cfg['num_warps']} n{cfg.get('BLOCK_N', 16 * cfg['num_warps'])} g{cfg.get('GPS', 1)} "
                f"s{cfg['STAGES']} k{cfg['SPLIT_K']}{cap}")
    return f"fma n{cfg['BLOCK_N']} b{cfg['BLOCK_W']} w{cfg['num_warps']} s{cfg['STAGES']} k{cfg['SPLIT_K']}"


@triton.jit
def _read_kernel(p, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + tl.program_id(0), tl.sum(tl.load(p + offs, mask=offs < n, other=0), axis=0))


def _read_floor_us(nbytes: int) -> float:
    """Per-call time of a plain Triton kernel that reads `nbytes` (rotated copies, like the weights) with
    16-byte loads and writes one int per program, replayed from a CUDA graph like the GEMVs: what a pure
    read of that size costs, launch included."""
    n = nbytes // 4
    bufs = [torch.randint(0, 100, (n,), dtype=torch.int32, device="cuda") for _ in range(common.n_copies(nbytes))]
    block = 2048
    out = torch.empty(triton.cdiv(n, block), dtype=torch.int32, device="cuda")
    return 1e3 * common.graph_ms(lambda b: _read_kernel[(triton.cdiv(n, block),)](b, out, n, BLOCK=block), [(b,) for b in bufs])


def _gemv_check(job: tuple) -> dict:
    """Worker: one (M, N, K, dtype name, config) call on fresh random data (compiling it on first use, into
    Triton's on-disk cache that the parent then reads) against an fp32 reference; max error relative to
    max |y| (fp16 outputs round at ~5e-4 of that, bf16 at ~4e-3)."""
    from csrc_triton.w4a16_gemv import w4a16_gemv

    M, N, K, dtype_name, cfg = job
    dtype = getattr(torch, dtype_name)
    try:
        gen = torch.Generator("cuda").manual_seed(N + K + M)
        w = torch.randn(N, K, generator=gen, device="cuda") * 0.02 + torch.rand(N, 1, generator=gen, device="cuda") * 0.01
        p = quantize_w4(w, GROUP, dtype=dtype)
        x = torch.randn(M, K, generator=gen, device="cuda").to(dtype)
        y = w4a16_gemv(x, p["qweight"], p["scales"], p["zeros"], config=cfg).float()
        ref = x.float() @ dequantize_w4(p["qweight"], p["scales"], p["zeros"], torch.float32).T
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        ok = err < (4e-3 if dtype == torch.float16 else 2e-2)
        return {"ok": ok, "err": err, "error": ""}
    except Exception as e:  # reported, not fatal to the sweep
        return {"ok": False, "err": float("nan"), "error": str(e).strip().splitlines()[-1][:160]}
    finally:
        torch.cuda.empty_cache()  # idle workers keep only their CUDA context while the parent times


def _pool(workers: int = 12):
    """Worker processes for _gemv_check: Triton compiles each process's variants in parallel (16 CPU cores
    on the H200 machine) instead of one at a time in this process."""
    import concurrent.futures
    import multiprocessing

    return concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def _run_checks(jobs: list[tuple], pool=None) -> list[dict]:
    if pool is None:
        with _pool() as own:
            return list(own.map(_gemv_check, jobs))
    return list(pool.map(_gemv_check, jobs))


def _precompile(ms: list[int], tiles: list[tuple[int, ...]], pool) -> None:
    """Every compiled variant the sweep will time (one call per tile, split = 1 and split > 1), compiled and
    checked in parallel; failures are printed (the timing loop reports them again)."""
    jobs, seen = [], set()
    for _, K, N in SHAPES:
        for M in ms:
            for cfg in gemv_sweep_configs(N, K, M, tiles):
                key = (M, tuple(sorted((k, v) for k, v in cfg.items() if k != "SPLIT_K")), cfg["SPLIT_K"] > 1)
                if key not in seen:
                    seen.add(key)
                    jobs.append((M, N, K, "float16", cfg))
    for job, r in zip(jobs, _run_checks(jobs, pool)):
        if not r["ok"]:
            why = r["error"] or f"rel err {r['err']:.2g}"
            print(f"  precompile {gemv_config_name(job[4])} M={job[0]} N={job[1]} K={job[2]}: {why}", flush=True)
    print(f"precompiled {len(jobs)} variants", flush=True)


def _gemv_shape_rows(name: str, M: int, N: int, K: int, sets: list[tuple], floor_us: float,
                     tiles: list[tuple[int, ...]]) -> list[dict]:
    """Times every sweep config at one (shape, M), replayed from a CUDA graph, next to fp16 cuBLAS (also
    replayed); checks each output first. Prints a line per config."""
    from csrc_triton.w4a16_gemv import w4a16_gemv

    xs = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _ in sets]
    w4_in = [(x, q, s, z) for x, (_, q, s, z) in zip(xs, sets)]
    t_fp = 1e3 * common.graph_ms(F.linear, [(x, w) for x, (w, _, _, _) in zip(xs, sets)])
    nbytes = _w4_bytes(N, K) + 2 * M * (K + N)
    copy_gbs = common.copy_bandwidth_gbs()
    x0, q0, s0, z0 = w4_in[0]
    exact = x0.float() @ dequantize_w4(q0, s0, z0, torch.float32).T  # (M, N)
    rows = []
    for cfg in gemv_sweep_configs(N, K, M, tiles):
        try:  # a config that fails to compile or launch is reported, not fatal to the sweep
            y = w4a16_gemv(x0, q0, s0, z0, config=cfg)
            err = ((y.float() - exact).abs().max() / exact.abs().max()).item()
            t = 1e3 * common.graph_ms(lambda x, q, s, z, c=cfg: w4a16_gemv(x, q, s, z, config=c), w4_in)
        except Exception as e:
            print(f"  {name:<8} M={M} {gemv_config_name(cfg):<26} FAILED: {str(e).strip().splitlines()[-1][:120]}",
                  flush=True)
            continue
        gbs = nbytes / t / 1e3
        ok = err < 4e-3
        rows.append({"layer": name, "M": M, "config": gemv_config_name(cfg), "us": t, "GBs": gbs,
                     "copy_frac": gbs / copy_gbs, "vs_cublas": t_fp / t, "cublas_us": t_fp, "ok": ok, "_cfg": cfg})
        print(f"  {name:<8} M={M} {gemv_config_name(cfg):<26} {t:7.2f} us {gbs:6.0f} GB/s {100 * gbs / copy_gbs:5.1f}% "
              f"of copy  x{t_fp / t:5.2f} cuBLAS ({t_fp:.1f} us)  floor {floor_us:.2f} us"
              f"{'' if ok else f'  WRONG (rel err {err:.2g})'}", flush=True)
    return rows


def _verify_table(table: dict, pool=None) -> list[dict]:
    """The launcher's configs with `table` in place, at every shape, fp16 and bf16, M = 1, 2, 4, 8 (checked in
    worker processes: the bf16 and M > 1 variants compile there in parallel). Returns the failures."""
    from csrc_triton import w4a16_gemv as gemv_mod

    with mock.patch.dict(gemv_mod.GEMV_TABLE, table):  # the launcher's own pick, with the new table in place
        jobs = [(M, N, K, dt, gemv_mod.gemv_config(M, N, K, GROUP)) for _, K, N in SHAPES for M in (1, 2, 4, 8)
                for dt in ("float16", "bfloat16")]
    bad = []
    for job, r in zip(jobs, _run_checks(jobs, pool)):
        if not r["ok"]:
            bad.append({"M": job[0], "N": job[1], "K": job[2], "dtype": job[3], "config": gemv_config_name(job[4]),
                        "err": r["err"], "error": r["error"]})
    print(f"verified the table's configs: {len(jobs) - len(bad)}/{len(jobs)} calls correct", flush=True)
    for b in bad:
        print(f"  WRONG {b}", flush=True)
    return bad


def _write_table(table: dict, path: str | None = None) -> str:
    """The GEMV_TABLE literal for csrc_triton/w4a16_gemv.py; also written to `path` if given."""
    lines = ["GEMV_TABLE: dict[tuple[int, int, int], dict] = {  # H200 sweep (graph-replayed), fp16, group 128"]
    lines += [f"    {key}: {cfg},  # {gemv_config_name(cfg)}" for key, cfg in sorted(table.items())]
    text = "\n".join(lines + ["}"]) + "\n"
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


def gemv_sweep(ms: list[int], tiles: list[tuple[int, ...]], table_out: str | None = None) -> list[dict]:
    """Per Llama-3-8B shape and M: every GEMV sweep config's per-call time replayed from a CUDA graph, GB/s,
    share of the measured copy bandwidth and speed-up over fp16 cuBLAS (a line each, as it goes), the read
    floor of the same bytes; then the GEMV_TABLE literal (fastest correct config per (BLOCK_M, N, K)) for
    csrc_triton/w4a16_gemv.py (also written to `table_out`), a check of that table at fp16/bf16 and M = 1..8,
    and one summary row per (shape, M): launcher default vs best."""
    import time

    t0 = time.perf_counter()
    print(f"copy bandwidth {common.copy_bandwidth_gbs():.0f} GB/s", flush=True)
    pool = _pool()
    _precompile(ms, tiles, pool)
    print(f"[{time.perf_counter() - t0:.0f} s] timing", flush=True)
    summaries, table = [], {}
    for name, K, N in sorted(SHAPES, key=lambda s: -s[1] * s[2]):  # largest first: most of a decode step
        sets = _weights(N, K, common.n_copies(_w4_bytes(N, K)))
        floor_us = _read_floor_us(_w4_bytes(N, K))
        for M in ms:
            rows = _gemv_shape_rows(name, M, N, K, sets, floor_us, tiles)
            good = [r for r in rows if r["ok"]]
            best = min(good, key=lambda r: r["us"]) if good else None
            default = rows[0] if rows else None  # gemv_sweep_configs puts the launcher's pick first
            if best is not None:
                table[(1 << (M - 1).bit_length(), N, K)] = best["_cfg"]
                _write_table(table, table_out)  # after every shape: a sweep cut short still leaves its table
            summaries.append({"layer": name, "M": M, "N": N, "K": K, "read_floor_us": floor_us,
                              "cublas_us": best["cublas_us"] if best else None,
                              "default": default["config"] if default else None,
                              "default_us": default["us"] if default else None,
                              "best": best["config"] if best else None, "best_us": best["us"] if best else None,
                              "best_GBs": best["GBs"] if best else None,
                              "copy_frac": best["copy_frac"] if best else None,
                              "vs_cublas": best["vs_cublas"] if best else None,
                              "wrong": sum(not r["ok"] for r in rows)})
        del sets
        torch.cuda.empty_cache()
    print("\n" + _write_table(table, table_out), flush=True)
    print(f"[{time.perf_counter() - t0:.0f} s] verifying", flush=True)
    _verify_table(table, pool)
    pool.shutdown()
    print(f"[{time.perf_counter() - t0:.0f} s] done", flush=True)
    for M in ms:  # per-layer sum of the four GEMVs at the best configs (x32 layers: one decode step's GEMVs)
        rs = [r for r in summaries if r["M"] == M and r["best_us"] is not None]
        summaries.append({"layer": "layer sum", "M": M, "read_floor_us": sum(r["read_floor_us"] for r in rs),
                          "cublas_us": sum(r["cublas_us"] for r in rs), "default_us": sum(r["default_us"] for r in rs),
                          "best_us": sum(r["best_us"] for r in rs)})
    return summaries


# -- PDL sweep: --w4-pdl-sweep --------------------------------------------------------------------------------


def pdl_sweep() -> list[dict]:
    """Per Llama-3-8B shape, M = 1, the launcher's config, PDL off and on: us per GEMV back to back, and per
    (add+RMSNorm -> GEMV) pair as in a decode step, both graph-replayed; each output checked."""
    from csrc_triton import w4a16_gemv as gemv_mod
    from csrc_triton.add_rms_norm import add_rms_norm

    print(f"copy bandwidth {common.copy_bandwidth_gbs():.0f} GB/s", flush=True)
    rows = []
    for name, K, N in SHAPES:
        sets = _weights(N, K, common.n_copies(_w4_bytes(N, K)))
        xs = [torch.randn(1, K, device="cuda", dtype=torch.float16) for _ in sets]
        res = [torch.randn(1, K, device="cuda", dtype=torch.float16) for _ in sets]
        wn = torch.randn(K, device="cuda", dtype=torch.float16)
        gemv_in = [(x, q, s, z) for x, (_, q, s, z) in zip(xs, sets)]
        pair_in = [(x, r, q, s, z) for x, r, (_, q, s, z) in zip(xs, res, sets)]
        floor_us = _read_floor_us(_w4_bytes(N, K))
        x0, q0, s0, z0 = gemv_in[0]
        exact = x0.float() @ dequantize_w4(q0, s0, z0, torch.float32).T

        for pdl in (False, True):
            def norm(x, r, q, s, z, wn=wn, pdl=pdl):
                return add_rms_norm(x, r, wn, 1e-5, pdl=pdl)

            def gemv(x, q, s, z, pdl=pdl):
                return gemv_mod.w4a16_gemv(x, q, s, z, pdl=pdl)

            def pair(x, r, q, s, z, wn=wn, pdl=pdl):
                return gemv(add_rms_norm(x, r, wn, 1e-5, pdl=pdl)[0], q, s, z)

            norm_us = 1e3 * common.graph_ms(norm, pair_in)
            y = gemv(x0, q0, s0, z0)
            err = ((y.float() - exact).abs().max() / exact.abs().max()).item()
            t = 1e3 * common.graph_ms(gemv, gemv_in)
            tp = 1e3 * common.graph_ms(pair, pair_in)
            gbs = (_w4_bytes(N, K) + 2 * (K + N)) / t / 1e3
            row = {"layer": name, "N": N, "K": K, "pdl": int(pdl), "gemv_us": t, "GBs": gbs,
                   "copy_frac": gbs / common.copy_bandwidth_gbs(), "pair_us": tp, "norm_us": norm_us,
                   "floor_us": floor_us, "ok": err < 4e-3}
            rows.append(row)
            print(f"  {name:<8} pdl {int(pdl)}: gemv {t:6.2f} us ({gbs:5.0f} GB/s, {row['copy_frac']:.2f} of copy)  "
                  f"norm+gemv {tp:6.2f} us (norm alone {norm_us:.2f})  floor {floor_us:.2f}"
                  f"{'' if row['ok'] else f'  WRONG {err:.2g}'}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows
