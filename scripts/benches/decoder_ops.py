"""Fused decoder ops against the unfused PyTorch sequences they replace, at Llama-3-8B shapes, fp16.

    python -m scripts.bench_kernels --only decoder_ops [--quick] [--decoder-ops-sweep]

--decoder-ops-sweep also times the launch variants (warps, heads per program, column block).

Ops (dim 4096, 32 heads, 8 KV heads, head dim 128, ffn 14336) at M = 1 (decode; KV cache of 1024
slots, writing slot 1000) and M = 300 (prefill; slots 0..299): add_rms_norm (residual add + RMSNorm)
vs `rms_norm(r + x)`; rope_qkv (RoPE of q and k + K/V cache write) vs split / transpose / two ropes /
two index_copy_; silu_mul vs F.silu(gate) * up. Times are per call from replays of one CUDA graph of
many calls, as the decode graph runs them (no host launch overhead; `*_eager_us` keep the eager
per-call time, launch latency included), cycling through input sets: 32 at M = 1 (one per layer, as
in a decode step, where every layer has its own norm weights and cache), enough to exceed L2 at
M = 300. GB/s counts the bytes the fused kernel must move (reads + writes), against the measured
device-copy bandwidth. `bit_equal`: the fraction of outputs equal to the PyTorch sequence's bit for
bit (rope_qkv and silu_mul are built to give 1.0; add_rms_norm's sum of squares runs in another
order). The "per step" row adds a decode step's 32 layers x (2 norms + rope + silu).
"""

from __future__ import annotations

import torch

from csrc_triton.add_rms_norm import add_rms_norm, add_rms_norm_ref
from csrc_triton.rope_qkv import rope_qkv, rope_qkv_ref
from csrc_triton.silu_mul import silu_mul, silu_mul_ref
from scripts.benches import common

DIM, H, HKV, D, FFN, LAYERS = 4096, 32, 8, 128, 14336, 32

S = 1024  # KV cache slots
EPS = 1e-5
DT = torch.float16
DEVICE = "cuda"


def graph_us(fn, sets: list) -> float | None:
    """us per call from CUDA-graph replays (common.graph_ms, 32 calls)."""
    ms = common.graph_ms(fn, sets, calls=32)
    return None if ms is None else 1000 * ms


def _n_sets(M: int, bytes_per_set: int) -> int:
    return LAYERS if M == 1 else common.n_copies(bytes_per_set)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def _tables(M: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEVICE, dtype=torch.float32) / D))
    ang = torch.arange(start, start + M, device=DEVICE).float()[:, None] * inv
    ang = torch.cat((ang, ang), dim=-1)  # (M, D)
    return ang.cos().to(DT), ang.sin().to(DT)


def norm_case(M: int):
    """add_rms_norm: x, residual (1, M, DIM), weight (DIM,)."""
    nbytes = 4 * M * DIM * 2 + DIM * 2
    sets = [(torch.randn(1, M, DIM, device=DEVICE, dtype=DT), torch.randn(1, M, DIM, device=DEVICE, dtype=DT) * 4,
             1 + 0.1 * torch.randn(DIM, device=DEVICE, dtype=DT)) for _ in range(_n_sets(M, nbytes))]
    fused = lambda x, r, w: add_rms_norm(x, r, w, EPS)  # noqa: E731
    unfused = lambda x, r, w: add_rms_norm_ref(x, r, w, EPS)  # noqa: E731
    eq = _bit_equal(fused(*sets[0])[0], unfused(*sets[0])[0])
    return fused, unfused, sets, nbytes, eq


def rope_case(M: int):
    """rope_qkv: qkv (1, M, (H + 2 HKV) D), cos/sin (M, D), caches (1, HKV, S, D), slots (M,) on the device."""
    start = 1000 if M == 1 else 0
    cos, sin = _tables(M, start)
    slots = torch.arange(start, start + M, device=DEVICE)
    nbytes = 2 * M * ((H + 2 * HKV) * D + 2 * D + H * D + 2 * HKV * D)
    sets = [(torch.randn(1, M, (H + 2 * HKV) * D, device=DEVICE, dtype=DT),
             torch.zeros(1, HKV, S, D, device=DEVICE, dtype=DT), torch.zeros(1, HKV, S, D, device=DEVICE, dtype=DT))
            for _ in range(_n_sets(M, nbytes))]
    fused = lambda qkv, kc, vc: rope_qkv(qkv, cos, sin, kc, vc, slots, H, HKV)  # noqa: E731
    unfused = lambda qkv, kc, vc: rope_qkv_ref(qkv, cos, sin, kc, vc, slots, H, HKV)  # noqa: E731
    qkv, kc, vc = sets[0]
    kc2, vc2 = kc.clone(), vc.clone()
    q, q_ref = fused(qkv, kc, vc), unfused(qkv, kc2, vc2)
    eq = min(_bit_equal(q, q_ref), _bit_equal(kc, kc2), _bit_equal(vc, vc2))
    return fused, unfused, sets, nbytes, eq


def silu_case(M: int):
    """silu_mul: gate_up (1, M, 2 FFN)."""
    nbytes = 3 * M * FFN * 2
    sets = [(torch.randn(1, M, 2 * FFN, device=DEVICE, dtype=DT) * 3,) for _ in range(_n_sets(M, nbytes))]
    eq = _bit_equal(silu_mul(*sets[0]), silu_mul_ref(*sets[0]))
    return silu_mul, silu_mul_ref, sets, nbytes, eq


CASES = {"add_rms_norm": norm_case, "rope_qkv": rope_case, "silu_mul": silu_case}


def op_row(name: str, M: int, iters: int) -> dict:
    fused, unfused, sets, nbytes, eq = CASES[name](M)
    f_us, t_us = graph_us(fused, sets), graph_us(unfused, sets)
    f_eager = 1000 * common.bench(fused, sets, iters=iters)
    t_eager = 1000 * common.bench(unfused, sets, iters=iters)
    f_us, t_us = f_us or f_eager, t_us or t_eager
    gbs = nbytes / f_us / 1e3
    return {"op": name, "M": M, "fused_us": f_us, "torch_us": t_us, "speedup": t_us / f_us, "GB/s": gbs,
            "of_copy": gbs / common.copy_bandwidth_gbs(), "bit_equal": eq,
            "fused_eager_us": f_eager, "torch_eager_us": t_eager}


def step_row(rows: list[dict]) -> dict:
    """A decode step's share: 32 layers x (2 add_rms_norm + rope_qkv + silu_mul), graph-replayed."""
    per = {r["op"]: r for r in rows if r["M"] == 1}
    weights = {"add_rms_norm": 2, "rope_qkv": 1, "silu_mul": 1}
    f = LAYERS * sum(k * per[op]["fused_us"] for op, k in weights.items())
    t = LAYERS * sum(k * per[op]["torch_us"] for op, k in weights.items())
    return {"op": f"per step ({LAYERS} layers)", "M": 1, "fused_us": f, "torch_us": t, "speedup": t / f}


def sweep_rows(M: int) -> list[dict]:
    """Launch variants of each kernel, graph-timed."""
    rows = []
    _, _, sets, _, _ = norm_case(M)
    for w in (1, 2, 4, 8, 16):
        us = graph_us(lambda x, r, wt, w=w: add_rms_norm(x, r, wt, EPS, num_warps=w), sets)
        rows.append({"op": "add_rms_norm", "M": M, "config": f"w{w}", "us": us})
    cos, sin = _tables(M, 0)
    slots = torch.arange(M, device=DEVICE)
    _, _, sets, _, _ = rope_case(M)
    for hp in (1, 2, 4, 8):
        for w in (1, 2, 4):
            fn = lambda qkv, kc, vc, hp=hp, w=w: rope_qkv(qkv, cos, sin, kc, vc, slots, H, HKV,  # noqa: E731
                                                          heads_per_program=hp, num_warps=w)
            rows.append({"op": "rope_qkv", "M": M, "config": f"h{hp}w{w}", "us": graph_us(fn, sets)})
    _, _, sets, _, _ = silu_case(M)
    for block in (128, 256, 512, 1024, 2048):
        for w in (2, 4, 8):
            fn = lambda gu, b=block, w=w: silu_mul(gu, block=b, num_warps=w)  # noqa: E731
            rows.append({"op": "silu_mul", "M": M, "config": f"b{block}w{w}", "us": graph_us(fn, sets)})
    return rows


def add_args(p) -> None:
    p.add_argument("--decoder-ops-sweep", action="store_true",
                   help="also time each op's launch variants (printed as a table of their own)")


def run(args) -> list[dict]:
    iters = 20 if args.quick else 50
    rows = [op_row(name, M, iters) for M in (1, 300) for name in CASES]
    rows.append(step_row(rows))
    if args.decoder_ops_sweep:
        common.emit("decoder_ops sweep", [r for M in (1, 300) for r in sweep_rows(M)])
    return rows
