"""Retrieval salience: how much attention each retrievable cached token receives from a question.

    s[b, g, j] += sum_{h in group g} sum_t exp(scale * q[b, h, t] . k[b, g, idx[j]] - lse[b, h, t])

q (B, H, T, D) the question's post-RoPE queries (fp16/bf16/fp32, any strides, unit stride along D);
k (B, Hkv, S, D) the cache; idx (N,) int32 cache slots of the retrievable tokens; lse (B, H, T) fp32
natural-log log-sum-exp of each query row's (scaled) attention logits, from the prefill attention.
The result (B, Hkv, N) fp32 is each token's normalised attention summed over the rows and the n_rep
query heads of its KV group; passing `out` accumulates into it (a question prefilled in chunks).
Every retrievable token precedes every question row, so no causal mask applies. Program (b, g, tile)
gathers BLOCK_N keys once and streams all n_rep*T rows past them: no matrix is materialised and no
atomics are needed. D <= 256.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _retrieval_salience_kernel(
    q_ptr, k_ptr, idx_ptr, lse_ptr, out_ptr,
    sqb, sqh, sqt, skb, skh, skl, slb, slh, slt, sob, soh,
    T, N, HKV, scale_log2, N_REP: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    bg = tl.program_id(0)
    tile = tl.program_id(1)
    b = bg // HKV
    g = bg % HKV
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    d_ok = offs_d < D
    slot = tl.load(idx_ptr + offs_n, mask=n_ok, other=0)
    kt = tl.load(k_ptr + b * skb + g * skh + slot[None, :].to(tl.int64) * skl + offs_d[:, None],
                 mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    rows = N_REP * T  # the group's query rows, flattened as (head, t)
    offs_m = tl.arange(0, BLOCK_M)
    for m0 in range(0, rows, BLOCK_M):
        r = m0 + offs_m
        r_ok = r < rows
        h = g * N_REP + r // T
        t = r % T
        q = tl.load(q_ptr + b * sqb + h[:, None] * sqh + t[:, None] * sqt + offs_d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
        lse = tl.load(lse_ptr + b * slb + h * slh + t * slt, mask=r_ok, other=0.0)  # (BLOCK_M,)
        if UPCAST:  # the CPU interpreter multiplies bf16 wrongly; it runs the dot in fp32 instead
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32))
        else:
            s = tl.dot(q.to(kt.dtype), kt, input_precision=PRECISION, out_dtype=tl.float32)  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s * scale_log2 - lse[:, None] * 1.4426950408889634)
        p = tl.where(r_ok[:, None], p, 0.0)
        acc += tl.sum(p, axis=0)
    ptrs = out_ptr + b * sob + g * soh + offs_n
    prev = tl.load(ptrs, mask=n_ok, other=0.0)
    tl.store(ptrs, prev + acc, mask=n_ok)


def _check(q, k, idx, lse, out):
    B, H, T, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != D or H % k.shape[1]:
        raise ValueError(f"retrieval_salience: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
                         "(B, H, T, D) and (B, Hkv, S, D) with H a multiple of Hkv")
    if lse.shape != (B, H, T) or lse.dtype != torch.float32:
        raise ValueError(f"retrieval_salience: lse must be float32 {(B, H, T)}, got {lse.dtype} {tuple(lse.shape)}")
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError("retrieval_salience: idx must be a 1-D int32/int64 tensor of cache slots")
    want = (B, k.shape[1], idx.numel())
    if out is not None and (out.shape != want or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"retrieval_salience: out must be a contiguous float32 {want} tensor")


def retrieval_salience(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor,
                       scale: float | None = None, out: torch.Tensor | None = None,
                       block_m: int = 64, block_n: int = 128, num_warps: int = 8,
                       num_stages: int = 2) -> torch.Tensor:
    """q (B, H, T, D), k (B, Hkv, S, D), idx (N,), lse (B, H, T) fp32 -> (B, Hkv, N) fp32 (added to `out`).

    Tile defaults: best of the H200 sweep in scripts/benches/decode_attention.py (docs/perf_notes.md)."""
    _check(q, k, idx, lse, out)
    B, H, T, D = q.shape
    Hkv, N = k.shape[1], idx.numel()
    if q.stride(-1) != 1 or k.stride(-1) != 1 or D > 256:
        raise ValueError("retrieval_salience: the last dim must be contiguous and at most 256")
    out = torch.zeros(B, Hkv, N, device=q.device, dtype=torch.float32) if out is None else out
    if N == 0 or T == 0:
        return out
    idx = idx.to(torch.int32)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _retrieval_salience_kernel[(B * Hkv, triton.cdiv(N, block_n))](
        q, k, idx, lse, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), out.stride(0), out.stride(1),
        T, N, Hkv, scale * LOG2E, N_REP=H // Hkv, D=D,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        # fp32 caches (tests) get exact products; tf32 would blur the ranking for no gain here.
        PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
        UPCAST=os.environ.get("TRITON_INTERPRET", "0") == "1" and torch.bfloat16 in (q.dtype, k.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def retrieval_salience_ref(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor,
                           scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch (materialises the (B, H, T, N) probabilities); computed in fp32 or wider."""
    _check(q, k, idx, lse, out)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    wide = torch.promote_types(q.dtype, torch.float32)
    kr = k[:, :, idx.long()].to(wide).repeat_interleave(H // Hkv, dim=1)  # (B, H, N, D)
    p = torch.exp(scale * (q.to(wide) @ kr.transpose(-1, -2)) - lse.to(wide)[..., None])  # (B, H, T, N)
    s = p.sum(2).view(B, Hkv, H // Hkv, -1).sum(2).float()  # (B, Hkv, N)
    return s if out is None else out.add_(s)
