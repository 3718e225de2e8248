"""Prefill salience: the attention each key receives, averaged over query rows and heads (SparseVILA).

    s[b, n] = 1 / (H * M) * sum_h sum_{m < M} exp(scale * q[b, h, m] . k[b, h, n] - lse[b, h, m])

q (B, H, T, D), k (B, H, N, D), fp16/bf16/fp32, any strides with unit stride along D (views of a
fused qkv projection work as they are); rows m < M = n_query (all T, or the first few: CLIP's CLS /
summary tokens); B frames independent. Result (B, N) fp32; extra memory O(B*H*(M+N)), never M x N.
Pass 1 (`_row_lse_kernel`, a FlashAttention forward without V) gives each row's natural-log LSE.
Pass 2 (`_prefill_salience_kernel`) keeps a tile of keys resident and streams the query rows past
it, computing S^T = K Q^T so the column sum is a cheap in-thread row sum (summing down the rows of
Q K^T costs a cross-warp reduction per tile; that layout was 2-2.7x slower on the H200). Fused: the salience layer's
attention already has the LSE (tinyvila.ops.attention_lse), so the encoder passes it and pays only
pass 2, one QK^T. D not a power of two (SigLIP 72) = a 64 slice plus a masked 16 slice (2 dots).
exp2 with log2(e) folded into the scale; `fast_exp` uses ex2.approx.f16x2 (2 per MUFU op, CUDA only).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_LOG2E, _LN2 = tl.constexpr(LOG2E), tl.constexpr(LN2)  # what a @triton.jit body may read
FAST_EXP_DEFAULT = False  # fp16x2 exponentials for 16-bit inputs on CUDA (see docs/perf_notes.md)


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    """exp2 of fp32 x <= 0; FAST: in fp16 pairs (MUFU ex2.f16x2, twice the fp32 rate, ~1e-3 rel.)."""
    if FAST:
        y = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)],
                                      dtype=tl.float16, is_pure=True, pack=2)
        return y.to(tl.float32)
    else:
        return tl.exp2(x)


@triton.jit
def _load_resident(ptr, offs, ok, stride, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                   UPCAST: tl.constexpr):
    """The resident (R, D0) and (R, D1) slices of R rows (the D1 slice masked past D; D1 = 0: unused)."""
    d0 = tl.arange(0, D0)
    a0 = tl.load(ptr + offs[:, None] * stride + d0[None, :], mask=ok[:, None], other=0.0)
    if UPCAST:  # the CPU interpreter's bf16 tl.dot returns garbage: exact fp32 products instead
        a0 = a0.to(tl.float32)
    if D1 > 0:
        d1 = D0 + tl.arange(0, D1)
        a1 = tl.load(ptr + offs[:, None] * stride + d1[None, :], mask=ok[:, None] & (d1[None, :] < D),
                     other=0.0)
        if UPCAST:
            a1 = a1.to(tl.float32)
    else:
        a1 = a0  # unused: _dot_streamed skips the second slice
    return a0, a1


@triton.jit
def _dot_streamed(a0, a1, ptr, offs, ok, stride, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """(R, S) fp32 = resident rows . streamed rows `offs`, the streamed tile loaded transposed (D, S)."""
    d0 = tl.arange(0, D0)
    b0 = tl.load(ptr + offs[None, :] * stride + d0[:, None], mask=ok[None, :], other=0.0)
    if UPCAST:
        b0 = b0.to(tl.float32)
    s = tl.dot(a0, b0, input_precision=PRECISION, out_dtype=tl.float32)
    if D1 > 0:
        d1 = D0 + tl.arange(0, D1)
        b1 = tl.load(ptr + offs[None, :] * stride + d1[:, None], mask=ok[None, :] & (d1[:, None] < D),
                     other=0.0)
        if UPCAST:
            b1 = b1.to(tl.float32)
        s = tl.dot(a1, b1, acc=s, input_precision=PRECISION, out_dtype=tl.float32)
    return s


@triton.jit
def _row_lse_kernel(q_ptr, k_ptr, lse_ptr, sqb, sqh, sqm, skb, skh, skn, H, M, N, scale_log2,
                    D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, FAST: tl.constexpr, ALIGN: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    """Pass 1: lse[bh, m] = ln sum_n exp(scale q.k) for BLOCK_R resident rows, online over key tiles."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    sqm, skn = sqm * ALIGN, skn * ALIGN  # strides arrive divided by ALIGN (see prefill_salience)
    q_ptr += b.to(tl.int64) * sqb * ALIGN + h.to(tl.int64) * sqh * ALIGN
    k_ptr += b.to(tl.int64) * skb * ALIGN + h.to(tl.int64) * skh * ALIGN
    offs_m = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_ok = offs_m < M
    q0, q1 = _load_resident(q_ptr, offs_m, m_ok, sqm, D, D0, D1, UPCAST)
    m_i = tl.full([BLOCK_R], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    for n0 in range(0, N, BLOCK_S):
        offs_n = n0 + tl.arange(0, BLOCK_S)
        n_ok = offs_n < N
        s = _dot_streamed(q0, q1, k_ptr, offs_n, n_ok, skn, D, D0, D1, PRECISION, UPCAST) * scale_log2
        s = tl.where(n_ok[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds at least one valid key
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(_exp2(s - m_new[:, None], FAST), axis=1)
        m_i = m_new
    tl.store(lse_ptr + bh.to(tl.int64) * M + offs_m, (m_i + tl.log2(l_i)) * _LN2, mask=m_ok)


@triton.jit
def _prefill_salience_kernel(q_ptr, k_ptr, lse_ptr, out_ptr, sqb, sqh, sqm, skb, skh, skn, slb, slh,
                             H, M, N, scale_log2, inv_count, D: tl.constexpr, D0: tl.constexpr,
                             D1: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                             FAST: tl.constexpr, ALIGN: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_S: tl.constexpr):
    """Pass 2: out[bh, n] = inv_count * sum_m exp2(scale_log2 k.q - log2e lse[m]), BLOCK_R resident keys."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    sqm, skn = sqm * ALIGN, skn * ALIGN
    q_ptr += b.to(tl.int64) * sqb * ALIGN + h.to(tl.int64) * sqh * ALIGN
    k_ptr += b.to(tl.int64) * skb * ALIGN + h.to(tl.int64) * skh * ALIGN
    lse_ptr += b.to(tl.int64) * slb + h.to(tl.int64) * slh
    offs_n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n_ok = offs_n < N
    k0, k1 = _load_resident(k_ptr, offs_n, n_ok, skn, D, D0, D1, UPCAST)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for m0 in range(0, M, BLOCK_S):
        offs_m = m0 + tl.arange(0, BLOCK_S)
        m_ok = offs_m < M
        # Rows past M get lse = +inf, so exp2 gives exactly 0 and no extra select is needed.
        lse2 = tl.load(lse_ptr + offs_m, mask=m_ok, other=float("inf")) * _LOG2E
        s = _dot_streamed(k0, k1, q_ptr, offs_m, m_ok, sqm, D, D0, D1, PRECISION, UPCAST)  # (R, S) = K Q^T
        acc += tl.sum(_exp2(s * scale_log2 - lse2[None, :], FAST), axis=1)
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


# (resident rows, streamed rows, num_warps, num_stages) for both passes. The H200 sweep
# (docs/perf_notes.md, 2026-11-29) found 128 resident x 64 streamed rows on one warpgroup the best
# standalone config at every shape (1-64 SigLIP frames, N = 4K-64K), and the best or within 10% fused.
DEFAULT_TILES = (128, 64, 4, 3)


def prefill_salience(q: torch.Tensor, k: torch.Tensor, *, n_query: int | None = None,
                     lse: torch.Tensor | None = None, scale: float | None = None,
                     tiles: tuple[int, int, int, int] | None = None, fast_exp: bool | None = None) -> torch.Tensor:
    """Mean attention each key receives: q (B, H, T, D), k (B, H, N, D) -> (B, N) fp32.

    n_query: average over the first n_query rows only (summary tokens); default all T rows.
    lse: (B, H, n_query) fp32 natural-log log-sum-exp of each row's scaled logits (unit stride along
    rows), when the caller's attention already computed it: then only pass 2 runs. scale: default
    D ** -0.5. tiles: (resident, streamed, num_warps, num_stages) instead of DEFAULT_TILES (sweeps).
    fast_exp: fp16x2 exponentials (CUDA, 16-bit inputs only); default FAST_EXP_DEFAULT.
    """
    M = _check(q, k, n_query, lse)
    B, H, _, D = q.shape
    N = k.shape[2]
    scale_log2 = (scale if scale is not None else D ** -0.5) * LOG2E
    d0, d1 = _split_head_dim(D)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    upcast = q.dtype == torch.bfloat16 and interpret
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"  # tf32 is ignored for 16-bit inputs
    fast = (FAST_EXP_DEFAULT if fast_exp is None else fast_exp) and q.dtype != torch.float32 and not interpret
    res, stream, warps, stages = tiles or DEFAULT_TILES
    streamed_m = min(stream, max(16, triton.next_power_of_2(M)))  # summary mode: 1..few rows (dot needs 16)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    # Triton only learns that an int argument is a multiple of 16; SigLIP's strides (72, 729*72) are
    # multiples of 8, i.e. 16-byte rows. Passing stride // 8 and multiplying by a constexpr 8 inside
    # tells the compiler, which then issues 16-byte (cp.async) loads instead of 2-byte ones.
    align = 8 if all(st % 8 == 0 for st in strides) else 1
    strides = tuple(st // align for st in strides)
    meta = dict(D=D, D0=d0, D1=d1, PRECISION=precision, UPCAST=upcast, FAST=fast, ALIGN=align, num_warps=warps,
                num_stages=stages)
    if lse is None:
        lse = torch.empty(B, H, M, device=q.device, dtype=torch.float32)
        _row_lse_kernel[(triton.cdiv(M, min(res, max(16, triton.next_power_of_2(M)))), B * H)](
            q, k, lse, *strides, H, M, N, scale_log2, BLOCK_R=min(res, max(16, triton.next_power_of_2(M))),
            BLOCK_S=stream, **meta)
    elif lse.stride(2) != 1:
        lse = lse.contiguous()
    part = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    _prefill_salience_kernel[(triton.cdiv(N, res), B * H)](
        q, k, lse, part, *strides, lse.stride(0), lse.stride(1), H, M, N, scale_log2, 1.0 / (H * M),
        BLOCK_R=res, BLOCK_S=streamed_m, **meta)
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
