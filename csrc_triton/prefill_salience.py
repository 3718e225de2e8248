"""Prefill salience: the attention each key receives, averaged over query rows and heads (SparseVILA).

    s[b, n] = 1 / (H * M) * sum_h sum_{m < M} exp(scale * q[b, h, m] . k[b, h, n] - lse[b, h, m])

q (B, H, T, D), k (B, H, N, D), fp16/bf16/fp32, any strides with unit stride along D (views of a fused qkv
projection work as they are); rows m < M = n_query (all T, or the first few: CLIP's CLS / summary tokens); B frames
independent. Result (B, N) fp32; extra memory O(B*H*(M+N)), never M x N.
Pass 1 (`_row_lse_kernel`, a FlashAttention forward without V) gives each row's LSE (log2 units, negated, as pass
2's exponent adds it). It first sums 2^logit with NO running max (the max costs an FMNMX per score plus a shuffle,
exp2 and rescale per row and tile); the sum is exact to fp32 rounding while it stays in [2^-60, 2^100) (see
_SUM_LO), which holds unless a row's logits exceed ~100 - log2 N or all lie below ~-60 (log2 units): then that
block of rows reruns with the running max. Ordinary attention logits (tens) never leave the range.
Pass 2 (`_prefill_salience_kernel`) keeps a tile of keys resident and streams the query rows past it, computing
S^T = K Q^T so the column sum is a cheap in-thread row sum (down the rows of Q K^T it is a cross-warp reduction per
tile). Fused: the salience layer's attention already has the LSE (tinyvila.ops.attention_lse), so the encoder
passes it and pays only pass 2, one QK^T. D not a power of two (SigLIP 72) = a 64 slice plus a masked 16 slice (2
dots). exp2 with log2(e) folded into the scale; full streamed tiles unmasked, only a partial last tile masked.
Alternatives measured and not kept: docs/perf_notes.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._common import INTERPRET
from ._triton import tl, triton
from .launch import Launch, Plans

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # what a @triton.jit body may read


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
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr):
    """(R, S) fp32 = resident rows . streamed rows `offs`, the streamed tile loaded transposed (D, S). MASKED: rows
    with ok False read as 0 (a partial tile); otherwise no row mask at all (full tiles). With a D1 slice its (small)
    dot is issued first: Triton waits for the first dot of the chain before issuing the second, and waiting on 2
    wgmmas instead of 8 is the shorter stall (docs/perf_notes.md)."""
    d0 = tl.arange(0, D0)
    if MASKED:
        b0 = tl.load(ptr + offs[None, :] * stride + d0[:, None], mask=ok[None, :], other=0.0)
    else:
        b0 = tl.load(ptr + offs[None, :] * stride + d0[:, None])
    if UPCAST:
        b0 = b0.to(tl.float32)
    if D1 > 0:
        d1 = D0 + tl.arange(0, D1)
        if MASKED:
            b1 = tl.load(ptr + offs[None, :] * stride + d1[:, None], mask=ok[None, :] & (d1[:, None] < D),
                         other=0.0)
        else:  # SigLIP's 72 = 64 + 8 of 16: a static mask, the same for every tile
            b1 = tl.load(ptr + offs[None, :] * stride + d1[:, None], mask=d1[:, None] < D, other=0.0)
        if UPCAST:
            b1 = b1.to(tl.float32)
        s = tl.dot(a1, b1, input_precision=PRECISION, out_dtype=tl.float32)
        s = tl.dot(a0, b0, acc=s, input_precision=PRECISION, out_dtype=tl.float32)
    else:
        s = tl.dot(a0, b0, input_precision=PRECISION, out_dtype=tl.float32)
    return s


@triton.jit
def _sum_update(s, m_i, l_i, scale_log2, RUNNING_MAX: tl.constexpr):
    """One tile's step of _row_sum_exp2 over raw logits s (R, S) (-inf where masked). RUNNING_MAX: the online-softmax
    step in log2 units (the max is taken on the raw logits, scale_log2 > 0, so each exponent is one FFMA,
    s * scale_log2 - m); else the plain sum, m_i untouched."""
    if RUNNING_MAX:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)  # finite: every tile holds a valid key
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        return m_new, l_i * tl.exp2(m_i - m_new) + tl.sum(p, axis=1)
    else:
        return m_i, l_i + tl.sum(tl.exp2(s * scale_log2), axis=1)


@triton.jit
def _row_sum_exp2(q0, q1, k_ptr, m_ok, skn, N, scale_log2, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                  RUNNING_MAX: tl.constexpr):
    """(m, l) of the resident rows with log2 sum_n 2^(scale_log2 q.k_n) = m + log2(l): full streamed tiles unmasked,
    then a masked last tile. RUNNING_MAX: m the running max (any logits); else m = 0 and l the sum with no max
    subtracted (one FMUL, exp2 and FADD per score), valid only when the caller checks the sums' range."""
    m_i = tl.full([BLOCK_R], -float("inf") if RUNNING_MAX else 0.0, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    n_full = N - N % BLOCK_S
    for n0 in range(0, n_full, BLOCK_S):
        offs_n = n0 + tl.arange(0, BLOCK_S)
        s = _dot_streamed(q0, q1, k_ptr, offs_n, m_ok, skn, D, D0, D1, PRECISION, UPCAST, False)
        m_i, l_i = _sum_update(s, m_i, l_i, scale_log2, RUNNING_MAX)
    if n_full < N:
        offs_n = n_full + tl.arange(0, BLOCK_S)
        n_ok = offs_n < N
        s = _dot_streamed(q0, q1, k_ptr, offs_n, n_ok, skn, D, D0, D1, PRECISION, UPCAST, True)
        if RUNNING_MAX:
            m_i, l_i = _sum_update(tl.where(n_ok[None, :], s, -float("inf")), m_i, l_i, scale_log2, True)
        else:  # scale, then mask: the order the measured kernel has (other orders compile differently)
            l_i += tl.sum(tl.exp2(tl.where(n_ok[None, :], s * scale_log2, -float("inf"))), axis=1)
    return m_i, l_i


# The unshifted sum is kept when every resident row's lies in [2^-60, 2^100). Then no term overflowed (each is below
# 2^100) and a term that underflowed (below 2^-126, flushed or denormal) is under 2^-66 of its row's sum, N of them
# under 2^-46 of it for N <= 2^20: every other term is an exp2 of the same argument as in the max-shifted sum, less
# the row's max, so the two sums (the shifted one scaled back by 2^max) agree to fp32 and exp2 rounding. Otherwise
# (logits above ~100 - log2 N or all below ~-60, in log2 units, or NaN) the block reruns with the running max.
_SUM_LO = tl.constexpr(2.0 ** -60)
_SUM_HI = tl.constexpr(2.0 ** 100)


@triton.jit
def _row_lse_kernel(q_ptr, k_ptr, lse_ptr, sqb, sqh, sqm, skb, skh, skn, H, M, N, scale_log2,
                    D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """Pass 1: out[bh, m] = -lse2, lse2 = log2 sum_n 2^(scale_log2 q.k) (negated: pass 2 adds it in its FFMA) for
    BLOCK_R resident rows: first the sum with no running max, the online form only for a block out of range."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    sqm, skn = sqm * ALIGN, skn * ALIGN  # strides arrive divided by ALIGN (see prefill_salience)
    q_ptr += b.to(tl.int64) * sqb * ALIGN + h.to(tl.int64) * sqh * ALIGN
    k_ptr += b.to(tl.int64) * skb * ALIGN + h.to(tl.int64) * skh * ALIGN
    offs_m = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_ok = offs_m < M
    q0, q1 = _load_resident(q_ptr, offs_m, m_ok, sqm, D, D0, D1, UPCAST)
    _, l_i = _row_sum_exp2(q0, q1, k_ptr, m_ok, skn, N, scale_log2, D, D0, D1, PRECISION, UPCAST, BLOCK_R,
                           BLOCK_S, False)
    lse2 = tl.log2(l_i)
    unsafe = (l_i < _SUM_LO) | (l_i >= _SUM_HI) | (l_i != l_i)  # the last: NaN
    if tl.max(unsafe.to(tl.int32), axis=0) > 0:  # uniform over the block: rare, the whole block reruns
        m_i, l_i = _row_sum_exp2(q0, q1, k_ptr, m_ok, skn, N, scale_log2, D, D0, D1, PRECISION, UPCAST, BLOCK_R,
                                 BLOCK_S, True)
        lse2 = m_i + tl.log2(l_i)
    tl.store(lse_ptr + bh.to(tl.int64) * M + offs_m, -lse2, mask=m_ok)  # negated: pass 2 adds it


@triton.jit
def _neg_lse2(ptr, ok, NEG_LSE2: tl.constexpr, MASKED: tl.constexpr):
    """-LSE in log2 units of a tile's rows (MASKED: rows with ok False read -inf, so exp2 gives exactly 0). Pass 1
    writes it so, which saves one op per column and tile; a caller's natural-log LSE takes an FMUL."""
    if MASKED:
        lse = tl.load(ptr, mask=ok, other=-float("inf") if NEG_LSE2 else float("inf"))
    else:
        lse = tl.load(ptr)
    if NEG_LSE2:
        return lse
    return lse * -_LOG2E


@triton.jit
def _prefill_salience_kernel(q_ptr, k_ptr, lse_ptr, out_ptr, sqb, sqh, sqm, skb, skh, skn, slb, slh,
                             H, M, N, scale_log2, inv_count, D: tl.constexpr, D0: tl.constexpr,
                             D1: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                             ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                             NEG_LSE2: tl.constexpr):
    """Pass 2: out[bh, n] = inv_count * sum_m exp2(scale_log2 k.q - lse2[m]), BLOCK_R resident keys; lse2 = the LSE
    in log2 units: -lse2 as pass 1 writes it (NEG_LSE2) or log2(e) x the caller's natural-log LSE. Full tiles of
    query rows unmasked; a partial last tile's rows past M get -lse2 = -inf, so exp2 gives exactly 0."""
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
    m_full = M - M % BLOCK_S
    for m0 in range(0, m_full, BLOCK_S):
        offs_m = m0 + tl.arange(0, BLOCK_S)
        nlse2 = _neg_lse2(lse_ptr + offs_m, n_ok, NEG_LSE2, False)
        s = _dot_streamed(k0, k1, q_ptr, offs_m, n_ok, sqm, D, D0, D1, PRECISION, UPCAST, False)  # K Q^T
        acc += tl.sum(tl.exp2(s * scale_log2 + nlse2[None, :]), axis=1)
    if m_full < M:
        offs_m = m_full + tl.arange(0, BLOCK_S)
        m_ok = offs_m < M
        nlse2 = _neg_lse2(lse_ptr + offs_m, m_ok, NEG_LSE2, True)
        s = _dot_streamed(k0, k1, q_ptr, offs_m, m_ok, sqm, D, D0, D1, PRECISION, UPCAST, True)
        acc += tl.sum(tl.exp2(s * scale_log2 + nlse2[None, :]), axis=1)
    tl.store(out_ptr + bh.to(tl.int64) * N + offs_n, acc * inv_count, mask=n_ok)


def _split_head_dim(D: int) -> tuple[int, int]:
    """D -> (D0, D1): D0 the largest power of two <= D (at least 16, tl.dot's minimum), D1 a power of two >= 16
    covering the rest (0 when D0 covers D). 72 -> (64, 16), 80 -> (64, 16), 64 -> (64, 0)."""
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


# (resident rows, streamed rows, num_warps, num_stages) for both passes: the best of the H200 sweep at every shape
# (docs/perf_notes.md).
DEFAULT_TILES = (128, 64, 4, 3)
# Register caps (pass 1, pass 2) at DEFAULT_TILES, so 4 programs still share an SM (4 x 128 threads x 120 <= 64K
# registers). Uncapped, ptxas gives pass 1 (the unshifted loop plus its running-max rerun) 150; no spills at 120
# (sm_90a, D = 72 and 80). Pass 2: 115, its own count.
MAXNREG: tuple[int, int] | None = (120, 115)


# Per-call host work (at 1 SigLIP frame a call costs what the host spends launching it): a _Plan built once per
# distinct call; each launch then skips Triton's per-call dispatch after its first (launch.py).
_PLANS = Plans()  # distinct calls kept (an encoder makes a handful); past its limit the table starts over


class _Plan(NamedTuple):
    """What one distinct call launches (built by _plan)."""
    lse_shape: tuple[int, int, int] | None  # (B, H, M) that pass 1 writes; None: the caller's LSE
    copy_lse: bool  # the caller's LSE is not unit-stride along rows: pass a contiguous copy
    part_shape: tuple[int, int, int]  # (B, H, N) per-head column sums that pass 2 writes
    pass1: Launch | None
    pass2: Launch


def _plan(q, k, n_query, lse, scale, tiles) -> _Plan:
    """Checks, tile sizes, grids, constexprs and scalar arguments of a call: see prefill_salience."""
    M = _check(q, k, n_query, lse)
    B, H, _, D = q.shape
    N = k.shape[2]
    scale_log2 = (scale if scale is not None else D ** -0.5) * LOG2E
    d0, d1 = _split_head_dim(D)
    upcast = q.dtype == torch.bfloat16 and INTERPRET
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"  # tf32 is ignored for 16-bit inputs
    res, stream, warps, stages = tiles or DEFAULT_TILES
    streamed_m = min(stream, max(16, triton.next_power_of_2(M)))  # summary mode: 1..few rows (dot needs 16)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    # Triton only learns that an int argument is a multiple of 16; SigLIP's strides (72, 729*72) are multiples of 8.
    # Passing stride // 8, times a constexpr 8 inside, lets it issue 16-byte (cp.async) loads instead of 2-byte ones.
    align = 8 if all(st % 8 == 0 for st in strides) else 1
    strides = tuple(st // align for st in strides)
    meta = dict(D=D, D0=d0, D1=d1, PRECISION=precision, UPCAST=upcast, ALIGN=align, num_warps=warps,
                num_stages=stages)
    cap = (MAXNREG if (res, stream, warps, stages) == DEFAULT_TILES else None) or (None, None)
    pass1 = None
    if lse is None:
        block_m = min(res, max(16, triton.next_power_of_2(M)))
        pass1 = Launch(_row_lse_kernel, (triton.cdiv(M, block_m), B * H), (*strides, H, M, N, scale_log2),
                       dict(BLOCK_R=block_m, BLOCK_S=stream, maxnreg=cap[0], **meta))
        lse_strides = (H * M, M)  # torch.empty(B, H, M)'s
    else:  # strides of what the call passes (deterministic in lse's shape and strides, both in the key)
        lse_strides = (lse if lse.stride(2) == 1 else lse.contiguous()).stride()[:2]
    pass2 = Launch(_prefill_salience_kernel, (triton.cdiv(N, res), B * H),
                   (*strides, *lse_strides, H, M, N, scale_log2, 1.0 / (H * M)),
                   dict(BLOCK_R=res, BLOCK_S=streamed_m, maxnreg=cap[1], NEG_LSE2=lse is None, **meta))
    return _Plan((B, H, M) if lse is None else None, lse is not None and lse.stride(2) != 1, (B, H, N), pass1, pass2)


def prefill_salience(q: torch.Tensor, k: torch.Tensor, *, n_query: int | None = None,
                     lse: torch.Tensor | None = None, scale: float | None = None,
                     tiles: tuple[int, int, int, int] | None = None, direct: bool = True) -> torch.Tensor:
    """Mean attention each key receives: q (B, H, T, D), k (B, H, N, D) -> (B, N) fp32.

    n_query: average over the first n_query rows only (summary tokens); default all T rows. lse: (B, H, n_query)
    fp32 natural-log log-sum-exp of each row's scaled logits, when the caller's attention already computed it: then
    only pass 2 runs. scale: default D ** -0.5. tiles: (resident, streamed, num_warps, num_stages) instead of
    DEFAULT_TILES (MAXNREG applies at DEFAULT_TILES only). direct: after a plan's first launch, skip Triton's
    dispatch (launch.py).
    """
    # Everything _plan reads, the module switches included (benches and tests set them).
    key = (q.shape, k.shape, q.stride(), k.stride(), q.dtype, k.dtype, n_query,
           None if lse is None else (lse.shape, lse.stride(), lse.dtype), scale,
           None if tiles is None else tuple(tiles), DEFAULT_TILES, MAXNREG)
    plan = _PLANS.get_or_build(key, lambda: _plan(q, k, n_query, lse, scale, tiles))
    if plan.pass1 is not None:
        lse = torch.empty(plan.lse_shape, device=q.device, dtype=torch.float32)
        plan.pass1(q, k, lse, direct=direct)
    elif plan.copy_lse:
        lse = lse.contiguous()
    part = torch.empty(plan.part_shape, device=q.device, dtype=torch.float32)
    plan.pass2(q, k, lse, part, direct=direct)
    return part.sum(1)  # (B, N): heads summed outside, so every store above is plain (no atomics)


def prefill_salience_ref(q: torch.Tensor, k: torch.Tensor, *, n_query: int | None = None,
                         lse: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Materialised softmax(q k^T * scale) then the mean over rows and heads, in fp32 (or fp64 for fp64 inputs):
    q (B, H, T, D), k (B, H, N, D) -> (B, N). `lse` is accepted and ignored."""
    M = q.shape[2] if n_query is None else n_query
    dt = torch.promote_types(q.dtype, torch.float32)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    s = q[:, :, :M].to(dt) @ k.to(dt).transpose(-1, -2) * scale  # (B, H, M, N)
    return torch.softmax(s, dim=-1).mean(dim=(1, 2))
