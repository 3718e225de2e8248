"""Diagnostic (issue 32): the fused W4 GEMM's scale loads at follow-up and first-turn row counts, Llama-3-8B shapes.

A = the shipped kernel (the 2-byte fp16 scale is a plain load inside the K loop); C = the same kernel given fp32 scales
(a 4-byte load, which Triton's pipeline prefetches with cp.async like the zeros: the loop then waits on no global
load); B = scales read as halves of 4-byte words, only on the kernel of 7db3c88, where `PAIRS` was a kernel parameter.
Per (shape, M): each variant's time at the table's tiles, and at --sweep-m also over a tile sweep (B and C must be
bit-identical to A at the same tiles), dequantize + cuBLAS and fp16 cuBLAS; then x32-layer totals and one JSON line.
    PYTHONPATH=. python scripts/diag/w4_gemm_scales.py --ms 48,16,128,588 --sweep-m 48
    ncu --clock-control none --profile-from-start off --set full -o rep python scripts/diag/w4_gemm_scales.py --ncu
"""
import argparse
import json
import torch
import triton
from csrc_triton.w4a16_gemm import w4a16_gemm, Config, _w4a16_gemm_kernel, fit_config, pick_config, scratch, split_for, config_ok
from scripts.benches import common
from scripts.benches.w4a16 import SHAPES, _weights, _w4_bytes, SPIN_CYCLES

p = argparse.ArgumentParser()
p.add_argument("--ms", default="16,48,128")
p.add_argument("--sweep-m", default="48")
p.add_argument("--variants", default="A,B,C" if "PAIRS" in _w4a16_gemm_kernel.arg_names else "A,C")
p.add_argument("--ncu", action="store_true")
p.add_argument("--tag", default="v3")
args = p.parse_args()


def launch(x, q, s, z, cfg, pairs, out):
    M, K = x.shape
    N = q.shape[0]
    G = K // s.shape[1]
    cfg = fit_config(cfg, K, G)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), cfg.split_k)
    split = cfg.split_k > 1
    ws = scratch("w4_splitk", cfg.split_k * M * N if split else 1, torch.float32, x.device)
    cnt = scratch("w4_counters", grid[0] * grid[1] if split else 1, torch.int32, x.device, zero=True)
    _w4a16_gemm_kernel[grid](x, q, s, z, s, out, ws, cnt, M, N, K, x.stride(0), N, K // 8, K // G, cfg.split_k,
                             G=G, HAS_BIAS=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w,
                             UNPACK=1, UPCAST_DOT=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                             **({"PAIRS": pairs} if "PAIRS" in _w4a16_gemm_kernel.arg_names else {}))
    return out


def variant_args(v, q, s, z):
    if v == "C":
        return q, s.float(), z, False
    return q, s, z, v == "B"


def configs(M, N, K, n_sm=132):
    top = min(256, max(16, triton.next_power_of_2(M)))
    out = [pick_config(M, N, K, torch.device("cuda"))]
    for bm, bn, warps in [(top, 64, 4), (top, 128, 8)] + ([(top // 2, 128, 8)] if top >= 256 else []):
        for bw in (8, 16):
            for stages in (3, 4, 5):
                cfg = Config(bm, bn, bw, 1, warps, stages)
                if not config_ok(cfg):
                    continue
                n_k = K // (8 * bw)
                tiles = -(-M // bm) * -(-N // bn)
                sp = split_for(tiles, n_k, n_sm * (2 if bm <= 64 else 1))
                for s_ in sorted({max(1, sp // 2), sp, sp * 2, sp * 4}):
                    if n_k // s_ >= 2:
                        out.append(cfg._replace(split_k=s_))
    return list(dict.fromkeys(out))


ms = [int(v) for v in args.ms.split(",")]
sweep_ms = {int(v) for v in args.sweep_m.split(",") if v}
variants = args.variants.split(",")
totals = {}
for name, K, N in SHAPES:
    if args.ncu and name not in ("o", "gate_up"):
        continue
    sets = _weights(N, K, 2 if args.ncu else common.n_copies(_w4_bytes(N, K)))
    for M in ms:
        xs = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _ in sets]
        outs = [torch.empty(M, N, device="cuda", dtype=torch.float16) for _ in sets]
        cfgs = configs(M, N, K) if M in sweep_ms and not args.ncu else [pick_config(M, N, K, torch.device("cuda"))]
        if not args.ncu:
            w4_in = [(x, q, s, z) for x, (_, q, s, z) in zip(xs, sets)]
            t_deq = common.bench(lambda x, q, s, z: w4a16_gemm(x, q, s, z, path="dequant"), w4_in, iters=40,
                                 spin_cycles=SPIN_CYCLES)
            t_fp = common.bench(torch.nn.functional.linear, [(x, w) for x, (w, _, _, _) in zip(xs, sets)], iters=40,
                                spin_cycles=SPIN_CYCLES)
            totals[(name, M, "dequant")] = (1e3 * t_deq, "dequant", True)
            totals[(name, M, "fp16")] = (1e3 * t_fp, "cublas", True)
            print(f"{name:8} M={M:<4} dequant+cuBLAS {1e3 * t_deq:8.1f} us   fp16 cuBLAS {1e3 * t_fp:8.1f} us", flush=True)
        for cfg in cfgs:
            ref = None
            for v in variants:
                ins = [(x,) + variant_args(v, q, s, z) + (o,) for x, (_, q, s, z), o in zip(xs, sets, outs)]
                try:
                    y = launch(*ins[0][:4], cfg, ins[0][4], ins[0][5]).clone()
                except Exception as e:
                    print(f"{name} M={M} {cfg.name} {v} FAILED {str(e).splitlines()[0][:100]}", flush=True)
                    continue
                if ref is None:
                    ref = y
                same = torch.equal(y, ref)
                if args.ncu:
                    torch.cuda.synchronize()
                    torch.cuda.profiler.start()
                    launch(*ins[0][:4], cfg, ins[0][4], ins[0][5])
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                    print(f"ncu {name} M={M} {cfg.name} {v}", flush=True)
                    continue
                t = common.bench(lambda x, q, s, z, pr, o, c=cfg: launch(x, q, s, z, c, pr, o), ins, iters=40,
                                 spin_cycles=SPIN_CYCLES)
                print(f"{name:8} M={M:<4} {cfg.name:22} {v} {1e3 * t:8.1f} us {'' if same else 'DIFFERS'}", flush=True)
                key = (name, M, v)
                if same and (key not in totals or 1e3 * t < totals[key][0]):
                    totals[key] = (1e3 * t, cfg.name, cfg == cfgs[0])
                if cfg == cfgs[0]:
                    totals[(name, M, v, "table")] = (1e3 * t, cfg.name, True)
    del sets
    torch.cuda.empty_cache()
if not args.ncu:
    for M in ms:
        for v in variants + ["dequant", "fp16"]:
            best = sum(totals.get((n, M, v), (float("nan"),))[0] for n, _, _ in SHAPES)
            tab = sum(totals.get((n, M, v, "table"), (float("nan"),))[0] for n, _, _ in SHAPES)
            print(f"TOTAL x32 M={M} {v} [{args.tag}] table {32 * tab / 1e3:.2f} ms  best {32 * best / 1e3:.2f} ms  "
                  + " ".join(f"{n}:{totals.get((n, M, v), (0, '-'))[1]}" for n, _, _ in SHAPES), flush=True)
    print(json.dumps({"tag": args.tag, "rows": [{"shape": k[0], "M": k[1], "v": k[2], "table": len(k) > 3,
                                                 "us": t[0], "cfg": t[1]} for k, t in totals.items()]}))
