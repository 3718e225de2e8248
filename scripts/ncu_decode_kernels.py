"""One profiled call each of the decode step's hot kernels, for Nsight Compute's hardware counters.

    ncu --clock-control none --profile-from-start off --set full -o decode_kernels \
        python scripts/ncu_decode_kernels.py
    ncu -i decode_kernels.ncu-rep --page raw --csv        # stall reasons, issue activity, occupancy
    ncu -i decode_kernels.ncu-rep --page source --csv --print-source sass   # per-instruction counts

Kernels (each warmed up first; only the calls between cudaProfilerStart/Stop are profiled): the four W4A16
decode GEMVs at Llama-3-8B shapes (M=1, g128) with cuBLAS's fp16 GEMV of the same shape beside each, the
decoding attention over an 8K packed buffer (32 query / 8 KV heads, D 128), the prefill-salience passes at
N=16384 (H 16, D 80), and a 64 MiB device copy. Run S5-A (docs/perf_notes.md, session 5) used this code.
Needs CUDA; prints "ok" when done.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benches import common  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("ncu_decode_kernels.py needs a CUDA GPU")
    from csrc_triton.decode_attention import decode_attention
    from csrc_triton.prefill_salience import prefill_salience
    from tinyvila import ops
    from tinyvila.quant import quantize_w4

    torch.manual_seed(0)
    calls = []
    for K, N in [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]:  # qkv, o, gate_up, down
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        p = quantize_w4(w, 128, dtype=torch.float16)
        x = torch.randn(1, K, device="cuda", dtype=torch.float16)
        calls.append(lambda x=x, p=p: ops.w4a16_linear(x, p["qweight"], p["scales"], p["zeros"]))
        calls.append(lambda x=x, w=w: torch.nn.functional.linear(x, w))
    L = 8192
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    lens = torch.tensor([L], device="cuda", dtype=torch.int32)
    calls.append(lambda: decode_attention(q, k, v, lens))
    qs = torch.randn(1, 16, 16384, 80, device="cuda", dtype=torch.float16)
    ks = torch.randn_like(qs)
    calls.append(lambda: prefill_salience(qs, ks))
    src = torch.empty(64 << 20, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    calls.append(lambda: dst.copy_(src))
    common.profiled_calls(calls, warmups=3)
    print("ok")


if __name__ == "__main__":
    main()
