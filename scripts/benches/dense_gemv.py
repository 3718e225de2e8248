"""Dense fp16 GEMV (the decode lm_head) against cuBLAS (F.linear) at the Llama-3-8B vocabulary shape.

    python -m scripts.bench_kernels --only dense_gemv [--quick]

Rows (M = 1 and 4, N = 128256, K = 4096, fp16): per-call device time replayed from a CUDA graph of 16
back-to-back calls (the decode step's situation; weights rotated past L2), GB/s counting W + x + y, the
fraction of the measured copy bandwidth, the speed-up over F.linear timed the same way. Every config
of SWEEP is timed at M = 1 (checked against F.linear first), so the chosen CONFIG is visible with its
competitors; --quick times only the default CONFIG.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from csrc_triton.dense_gemv import CONFIG, dense_gemv
from scripts.benches import common

N, K = 128256, 4096
SWEEP = [(64, 256, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 256, 8, 3), (32, 512, 4, 3),
         (64, 128, 4, 6), (128, 128, 8, 4), (64, 512, 8, 2)]


def run(args) -> list[dict]:
    quick = args.quick
    bw = common.copy_bandwidth_gbs()
    ws = [torch.randn(N, K, device="cuda", dtype=torch.float16) * K ** -0.5
          for _ in range(common.n_copies(2 * N * K))]
    rows = []
    for M in (1, 4):
        xs = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _ in ws]
        sets = list(zip(xs, ws))
        nbytes = 2 * (N * K + M * (K + N))
        t_ref = common.graph_ms(F.linear, sets)
        configs = [CONFIG] if quick or M > 1 else [CONFIG] + [c for c in SWEEP if c != CONFIG]
        for cfg in configs:
            x, w = sets[0]
            err = (dense_gemv(x, w, config=cfg).float() - F.linear(x, w).float()).abs().max().item()
            t = common.graph_ms(lambda x, w, cfg=cfg: dense_gemv(x, w, config=cfg), sets)
            gbs = nbytes / t / 1e6 if t else None
            rows.append({"case": "lm_head gemv", "M": M, "config": "n{}k{}w{}s{}".format(*cfg),
                         "default": cfg == CONFIG, "us": 1e3 * t if t else None, "cublas_us": 1e3 * t_ref,
                         "speedup": t_ref / t if t else None, "GB/s": gbs,
                         "of_copy_bw": gbs / bw if gbs else None, "max_err": err})
            print(rows[-1], flush=True)
    return rows
