"""One profiled call each of the W8A8 GEMMs at the SigLIP-so400m encoder's shapes (64 images), Triton kernel and Gluon
kernel side by side, for Nsight Compute's counters (issue 4: why the Gluon kernel wins on wo / fc2 and loses on qkv /
fc1, docs/perf_notes.md session 14).

    ncu --clock-control none --profile-from-start off --set full -o w8a8_gemm python scripts/diag/ncu_w8a8_gemm.py
    ncu -i w8a8_gemm.ncu-rep --page raw --csv > w8a8_gemm.csv      # then the tensor-pipe, issue and stall columns

Needs an sm_90 GPU with Triton 3.6; prints "ok" when done.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import csrc_triton.w8a8_gemm as wg  # noqa: E402
from csrc_triton.w8a8_gemm_wgmma import w8a8_gemm_wgmma  # noqa: E402

SHAPES = (("qkv", 3456, 1152, False), ("wo", 1152, 1152, True), ("fc1", 4304, 1152, False), ("fc2", 1152, 4304, True))


def main() -> None:
    M = 64 * 729
    calls = []
    for _name, N, K, res in SHAPES:
        a = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
        b = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
        sa, sb = torch.rand(M, device="cuda") * 0.02, torch.rand(N, device="cuda") * 1e-3
        bias = torch.randn(N, device="cuda", dtype=torch.float16)
        r = torch.randn(M, N, device="cuda", dtype=torch.float16) if res else None

        def triton_call(a=a, b=b, sa=sa, sb=sb, bias=bias, r=r):
            with wg.triton_kernels_only():
                return wg.w8a8_gemm(a, b, sa, sb, bias, residual=r)
        calls += [triton_call, lambda a=a, b=b, sa=sa, sb=sb, bias=bias, r=r: w8a8_gemm_wgmma(a, b, sa, sb, bias, residual=r)]
    for f in calls:  # compile and warm up outside the profiled range
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for f in calls:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("ok")


if __name__ == "__main__":
    main()
