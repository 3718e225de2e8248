"""W4A16 GEMV for decode: y (M, N) = x (M, K) @ W^T + bias, M <= 8, W packed as in tinyvila/quant.py.

Layouts: x (M, K) fp16/bf16 with unit stride along K; qweight int32 (N, K/8), nibble i of word j of
row n is q[n, 8j + i]; scales (N, K/G) in x's dtype; zeros fp32 (N, K/G); w = q * s + b. G in {32, 64, 128}.
Math: per group, sum_k x_k (q_k s + b) = s * sum_k q_k x_k + b * sum_k x_k, all in fp32 (w is never
rounded to 16 bits). A program owns BLOCK_N rows and streams (BLOCK_N, BLOCK_W) int32 tiles along K
(16-byte cp.async loads, STAGES deep); nibbles are unpacked in registers, interleaved back into K order,
multiplied by x and reduced per group. Unpack: on the GPU one PTX block per word (shift, lop3 into fp16
1024 + q pairs, exact f16x2 subtract, cvt to fp32: ~1 integer op per weight); under the interpreter
(and with UNPACK=0) plain `(w >> 4i) & 0xF` -> fp32. Memory-bound: the goal is the HBM floor.
Limits: M <= 8 (larger M: w4a16_gemm), K % G == 0. Autotuned on CUDA; one fixed config under TRITON_INTERPRET.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

GROUP_SIZES = (32, 64, 128)
MAX_M = 8
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# 8 nibbles of one int32 word -> 8 exact fp32 values. Nibbles i and i+4 sit at bits 4i and 4i+16, so one
# shift and one lop3 ((w & 0x000F000F) | 0x64006400) give the fp16 pair (1024 + q_i, 1024 + q_{i+4});
# subtracting 1024 in f16x2 is exact, and cvt.f32.f16 widens exactly.
_UNPACK_ASM = tl.constexpr("""{
.reg .b32 t, p, m, c;
.reg .b16 lo, hi;
mov.b32 m, 0x000F000F;
mov.b32 c, 0x64006400;
lop3.b32 p, $8, m, c, 0xEA;
sub.f16x2 p, p, c;
mov.b32 {lo, hi}, p;
cvt.f32.f16 $0, lo;
cvt.f32.f16 $4, hi;
shr.u32 t, $8, 4;
lop3.b32 p, t, m, c, 0xEA;
sub.f16x2 p, p, c;
mov.b32 {lo, hi}, p;
cvt.f32.f16 $1, lo;
cvt.f32.f16 $5, hi;
shr.u32 t, $8, 8;
lop3.b32 p, t, m, c, 0xEA;
sub.f16x2 p, p, c;
mov.b32 {lo, hi}, p;
cvt.f32.f16 $2, lo;
cvt.f32.f16 $6, hi;
shr.u32 t, $8, 12;
lop3.b32 p, t, m, c, 0xEA;
sub.f16x2 p, p, c;
mov.b32 {lo, hi}, p;
cvt.f32.f16 $3, lo;
cvt.f32.f16 $7, hi;
}""")


@triton.jit
def unpack_k_order(words, UNPACK: tl.constexpr):
    """(R, W) int32 packed words -> (R, 8 W) fp32 q values in K order (k = 8 * word + nibble)."""
    if UNPACK == 1:
        q0, q1, q2, q3, q4, q5, q6, q7 = tl.inline_asm_elementwise(
            _UNPACK_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        q0 = (words & 0xF).to(tl.float32)
        q1 = ((words >> 4) & 0xF).to(tl.float32)
        q2 = ((words >> 8) & 0xF).to(tl.float32)
        q3 = ((words >> 12) & 0xF).to(tl.float32)
        q4 = ((words >> 16) & 0xF).to(tl.float32)
        q5 = ((words >> 20) & 0xF).to(tl.float32)
        q6 = ((words >> 24) & 0xF).to(tl.float32)
        q7 = ((words >> 28) & 0xF).to(tl.float32)  # arithmetic shift: the mask drops the sign bits
    # interleave(a, b) puts a at even and b at odd positions of the last axis, so three levels give
    # position 8 j + i = nibble i of word j, with each thread's values kept in its own registers.
    even = tl.interleave(tl.interleave(q0, q4), tl.interleave(q2, q6))
    odd = tl.interleave(tl.interleave(q1, q5), tl.interleave(q3, q7))
    return tl.interleave(even, odd)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                       K8, NG, G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                       UNPACK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, STAGES: tl.constexpr):
    # K8 = K / 8 and NG = K / G come in as arguments (not computed) so Triton sees their divisibility
    # by 16 and issues 16-byte vector loads along the packed rows.
    BLOCK_K: tl.constexpr = BLOCK_W * 8
    NGT: tl.constexpr = BLOCK_K // G  # whole groups per K tile
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, NGT)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N, NGT), dtype=tl.float32)
    for w0 in tl.range(0, K8, BLOCK_W, num_stages=STAGES):
        w_mask = n_mask[:, None] & ((w0 + offs_w) < K8)[None, :]
        words = tl.load(qw_ptr + rows[:, None] * K8 + w0 + offs_w[None, :], mask=w_mask, other=0)  # (BN, BW)
        g0 = w0 // (G // 8)
        meta = rows[:, None] * NG + g0 + offs_g[None, :]  # (BN, NGT)
        g_mask = n_mask[:, None] & ((g0 + offs_g) < NG)[None, :]
        s = tl.load(s_ptr + meta, mask=g_mask, other=0).to(tl.float32)
        b = tl.load(z_ptr + meta, mask=g_mask, other=0.0)
        q = unpack_k_order(words, UNPACK)  # (BN, BK) fp32, exact
        k_mask = (w0 * 8 + offs_k) < K
        for m in tl.static_range(BLOCK_M):
            xm = tl.load(x_ptr + m * stride_xm + w0 * 8 + offs_k, mask=k_mask & (m < M), other=0.0).to(tl.float32)
            qx = tl.sum(tl.reshape(q * xm[None, :], (BLOCK_N, NGT, G)), axis=2)  # (BN, NGT)
            xs = tl.sum(tl.reshape(xm, (NGT, G)), axis=1)  # (NGT,)
            part = s * qx + b * xs[None, :]
            if BLOCK_M == 1:
                acc += part[None, :, :]
            else:
                acc += tl.where((offs_m == m)[:, None, None], part[None, :, :], 0.0)
    out = tl.sum(acc, axis=2)  # (BM, BN)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


def _cfg(bn: int, bw: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": bn, "BLOCK_W": bw, "STAGES": stages}, num_warps=warps)


# H200 decode shapes (N >= 4096): 8-32 rows x 256-512 B of packed words per row per tile; 128 threads
# each hold 4 words (16-byte loads) of 1-4 rows; STAGES tiles in flight hide HBM latency.
CONFIGS = [_cfg(8, 128, 4, 3), _cfg(16, 128, 4, 3), _cfg(8, 64, 4, 4), _cfg(16, 64, 4, 4), _cfg(32, 64, 4, 3)]
INTERPRET_CONFIG = {"BLOCK_N": 16, "BLOCK_W": 16, "STAGES": 1, "num_warps": 4}


def _prune(configs, named_args, **kwargs):
    """A tile must hold whole groups, and its fp32 (BM, BN, BK) products stay within ~256 values per thread."""
    bm, G = kwargs["BLOCK_M"], kwargs["G"]
    keep = [c for c in configs if 8 * c.kwargs["BLOCK_W"] >= G
            and bm * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_W"] * 8 <= 256 * 32 * c.num_warps]
    return keep or configs[:1]


_w4a16_gemv_tuned = triton.autotune(CONFIGS, key=["N", "K", "G", "BLOCK_M", "HAS_BIAS", "UNPACK"],
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
               config: dict | None = None, unpack: int | None = None) -> torch.Tensor:
    """(M, K) x packed (N, K) W4 -> (M, N) in x's dtype, M <= 8. `config` pins a tile (else autotuned
    on CUDA); `unpack` picks the nibble unpacking (1: PTX, GPU default; 0: plain shifts, interpreter)."""
    M, N, K, G = check_w4_args(x, qweight, scales, zeros, bias)
    if M > MAX_M:
        raise ValueError(f"w4a16_gemv takes at most {MAX_M} rows, got {M}; use w4a16_gemm")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be ({M}, {N}) {x.dtype} with unit stride along N")
    if unpack is None:
        unpack = 0 if INTERPRET or not x.is_cuda else 1
    if unpack == 1 and INTERPRET:
        raise ValueError("unpack=1 (inline PTX) cannot run under TRITON_INTERPRET; use unpack=0")
    args = (x, qweight, scales, zeros, bias if bias is not None else scales, out, M, N, K,
            x.stride(0), out.stride(0), K // 8, K // G)
    meta = dict(G=G, BLOCK_M=triton.next_power_of_2(M), HAS_BIAS=bias is not None, UNPACK=unpack)
    if config is None and x.is_cuda and not INTERPRET:
        _w4a16_gemv_tuned[lambda c: (triton.cdiv(N, c["BLOCK_N"]),)](*args, **meta)
    else:
        config = dict(config or INTERPRET_CONFIG)
        config["BLOCK_W"] = max(config["BLOCK_W"], G // 8)  # a tile holds whole groups
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
