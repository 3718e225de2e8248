"""W4A16 GEMV (decode) and GEMM (prefill) against fp16 cuBLAS at Llama-3-8B layer shapes (group 128).

    PYTHONPATH=. python scripts/bench_kernels.py --only w4a16 [--quick]

Times are device times: a GPU spin is queued before each timed call so the CPU launch cost (Python
checks, the autotuner's dispatch; hidden by CUDA graphs in decode) is not counted, for both sides alike.
GEMV rows (M = 1, 4, 8): time, GB/s counting packed weights + scales + zeros + x + y, the fraction of the
measured device-copy bandwidth, the speed-up over F.linear on the fp16 weight. GEMM rows: TFLOP/s and the
ratio to cuBLAS, per path ("dequant": w4a16_dequant + cuBLAS, the default from DEQUANT_MIN_M rows;
"fused": the dequantizing Triton GEMM). Issue 3 targets: GEMV at M=1 >= 3.0x cuBLAS and >= 70% of copy
bandwidth; GEMM at M=2048 >= 0.8x cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benches import common
from csrc_triton.w4a16_gemm import w4a16_gemm
from tinyvila import ops
from tinyvila.quant import quantize_w4

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
    return {"layer": name, "kernel": "gemv" if gemv else f"gemm:{path}", "M": M, "N": N, "K": K,
            "w4_us": 1e3 * t_w4, "cublas_us": 1e3 * t_fp, "speedup": t_fp / t_w4,
            "w4_GBs": w4_gbs if gemv else None,
            "copy_frac": w4_gbs / common.copy_bandwidth_gbs() if gemv else None,
            "cublas_GBs": (2 * N * K + 2 * M * (K + N)) / t_fp / 1e6 if gemv else None,
            "w4_TFLOPs": None if gemv else 2 * M * N * K / t_w4 / 1e9,
            "cublas_TFLOPs": None if gemv else 2 * M * N * K / t_fp / 1e9}


def run(args) -> list[dict]:
    quick = getattr(args, "quick", False)
    gemv_ms = [1] if quick else [1, 4, 8]
    gemm_cases = [(2048, "dequant")] if quick else [(128, "fused"), (512, "fused"), (512, "dequant"),
                                                    (2048, "dequant"), (2048, "fused")]
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
