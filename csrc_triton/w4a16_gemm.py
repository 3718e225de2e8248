"""W4A16 GEMM for prefill: y (M, N) = x (M, K) @ W^T + bias, W packed as in tinyvila/quant.py.

Layouts and dtypes as in w4a16_gemv.py: x (M, K) fp16/bf16 (unit stride along K), qweight int32 (N, K/8)
with nibble i of word j = q[n, 8j + i], scales (N, K/G) in x's dtype, zeros fp32 (N, K/G), G in {32, 64, 128}.
Math: each (BLOCK_N, BLOCK_K) weight tile is dequantized once in registers, w = q * s + b in fp32 then
rounded to x's dtype (exactly what `_ref` and a dense checkpoint hold), and fed to tl.dot (wgmma on
sm_90) against the (BLOCK_M, BLOCK_K) activation tile with fp32 accumulation. BLOCK_K divides G, so a
tile has one scale and zero per row. Programs are grouped along M (GROUP_M) so weight tiles are reused
from L2. Long prompts (M >= DEQUANT_MIN_M on CUDA) take another path: w4a16_dequant to a workspace, then cuBLAS.
Limits: K % G == 0; any M, N. Autotuned on CUDA; one fixed config under TRITON_INTERPRET.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton.w4a16_dequant import w4a16_dequant
from csrc_triton.w4a16_gemv import INTERPRET, check_w4_args, dequantize_ref

# From this many rows on (CUDA), the launcher dequantizes W once into an (N, K) workspace in x's dtype
# (w4a16_dequant: memory-bound, ~K*N*2.5 bytes, tens of microseconds at Llama-3-8B shapes) and calls
# cuBLAS: at M = 2048 the fused kernel below reached only ~0.2x cuBLAS on the H200 (first GPU run),
# while the dequantization pass costs ~10-15% of a cuBLAS GEMM there. Below it, the fused kernel.
DEQUANT_MIN_M = 256

_MAGIC = tl.constexpr(0x4B000000)  # fp32 bits of 2**23: OR-ing q < 2**23 into the mantissa gives 2**23 + q


@triton.jit
def _w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_ym, M_KEY,
                       G: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # M_KEY (M rounded up to a power of two) only keys the autotuner, so prompt lengths share configs.
    # UPCAST_DOT (interpreter + bf16 only): Triton 3.6's interpreter multiplies bf16 tiles as raw uint16,
    # so both operands are widened to fp32 first (exact) and the product is that of the bf16 tiles.
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    # Out-of-range rows wrap around instead of being masked, so every load is unmasked (K % BLOCK_K == 0);
    # their results are dropped by the masked store.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    K8, NG = K // 8, K // G
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    qw_ptrs = qw_ptr + offs_n[:, None].to(tl.int64) * K8 + tl.arange(0, BLOCK_K // 8)[None, :]
    meta = offs_n.to(tl.int64) * NG
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs)  # (BM, BK)
        words = tl.load(qw_ptrs)  # (BN, BK/8) int32
        s = tl.load(s_ptr + meta + k0 // G).to(tl.float32)  # (BN,): one group per tile
        b = tl.load(z_ptr + meta + k0 // G)
        q = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # (BN, BK/8, 8): k = 8 * word + nibble
        # 2**23 + q by bit pattern, then an exact subtraction: avoids the quarter-rate int->float convert.
        f = (q | _MAGIC).to(tl.float32, bitcast=True) - 8388608.0
        w = f * s[:, None, None] + b[:, None, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x.dtype)  # (BN, BK), rounded like the reference
        if UPCAST_DOT:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        qw_ptrs += BLOCK_K // 8
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int = 8) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages)


# Large tiles for prefill (Hopper fp16 GEMM habits: 128x128/128x256 tiles, 3-4 stages, 8 warps so
# the dequantization of a tile is spread over 256 threads), small-M tiles for short prompts.
CONFIGS = [
    _cfg(128, 128, 64, 8, 3), _cfg(128, 128, 64, 4, 4), _cfg(128, 256, 64, 8, 3), _cfg(128, 128, 128, 8, 3),
    _cfg(64, 128, 64, 4, 4), _cfg(128, 64, 64, 4, 4), _cfg(128, 128, 32, 8, 4), _cfg(64, 64, 32, 4, 4),
    _cfg(16, 64, 128, 4, 4), _cfg(32, 64, 64, 4, 4), _cfg(32, 128, 128, 4, 3), _cfg(64, 64, 128, 4, 4),
]
INTERPRET_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "num_warps": 4}


def _prune(configs, named_args, **kwargs):
    """BLOCK_K must divide the group; tiles far taller than the prompt waste the tensor cores."""
    G, m = kwargs["G"], named_args["M_KEY"]
    keep = [c for c in configs if G % c.kwargs["BLOCK_K"] == 0
            and c.kwargs["BLOCK_M"] <= max(16, m)
            and (m <= 64 or c.kwargs["BLOCK_M"] >= 64)]
    return keep or [c for c in configs if G % c.kwargs["BLOCK_K"] == 0][:1]


_w4a16_gemm_tuned = triton.autotune(CONFIGS, key=["M_KEY", "N", "K", "G", "HAS_BIAS"],
                                    prune_configs_by={"early_config_prune": _prune})(_w4a16_gemm_kernel)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               config: dict | None = None, path: str | None = None) -> torch.Tensor:
    """(M, K) x packed (N, K) W4 -> (M, N) in x's dtype. `config` pins a tile (else autotuned on CUDA);
    `path` forces "fused" or "dequant" (dequantize to a workspace + cuBLAS); default by M (DEQUANT_MIN_M)."""
    M, N, K, G = check_w4_args(x, qweight, scales, zeros, bias)
    if path is None:
        path = "dequant" if x.is_cuda and not INTERPRET and M >= DEQUANT_MIN_M else "fused"
    if path not in ("fused", "dequant"):
        raise ValueError(f"path must be 'fused' or 'dequant', got {path!r}")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be ({M}, {N}) {x.dtype} with unit stride along N")
    if M == 0:
        return out
    if path == "dequant":
        w = w4a16_dequant(qweight, scales, zeros)  # (N, K) in x's dtype, rounded like `_ref`
        if bias is None:
            return torch.mm(x, w.T, out=out)
        return torch.addmm(bias, x, w.T, out=out)
    m_key = min(triton.next_power_of_2(M), 4096)
    args = (x, qweight, scales, zeros, bias if bias is not None else scales, out, M, N, K,
            x.stride(0), out.stride(0), m_key)
    meta = dict(G=G, HAS_BIAS=bias is not None, UPCAST_DOT=not x.is_cuda and x.dtype == torch.bfloat16)
    if config is None and x.is_cuda:
        grid = lambda c: (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]),)  # noqa: E731
        _w4a16_gemm_tuned[grid](*args, **meta)
    else:
        config = dict(config or INTERPRET_CONFIG)
        config["BLOCK_K"] = min(config["BLOCK_K"], G)
        grid = (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"]),)
        _w4a16_gemm_kernel[grid](*args, **meta, **config)
    return out


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: dequantize (rounded to x's dtype) -> fp32 matmul -> cast; the CPU path and test oracle."""
    y = x.float() @ dequantize_ref(qweight, scales, zeros).to(x.dtype).float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
