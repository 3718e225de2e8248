"""Prefill salience: the attention each key receives, averaged over query rows and heads (SparseVILA).

    s[b, n] = 1 / (H * M) * sum_h sum_{m < M} softmax_n(scale * q[b, h, m] . k[b, h, :])[n]

q (B, H, T, D), k (B, H, N, D), fp16/bf16/fp32, any strides with unit stride along D (the views
of a fused qkv projection work as they are). Rows m < M = n_query (all T, or the first few: CLIP's
CLS / summary tokens) query all N keys; B frames are independent. Result (B, N) fp32. Two passes,
never an M x N matrix in memory (O(B*H*(M+N)) extra): pass 1 (`_row_lse_kernel`, a FlashAttention
forward without V) gives each row's log-sum-exp; pass 2 (`_prefill_salience_kernel`) owns a tile of
keys per (b, h), streams every query row past it and sums exp(s - lse) down the columns in
registers, so no atomics; the 1/(H*M) mean is folded into its store. What is fused: the salience
layer's attention already computes the same LSE, so a caller holding it passes `lse` and pays only
pass 2, one QK^T pass. Head dims that are not powers of two (SigLIP's 72) are split into two
power-of-two dot slices (64 + 16, masked), not padded to 128: 11% padding instead of 78%.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _scores(q_ptr, k_ptr, offs_m, offs_n, m_ok, n_ok, sqm, skn,
            D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, PRECISION: tl.constexpr,
            UPCAST: tl.constexpr):
    """(BLOCK_M, BLOCK_N) fp32 q.k over D as a D0 slice plus a masked D1 slice (D1 = 0: none).
    UPCAST: exact fp32 products, for the CPU interpreter, whose bf16 tl.dot returns garbage."""
    d0 = tl.arange(0, D0)
    q = tl.load(q_ptr + offs_m[:, None] * sqm + d0[None, :], mask=m_ok[:, None], other=0.0)
    kt = tl.load(k_ptr + offs_n[None, :] * skn + d0[:, None], mask=n_ok[None, :], other=0.0)
    if UPCAST:
        q, kt = q.to(tl.float32), kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=PRECISION, out_dtype=tl.float32)
    if D1 > 0:
        d1 = D0 + tl.arange(0, D1)
        q1 = tl.load(q_ptr + offs_m[:, None] * sqm + d1[None, :], mask=m_ok[:, None] & (d1[None, :] < D),
                     other=0.0)
        k1 = tl.load(k_ptr + offs_n[None, :] * skn + d1[:, None], mask=n_ok[None, :] & (d1[:, None] < D),
                     other=0.0)
        if UPCAST:
            q1, k1 = q1.to(tl.float32), k1.to(tl.float32)
        s = tl.dot(q1, k1, acc=s, input_precision=PRECISION, out_dtype=tl.float32)
    return s


@triton.jit
def _row_lse_kernel(q_ptr, k_ptr, lse_ptr, sqb, sqh, sqm, skb, skh, skn, H, M, N, scale_log2,
                    D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 1: lse2[bh, m] = log2 sum_n exp2(scale_log2 * q.k), online max/sum over key tiles."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_ptr += b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_ptr += b.to(tl.int64) * skb + h.to(tl.int64) * skh
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        s = _scores(q_ptr, k_ptr, offs_m, offs_n, m_ok, n_ok, sqm, skn, D, D0, D1, PRECISION, UPCAST) * scale_log2
        s = tl.where(n_ok[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds at least one valid key
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m_i = m_new
    tl.store(lse_ptr + bh.to(tl.int64) * M + offs_m, m_i + tl.log2(l_i), mask=m_ok)


@triton.jit
def _prefill_salience_kernel(q_ptr, k_ptr, lse_ptr, out_ptr, sqb, sqh, sqm, skb, skh, skn, H, M, N,
                             scale_log2, inv_count, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                             PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 2: out[bh, n] = inv_count * sum_m exp2(scale_log2 * q.k - lse2[bh, m]) for one key tile."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_ptr += b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_ptr += b.to(tl.int64) * skb + h.to(tl.int64) * skh
    lse_ptr += bh.to(tl.int64) * M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        # Rows past M get lse = +inf, so exp2 gives exactly 0 and no extra select is needed.
        lse = tl.load(lse_ptr + offs_m, mask=m_ok, other=float("inf"))
        s = _scores(q_ptr, k_ptr, offs_m, offs_n, m_ok, n_ok, sqm, skn, D, D0, D1, PRECISION, UPCAST)
        acc += tl.sum(tl.exp2(s * scale_log2 - lse[:, None]), axis=0)
    tl.store(out_ptr + bh.to(tl.int64) * N + offs_n, acc * inv_count, mask=n_ok)


def _split_head_dim(D: int) -> tuple[int, int]:
    """D -> (D0, D1): D0 the largest power of two <= D (at least 16, tl.dot's minimum), D1 a power
    of two >= 16 covering the rest (0 when D0 covers D). 72 -> (64, 16), 80 -> (64, 16), 64 -> (64, 0)."""
    d0 = max(16, 1 << (D.bit_length() - 1))
    rest = D - d0
    return d0, 0 if rest <= 0 else max(16, 1 << (rest - 1).bit_length())


def _check(q: torch.Tensor, k: torch.Tensor, n_query: int | None, lse: torch.Tensor | None) -> int:
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"prefill_salience: q (B, H, T, D) and k (B, H, N, D) must agree in B, H, D; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.dtype != k.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"prefill_salience: q and k must share a float16/bfloat16/float32 dtype, "
                         f"got {q.dtype}, {k.dtype}")
    if q.stride(3) != 1 or k.stride(3) != 1:
        raise ValueError("prefill_salience: q and k need unit stride along D; pass .contiguous() tensors")
    if q.shape[3] > 256 or k.shape[2] < 1:
        raise ValueError(f"prefill_salience: head dim {q.shape[3]} > 256 or no keys")
    M = q.shape[2] if n_query is None else n_query
    if not 1 <= M <= q.shape[2]:
        raise ValueError(f"prefill_salience: n_query must be in [1, {q.shape[2]}], got {n_query}")
    if lse is not None and (lse.shape != (q.shape[0], q.shape[1], M) or lse.dtype != torch.float32):
        raise ValueError(f"prefill_salience: lse must be float32 of shape {(q.shape[0], q.shape[1], M)}, "
                         f"got {lse.dtype} {tuple(lse.shape)}")
    return M


def _blocks(bh: int, M: int, N: int, device: torch.device) -> tuple[int, int, int]:
    """Pass 1's BLOCK_M and pass 2's (BLOCK_M, BLOCK_N): the wide tile when it still gives two
    programs per SM (one frame of 729 tokens does not), query tiles no taller than the rows there
    are (summary mode reads 1..few rows; tl.dot needs 16)."""
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    rows = max(16, triton.next_power_of_2(M))
    block_m1 = min(128 if bh * triton.cdiv(M, 128) >= 2 * n_sm else 64, rows)
    block_n2 = 128 if bh * triton.cdiv(N, 128) >= 2 * n_sm else 64
    return block_m1, min(64, rows), block_n2


def prefill_salience(q: torch.Tensor, k: torch.Tensor, *, n_query: int | None = None,
                     lse: torch.Tensor | None = None, scale: float | None = None,
                     blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Mean attention each key receives: q (B, H, T, D), k (B, H, N, D) -> (B, N) fp32.

    n_query: average over the first n_query rows only (summary tokens); default all T rows.
    lse: (B, H, n_query) fp32 natural-log log-sum-exp of each row's scaled logits, when the caller's
    attention already computed it (then only pass 2 runs). scale: default D ** -0.5.
    blocks: (pass-1 BLOCK_M, pass-2 BLOCK_M, pass-2 BLOCK_N) instead of the defaults (tuning sweeps).
    """
    M = _check(q, k, n_query, lse)
    B, H, _, D = q.shape
    N = k.shape[2]
    scale_log2 = (scale if scale is not None else D ** -0.5) * LOG2E
    d0, d1 = _split_head_dim(D)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    if upcast:
        precision = "ieee"
    block_m1, block_m, block_n = blocks or _blocks(B * H, M, N, q.device)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    if lse is None:
        lse2 = torch.empty(B, H, M, device=q.device, dtype=torch.float32)
        _row_lse_kernel[(triton.cdiv(M, block_m1), B * H)](
            q, k, lse2, *strides, H, M, N, scale_log2, D=D, D0=d0, D1=d1, PRECISION=precision, UPCAST=upcast,
            BLOCK_M=block_m1, BLOCK_N=64, num_warps=8 if block_m1 == 128 else 4, num_stages=3)
    else:
        lse2 = (lse * LOG2E).contiguous()  # the kernels work in base 2 (exp2 is the hardware op)
    part = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    _prefill_salience_kernel[(triton.cdiv(N, block_n), B * H)](
        q, k, lse2, part, *strides, H, M, N, scale_log2, 1.0 / (H * M), D=D, D0=d0, D1=d1,
        PRECISION=precision, UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8 if block_n == 128 else 4,
        num_stages=3)
    return part.sum(1)  # (B, N): heads summed outside, so every store above is plain (no atomics)


def prefill_salience_ref(q: torch.Tensor, k: torch.Tensor, *, n_query: int | None = None,
                         lse: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Materialised softmax(q k^T * scale) then the mean over rows and heads, in fp32 (or fp64 for
    fp64 inputs): q (B, H, T, D), k (B, H, N, D) -> (B, N). `lse` is accepted and ignored."""
    M = q.shape[2] if n_query is None else n_query
    dt = torch.promote_types(q.dtype, torch.float32)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    s = q[:, :, :M].to(dt) @ k.to(dt).transpose(-1, -2) * scale  # (B, H, M, N)
    return torch.softmax(s, dim=-1).mean(dim=(1, 2))
