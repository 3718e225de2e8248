"""W4A16 GEMV for decode: y (M, N) = x (M, K) @ W^T + bias, M <= 8, W packed as in tinyvila/quant.py.

Layouts: x (M, K) fp16/bf16 with unit stride along K; qweight int32 (N, K/8), nibble i of word j of
row n is q[n, 8j + i]; scales (N, K/G) in x's dtype; zeros fp32 (N, K/G); w = q * s + b. G in {32, 64, 128}.
Math: per packed word (8 consecutive k, one group) sum_i x_i (q_i s + b) = s * sum_i q_i x_i + b * sum_i x_i,
so each value costs one nibble extraction and one FMA, in fp32, with no rounding of w to 16 bits.
A program owns BLOCK_N output rows and streams their packed words along K in BLOCK_W-word tiles
(16-byte loads along contiguous rows); partial products stay in a (BLOCK_M, BLOCK_N, BLOCK_W) fp32
register tile and are reduced once at the end. Memory-bound: the goal is the HBM floor of the packed bytes.
Limits: M <= 8 (larger M: w4a16_gemm), K % G == 0. Autotuned on CUDA; one fixed config under TRITON_INTERPRET.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_SIZES = (32, 64, 128)
MAX_M = 8
_MAGIC = tl.constexpr(0x4B000000)  # fp32 bit pattern of 2**23: OR-ing an integer < 2**23 into it gives 2**23 + that integer


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                       G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    m_mask, n_mask = offs_m < M, offs_n < N
    K8, NG = K // 8, K // G
    rows = offs_n.to(tl.int64)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), dtype=tl.float32)
    for w0 in range(0, K8, BLOCK_W):
        cols = w0 + offs_w  # packed-word index along K
        w_mask = n_mask[:, None] & (cols < K8)[None, :]
        words = tl.load(qw_ptr + rows * K8 + cols[None, :], mask=w_mask, other=0)  # (BN, BW) int32
        # One scale and zero per word (a word never straddles a group); repeated addresses hit L1.
        meta = rows * NG + (cols // (G // 8))[None, :]
        s = tl.load(s_ptr + meta, mask=w_mask, other=0).to(tl.float32)
        b = tl.load(z_ptr + meta, mask=w_mask, other=0.0)
        x_mask = m_mask[:, None] & (cols < K8)[None, :]
        x_base = x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * 8  # (BM, BW): x[m, 8 * col]
        hi = words >> 16  # nibbles 4..7 moved to bits 0..15 with one shift per word
        dot = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), dtype=tl.float32)
        xsum = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_base + i, mask=x_mask, other=0.0).to(tl.float32)  # (BM, BW)
            xsum += xi
            # Nibble i sits at bits 4e..4e+3 of `src`; masking it in place and OR-ing in the 2**23
            # exponent gives the exact float 2**23 + q * 16**e with no int->float conversion (a
            # quarter-rate instruction); the 16**e factor moves onto x, an exact power-of-two scaling.
            if i < 4:
                src = words
                e = i
            else:
                src = hi
                e = i - 4
            f = ((src & (0xF << (4 * e))) | _MAGIC).to(tl.float32, bitcast=True) - 8388608.0
            dot += f[None, :, :] * (xi * (1.0 / (1 << (4 * e))))[:, None, :]
        acc += s[None, :, :] * dot + b[None, :, :] * xsum[:, None, :]
    out = tl.sum(acc, axis=2)  # (BM, BN)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _cfg(bn: int, bw: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": bn, "BLOCK_W": bw}, num_warps=warps, num_stages=stages)


# H200 decode shapes (N >= 4096): small BLOCK_N gives 256-512 programs on 132 SMs, and BLOCK_W of
# 64-256 words gives 256 B-1 KB contiguous per row per tile, pipelined 2-4 deep to keep HBM busy.
CONFIGS = [
    _cfg(8, 128, 4, 3), _cfg(8, 256, 4, 2),
    _cfg(16, 64, 4, 4), _cfg(16, 128, 4, 3), _cfg(16, 128, 8, 3), _cfg(16, 256, 8, 2),
    _cfg(32, 64, 4, 4), _cfg(32, 128, 8, 3),
    _cfg(64, 32, 4, 4), _cfg(64, 64, 8, 3),
]
INTERPRET_CONFIG = {"BLOCK_N": 16, "BLOCK_W": 16, "num_warps": 4}


def _prune(configs, named_args, **kwargs):
    """Drop tiles whose fp32 partial products would exceed ~64 registers per thread at this BLOCK_M."""
    bm = kwargs["BLOCK_M"]
    keep = [c for c in configs if bm * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_W"] <= 64 * 32 * c.num_warps]
    return keep or configs[:1]


_w4a16_gemv_tuned = triton.autotune(CONFIGS, key=["N", "K", "G", "BLOCK_M", "HAS_BIAS"],
                                    prune_configs_by={"early_config_prune": _prune})(_w4a16_gemv_kernel)


def check_w4_args(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Validates a W4A16 call; returns (M, N, K, G). Shared by the GEMV and GEMM launchers."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be a 2-D float16/bfloat16 tensor, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride along K; call .contiguous() first")
    M, K = x.shape
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[1] * 8 != K:
        raise ValueError(f"qweight must be int32 (N, K/8) = (N, {K // 8}), got {tuple(qweight.shape)} {qweight.dtype}")
    N = qweight.shape[0]
    if scales.dim() != 2 or scales.shape[0] != N or scales.shape[1] == 0 or K % scales.shape[1]:
        raise ValueError(f"scales must be (N, K/G) with N={N}, K={K}, got {tuple(scales.shape)}")
    G = K // scales.shape[1]
    if G not in GROUP_SIZES:
        raise ValueError(f"group size {G} (K={K} / {scales.shape[1]} groups) not supported; use one of {GROUP_SIZES}")
    if scales.dtype != x.dtype:
        raise ValueError(f"scales dtype {scales.dtype} must equal the activation dtype {x.dtype}")
    if zeros.dtype != torch.float32 or zeros.shape != scales.shape:
        raise ValueError(f"zeros must be float32 {tuple(scales.shape)}, got {tuple(zeros.shape)} {zeros.dtype}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be ({N},) {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    tensors = [x, qweight, scales, zeros] + ([bias] if bias is not None else [])
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, qweight, scales, zeros and bias must be on one device")
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("qweight, scales and zeros must be contiguous")
    return M, N, K, G


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """(M, K) x packed (N, K) W4 -> (M, N) in x's dtype, M <= 8. `config` pins a tile (else autotuned on CUDA)."""
    M, N, K, G = check_w4_args(x, qweight, scales, zeros, bias)
    if M > MAX_M:
        raise ValueError(f"w4a16_gemv takes at most {MAX_M} rows, got {M}; use w4a16_gemm")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be ({M}, {N}) {x.dtype} with unit stride along N")
    args = (x, qweight, scales, zeros, bias if bias is not None else scales, out, M, N, K, x.stride(0), out.stride(0))
    meta = dict(G=G, BLOCK_M=triton.next_power_of_2(M), HAS_BIAS=bias is not None)
    if config is None and x.is_cuda:
        _w4a16_gemv_tuned[lambda c: (triton.cdiv(N, c["BLOCK_N"]),)](*args, **meta)
    else:
        config = config or INTERPRET_CONFIG
        _w4a16_gemv_kernel[(triton.cdiv(N, config["BLOCK_N"]),)](*args, **meta, **config)
    return out


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Packed W4 -> dense (N, K) fp32 weight, w = q * s + b in fp32 (tinyvila.quant.dequantize_w4's math)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight[..., None] >> shifts) & 0xF).reshape(qweight.shape[0], -1).float()  # (N, K)
    G = q.shape[1] // scales.shape[1]
    return q * scales.float().repeat_interleave(G, dim=1) + zeros.float().repeat_interleave(G, dim=1)


def w4a16_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: dequantize (rounded to x's dtype, as a dense checkpoint would hold it) -> fp32 matmul -> cast."""
    w = dequantize_ref(qweight, scales, zeros).to(x.dtype).float()
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
