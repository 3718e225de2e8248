"""The one definition of tinyvila's quantized weight formats.

W4 (LLM linears, W4A16): asymmetric uint4 per group of G input channels (G = 128, 64 or 32).
For a Linear with N outputs and K inputs, stored in the checkpoint exactly as the kernels read it:

    qweight  int32   (N, K // 8)   word j of row n holds q[n, 8j + i] in bits [4i, 4i + 4), i = 0..7
    scales   fp16/bf16 (N, K // G) s[n, g]  (the activation dtype)
    zeros    float32 (N, K // G)   b[n, g] = -z[n, g] * s[n, g]   (the "scaled zero")

    w[n, k] = q[n, k] * s[n, k // G] + b[n, k // G]      evaluated in fp32, then cast

Why this form: rows of `qweight` are contiguous along K, so a GEMV program streams whole 16-byte
loads per row and a GEMM tile is a plain (BLOCK_N, BLOCK_K / 8) load; one FMA dequantizes. The
bias is fp32 so that the fp32 FMA is exact for both published layouts we import: AutoAWQ's
`(q - z) * s` (b = -z*s is exact in fp32) and llm-awq's `q * s + scaled_zeros` (an fp16 scaled_zero
widens exactly); the single rounding to the activation dtype then reproduces each source's own
dequantization bit for bit. Cost: 6 bytes of metadata per group, 9.4% over the int4 payload at G=128.
"""

from __future__ import annotations

import torch

W4_GROUP_SIZES = (32, 64, 128)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integers in [0, 15] -> (N, K // 8) int32, nibble i of word j = q[:, 8j + i]."""
    N, K = q.shape
    if K % 8:
        raise ValueError(f"K={K} must be a multiple of 8 to pack int4")
    if q.min() < 0 or q.max() > 15:
        raise ValueError("int4 values must lie in [0, 15]")
    q = q.to(torch.int64).view(N, K // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (q << shifts).sum(-1)  # (N, K/8), < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K // 8) int32 -> (N, K) uint8 in [0, 15]; the exact inverse of `pack_int4`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight[..., None] >> shifts) & 0xF  # arithmetic shift is fine: the mask drops sign bits
    return q.reshape(qweight.shape[0], -1).to(torch.uint8)


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Packed W4 -> dense (N, K) weight in `dtype` (default: the scales' dtype), the reference math."""
    q = unpack_int4(qweight).float()  # (N, K)
    G = q.shape[1] // scales.shape[1]
    s = scales.float().repeat_interleave(G, dim=1)
    b = zeros.float().repeat_interleave(G, dim=1)
    return (q * s + b).to(dtype or scales.dtype)


def quantize_w4(w: torch.Tensor, group_size: int = 128, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Round-to-nearest asymmetric W4 of a dense (N, K) weight -> {"qweight", "scales", "zeros"}.

    Per group: s = (max - min) / 15, z = round(-min / s) clamped to [0, 15], q = clamp(round(w / s) + z).
    This is the quantizer of AWQ (and of `--method rtn`); AWQ changes w (scaling, clipping) first.
    """
    if group_size not in W4_GROUP_SIZES:
        raise ValueError(f"group size {group_size} not supported; use one of {W4_GROUP_SIZES}")
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"K={K} is not a multiple of the group size {group_size}")
    dtype = dtype or w.dtype
    wg = w.float().view(N, K // group_size, group_size)
    wmax, wmin = wg.amax(-1).clamp(min=0), wg.amin(-1).clamp(max=0)
    s = ((wmax - wmin).clamp(min=1e-5) / 15).to(dtype)  # the stored scale is what dequantizes
    sf = s.float()
    z = torch.clamp(torch.round(-wmin / sf), 0, 15)
    q = torch.clamp(torch.round(wg / sf[..., None]) + z[..., None], 0, 15)
    return {"qweight": pack_int4(q.view(N, K)), "scales": s, "zeros": (-z * sf).float()}
