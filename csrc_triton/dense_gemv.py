"""Dense fp16/bf16 GEMV for decode: y (M, N) = x (M, K) @ W^T, M <= 8, W (N, K) with unit stride along K.

Used for the LLM's output layer (lm_head, or the tied embedding matrix): at Llama-3-8B shapes it reads 1.05 GB per
token, the largest single read of a W4A16 decode step (why not cuBLAS: docs/perf_notes.md).

Each program owns BLOCK_N rows of W and walks K in BLOCK_K steps: the W tile (BLOCK_N, BLOCK_K) is the
register operand A of the tensor cores' mma, x^T (BLOCK_K, 16) zero-padded past M the operand B, an fp32
accumulator (BLOCK_N, 16); Triton stages both through shared memory with cp.async (STAGES deep), so the
only per-weight work is the staged load, and the multiply-adds go to the otherwise idle tensor cores.
No split-K: N / BLOCK_N programs (~1000-2000 for a vocabulary) already fill the GPU many times over. No autotuning
and no allocation beyond y, so a call can be captured in a CUDA graph. Reduction order along K differs from
cuBLAS: results agree to fp32-accumulation rounding, not bit for bit.
"""

from __future__ import annotations

import torch

from . import pdl
from ._common import INTERPRET
from ._triton import tl, triton
from .pdl import options as pdl_options

MAX_M = 8
BLOCK_M = 16  # tl.dot's smallest N; rows >= M are zero padding
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the H200 choice (scripts/benches/dense_gemv.py sweep), else
# a middle-of-the-road tile.
CONFIG = (64, 256, 4, 4)


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] for the BLOCK_N rows of this program, all m < M."""
    pdl.enter(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # (BLOCK_K, BLOCK_M): x transposed
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:  # the CPU interpreter's 16-bit dots are wrong: exact fp32 products instead
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.trans(acc)  # (BLOCK_M, BLOCK_N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"dense_gemv: x must be (M, K) and weight (N, K), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"dense_gemv: x has K = {x.shape[1]} but weight has K = {weight.shape[1]}")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"dense_gemv: M = {x.shape[0]} rows, this kernel takes 1..{MAX_M} (use F.linear)")
    if x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dense_gemv: x and weight must share fp16 or bf16, got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("dense_gemv: x and weight need unit stride along K")


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
               config: tuple[int, int, int, int] | None = None, *, pdl: bool = True) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N) in x's dtype; `out` (M, N) receives it when given.
    config = (BLOCK_N, BLOCK_K, num_warps, num_stages) overrides CONFIG (the benchmark's sweep).
    pdl: programmatic dependent launch where the device has it (csrc_triton/pdl.py)."""
    _check(x, weight)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype) if out is None else out
    block_n, block_k, warps, stages = config or CONFIG
    _dense_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=N % block_n == 0, EVEN_K=K % block_k == 0,
        UPCAST=INTERPRET, num_warps=warps, num_stages=stages, **pdl_options(x.device, pdl))
    return out


def dense_gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference: fp32 products and sums, rounded once to x's dtype."""
    return (x.float() @ weight.float().t()).to(x.dtype)
