"""One profiled call each of the W8A8 GEMMs at the SigLIP-so400m encoder's shapes, in several kernel forms side by
side, for Nsight Compute's counters (issue 4: session 14 asked why the first Gluon kernel won on wo / fc2 and lost on
qkv / fc1; session 15 why the ping-pong form wins at K = 1152 and loses on fc2 at K = 4304; docs/perf_notes.md).

    ncu --clock-control none --profile-from-start off --set full -o w8a8_gemm \\
        python scripts/diag/ncu_w8a8_gemm.py [--images 64] [--forms triton,v2,pingpong,rows] [--gemms qkv,fc2]
    ncu -i w8a8_gemm.ncu-rep --page raw --csv > w8a8_gemm.csv      # then the tensor-pipe, issue and stall columns

Forms: triton (the Triton kernel at the launcher's config), v2 (the Gluon kernel's 128 x 256 column-halves form),
rows (its 256 x 128 row-halves form), pingpong (its warp-specialised form). Needs an sm_90 GPU with Triton 3.6;
prints "ok" when done.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import csrc_triton.w8a8_gemm as wg  # noqa: E402
from benches import common  # noqa: E402
from csrc_triton.w8a8_gemm_wgmma import w8a8_gemm_wgmma  # noqa: E402

SHAPES = {"qkv": (3456, 1152, False), "wo": (1152, 1152, True), "fc1": (4304, 1152, False), "fc2": (1152, 4304, True)}
FORMS = {"v2": {"tile": (128, 256, 128, 8, 3)}, "rows": {"tile": (256, 128, 128, 8, 3)}, "pingpong": {"pingpong": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--forms", default="triton,v2")
    ap.add_argument("--gemms", default=",".join(SHAPES))
    args = ap.parse_args()
    M = args.images * 729
    calls = []
    for name in args.gemms.split(","):
        N, K, res = SHAPES[name]
        a = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
        b = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
        sa, sb = torch.rand(M, device="cuda") * 0.02, torch.rand(N, device="cuda") * 1e-3
        bias = torch.randn(N, device="cuda", dtype=torch.float16)
        r = torch.randn(M, N, device="cuda", dtype=torch.float16) if res else None
        for form in args.forms.split(","):
            if form == "triton":
                def call(a=a, b=b, sa=sa, sb=sb, bias=bias, r=r):
                    with wg.triton_kernels_only():
                        return wg.w8a8_gemm(a, b, sa, sb, bias, residual=r)
            else:
                def call(a=a, b=b, sa=sa, sb=sb, bias=bias, r=r, kw=FORMS[form]):
                    return w8a8_gemm_wgmma(a, b, sa, sb, bias, residual=r, **kw)
            calls.append(call)
    common.profiled_calls(calls)  # compiled and warmed up outside the profiled range
    print("ok")


if __name__ == "__main__":
    main()
