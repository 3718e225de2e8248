"""The gate/up W4 GEMV plain vs with its SwiGLU epilogue, alone and as the (gate/up, down) pair a decode step runs,
CUDA-graph replayed, with PDL on at each trigger point (csrc_triton/w4a16_gemv.py TRIGGER / SILU_TRIGGER) and off.

    PYTHONPATH=. python scripts/gemv_pdl_pair.py

Llama-3-8B shapes (gate/up 28672 x 4096, down 4096 x 14336), M = 1, fp16, synthetic weights. Prints one line per
(PDL, trigger, case): microseconds per call. Session 6 ran this code as tmp_gpu/silu_micro.py (runs S6-C, S6-D;
docs/perf_notes.md): with the SwiGLU epilogue the pair took 46.0 us when the GEMV let the next kernel start at
once, 40.2 after its K loop, 40.9 with a separate SiLU launch.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests" / "kernels")]

import torch  # noqa: E402
from _w4_check import make  # noqa: E402
from benches import common  # noqa: E402

import csrc_triton.w4a16_gemv as g  # noqa: E402
from csrc_triton.silu_mul import silu_mul  # noqa: E402


def main() -> None:
    M = 1
    a = make(M, 28672, 4096, 128, torch.float16, seed=1, device="cuda")
    d = make(M, 4096, 14336, 128, torch.float16, seed=2, device="cuda")
    args = (a["qweight"], a["scales"], a["zeros"])
    down = (d["qweight"], d["scales"], d["zeros"])
    pn = (torch.rand(64, 8, device="cuda") * 50, 1e-5)
    xs = [(torch.randn(M, 4096, device="cuda", dtype=torch.float16),) for _ in range(4)]
    rows = {
        "plain": lambda x: g.w4a16_gemv(x, *args),
        "plain+silu_mul": lambda x: silu_mul(g.w4a16_gemv(x, *args)),
        "silu": lambda x: g.w4a16_gemv_silu(x, *args),
        "plain pn": lambda x: g.w4a16_gemv(x, *args, prenorm=pn),
        "silu pn": lambda x: g.w4a16_gemv_silu(x, *args, prenorm=pn),
        "pair plain": lambda x: g.w4a16_gemv(silu_mul(g.w4a16_gemv(x, *args)), *down),
        "pair silu": lambda x: g.w4a16_gemv(g.w4a16_gemv_silu(x, *args), *down),
    }
    for pdl, trig in (("1", 0), ("1", 1), ("1", 2), ("0", 0)):
        os.environ["TINYVILA_PDL"] = pdl
        g.pdl._ENABLED.clear()
        g.TRIGGER = g.SILU_TRIGGER = trig
        for name, fn in rows.items():
            us = 1e3 * common.graph_ms(fn, xs)
            print(f"pdl={pdl} trigger={trig} {name:16s} {us:8.2f} us", flush=True)


if __name__ == "__main__":
    main()
