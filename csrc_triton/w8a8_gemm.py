"""W8A8 GEMM: int8 activations x int8 weights, int32 accumulation, fused dequant epilogue.

    out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n] + bias[n]

a: (M, K) int8, row-major (per-token quantized activations); b: (N, K) int8, row-major (the
nn.Linear layout, per-output-channel quantized weights, read as the column-major (K, N) operand);
a_scale: (M,) fp32; b_scale: (N,) fp32; bias: (N,) any float dtype or None; out: (M, N) fp16/bf16/fp32.
The int32 accumulator is exact (|sum| <= K * 127 * 128 < 2**31 for K < 132000). The epilogue is fp32:
acc -> fp32, * a_scale, * b_scale, + bias (in that order, as the reference), one rounding to out dtype.
Limits: any M, N, K (masked tails); contiguous inner dims. Tiles are >= 32 in every dim (tl.dot needs 16;
int8 MMA wants K tiles of 32+); on sm_90 BLOCK_M=128 with 4/8 warps lets Triton pick wgmma (MMAv3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w8a8_gemm_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K,
                      stride_am, stride_bn, stride_cm,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    # Grouped program order: GROUP_M row-tiles share each column tile of b while it is in L2.
    pid = tl.program_id(0)
    n_pid_m = tl.cdiv(M, BLOCK_M)
    n_pid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_pid_n)
    first_m = group * GROUP_M
    size_m = min(n_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_pid_n)) % size_m
    pid_n = (pid % (GROUP_M * n_pid_n)) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Clamp row/col indices instead of masking the loads: out-of-range rows compute garbage that
    # the masked store drops, and the hot loop stays free of M/N masks.
    rm_c = tl.minimum(rm, M - 1)
    rn_c = tl.minimum(rn, N - 1)
    a_ptrs = a_ptr + rm_c[:, None] * stride_am + rk[None, :]  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + rn_c[None, :] * stride_bn + rk[:, None]  # (BLOCK_K, BLOCK_N): b^T tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    # Epilogue in fp32, in the reference's order.
    a_s = tl.load(a_scale_ptr + rm_c)
    b_s = tl.load(b_scale_ptr + rn_c)
    out = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn_c).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _config(M: int, N: int, K: int, device: torch.device) -> dict:
    """Tile shapes: small under the interpreter (it is slow), Hopper-sized on CUDA.

    Large M: 128x128 tiles with BLOCK_K=128 (int8: 32 KB of operands per stage, 3 stages fit in
    shared memory). Small M (decode, M <= 64): 64-row tiles waste less of the MMA.
    """
    if device.type != "cuda":
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    if M <= 1024:
        return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)


def w8a8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
              config: dict | None = None) -> torch.Tensor:
    """(M, K) int8 x (N, K) int8 -> (M, N) `out_dtype`, scaled per token and per channel (+ bias).

    `config` overrides the tile choice (benchmarks sweep it); see `_config` for the keys.
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"w8a8_gemm: a and b must be int8, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"w8a8_gemm: need a (M, K) and b (N, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[0]
    if a_scale.shape != (M,) or b_scale.shape != (N,):
        raise ValueError(f"w8a8_gemm: a_scale must be ({M},) and b_scale ({N},), got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise TypeError("w8a8_gemm: a_scale and b_scale must be float32")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"w8a8_gemm: bias must be ({N},), got {tuple(bias.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("w8a8_gemm: a and b need a contiguous last dim")
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    cfg = dict(config or _config(M, N, K, a.device))
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _w8a8_gemm_kernel[grid](
        a, b, a_scale.contiguous(), b_scale.contiguous(), bias if bias is not None else b_scale, c, M, N, K,
        a.stride(0), b.stride(0), c.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=K % cfg["BLOCK_K"] == 0, **cfg)
    return c


def w8a8_gemm_ref(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Plain PyTorch: exact int32 product (torch._int_mm on CPU, float64 elsewhere: both exact), then
    the kernel's fp32 epilogue. The CPU path of ops.w8a8_linear."""
    if a.device.type == "cpu":
        acc = torch._int_mm(a, b.t())  # (M, N) int32; the CPU build has no shape limits
    else:
        acc = (a.double() @ b.double().t()).to(torch.int32)  # exact below 2**53
    out = acc.float() * a_scale.float()[:, None] * b_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(out_dtype)
