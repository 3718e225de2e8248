"""The W4 GEMV's epilogues (csrc_triton/w4a16_gemv.py and its fused forms): a program's fp32 tile -> its outputs.

`finish` takes the tile of a K split: with split-K the partials meet in a workspace and the last program of a row
block to arrive sums them in split order; PRENORM scales each row by its RMSNorm factor (`prenorm_*`); then
`_store_y` stores by EPI: 0 the plain GEMV (y + bias rounded once); 1 the residual add and the next RMSNorm's share
(w4a16_gemv_norm.py); 2 SwiGLU of the gate/up rows (w4a16_gemv_silu.py); 3 RoPE of q and k and the KV-cache write
(w4a16_gemv_rope.py). Every fused form rounds as the separate launches it replaces do, so it gives their bits.
Device functions only.
"""

from __future__ import annotations

from ._common import INTERPRET_JIT
from ._triton import tl, triton
from .rope_qkv import rope_halves
from .rounding import round_to
from .silu_mul import silu_mul_math


@triton.jit
def _gpu_fence(t, FENCE: tl.constexpr):
    """fence.acq_rel.gpu in every thread that holds part of t (all of them), ordered after its stores."""
    if FENCE:
        t = tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.b32 $0, $1;", "=r,r", [t], dtype=tl.float32,
                                      is_pure=False, pack=1)
    return t


@triton.jit
def prenorm_parts(pin_ptr, NP, M, BLOCK_M: tl.constexpr, NPB: tl.constexpr):
    """The producer's per-row-block sums of squares, pin (NP, 8) fp32, as (NPB, BM) (zero past NP and M)."""
    offs_p = tl.arange(0, NPB)
    offs_m = tl.arange(0, BLOCK_M)
    return tl.load(pin_ptr + offs_p[:, None] * 8 + offs_m[None, :],
                   mask=(offs_p < NP)[:, None] & (offs_m < M)[None, :], other=0.0)


@triton.jit
def prenorm_finish(parts, norm_d, eps):
    """RMSNorm's inverse root of each row, (BM,) fp32: r[m] = rsqrt(sum_p parts[p, m] / D + eps). Every program sums
    the same values in the same order, so all agree on r bit for bit."""
    return tl.rsqrt(tl.sum(parts, axis=0) / norm_d + eps)


@triton.jit
def prenorm_rows(pin_ptr, NP, norm_d, eps, M, BLOCK_M: tl.constexpr, NPB: tl.constexpr):
    """prenorm_finish of prenorm_parts: r (BM,) at once."""
    return prenorm_finish(prenorm_parts(pin_ptr, NP, M, BLOCK_M, NPB), norm_d, eps)


@triton.jit
def _store_kv_rows(pair, b, t, kh, vh, m_ok, d, k_lo, k_hi, v_lo, v_hi, is_k, is_v, HALF_D: tl.constexpr):
    """k halves (rotated) of KV head kh and v halves (raw) of KV head vh, rows (b, t) of tokens m (BM,), dims d and
    d + D/2 (BN/2,), into one cache pair at its slots: pair = (k_ptr, v_ptr, slot_ptr, 3 k strides (b, h, s), 3 v
    strides). A program holds k rows or v rows, never both (is_k, is_v: scalar)."""
    k_ptr, v_ptr, slot_ptr, skb, skh, sks, svb, svh, svs = pair
    slot = tl.load(slot_ptr + t, mask=m_ok, other=0).to(tl.int64)  # (BM,) slot of each token's position
    k_dst = (k_ptr + b * skb + kh * skh + slot * sks)[:, None] + d[None, :]  # (BM, BN/2)
    tl.store(k_dst, k_lo, mask=m_ok[:, None] & is_k)
    tl.store(k_dst + HALF_D, k_hi, mask=m_ok[:, None] & is_k)
    v_dst = (v_ptr + b * svb + vh * svh + slot * svs)[:, None] + d[None, :]
    tl.store(v_dst, v_lo, mask=m_ok[:, None] & is_v)
    tl.store(v_dst + HALF_D, v_hi, mask=m_ok[:, None] & is_v)


@triton.jit
def _rope_halves_as_rope_qkv(x1, x2, c1, c2, s1, s2, dtype: tl.constexpr):
    """rope_qkv.rope_halves as the rope_qkv kernel computes it: (x1, x2, cos and sin halves, all fp32 holding dtype
    values) -> (o1, o2) fp32 holding dtype values. Interpreter: rope_halves itself (ops.rope's roundings).
    GPU: what rope_halves compiles to in the rope_qkv kernel (sm_90a, triton 3.6: LLVM narrows the fp32 ops on
    widened 16-bit values to 16-bit ops, then the first product of each sum is contracted, never rounded), written
    out so that no compiler choice is left:
        o1 = fma(x1, cos1, -rn(x2 sin1))        o2 = fma(x2, cos2, rn(x1 sin2))    (fma.rn.{f16,bf16}, one rounding)
    Compiled from rope_halves here, the choice followed the layouts instead: where x1 and x2 arrived through different
    layout conversions, x1 sin2 was fused in place of x2 cos2, and q and k differed from GEMV + rope_qkv by an ulp.
    (-1.0 * p, not -p: Triton's unary minus is 0 - p, which would turn -0 into +0; LLVM makes it an fneg.)"""
    if INTERPRET_JIT:
        o1, o2 = rope_halves(x1, x2, c1, c2, s1, s2, dtype)
    else:
        a1, a2 = x1.to(dtype), x2.to(dtype)  # exact (the inputs hold dtype values): these casts fold away
        o1 = tl.fma(a1, c1.to(dtype), (a2 * s1.to(dtype)) * -1.0).to(tl.float32)
        o2 = tl.fma(a2, c2.to(dtype), a1 * s2.to(dtype)).to(tl.float32)
    return o1, o2


@triton.jit
def _store_rope(out, offs_m, rows, pid_n, M, bias_ptr, q_ptr, HAS_BIAS: tl.constexpr, rope, D: tl.constexpr,
                SECOND: tl.constexpr):
    """EPI 3: out (BM, BN) fp32 of rows `rows` = [head h dims d | head h dims d + D/2] (d = c BN/2 + i, the program's
    chunk c of the head; mma_tile's row map) -> y = out + bias cast to the dtype as the plain GEMV stores it, then
    as rope_qkv.py does with y as its qkv: q heads [0, H) rotated to q (B, H, T, D) contiguous; k heads [H, H + Hkv)
    rotated and v heads [H + Hkv, H + 2 Hkv) raw to k/v caches (B, Hkv, S, D) at slots[t], and to the second pair
    when SECOND. Token m = b T + t. rope = ((cos, sin (T, D), T, cos/sin row strides, H, Hkv), cache pair, pair 2)."""
    BM: tl.constexpr = out.shape[0]
    HALF: tl.constexpr = out.shape[1] // 2
    dt: tl.constexpr = q_ptr.dtype.element_ty
    tables, pair, pair2 = rope
    cos_ptr, sin_ptr, T, stride_ct, stride_st, H, HKV = tables
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
    # The plain store's cast, not round_to: the interpreter's bf16 cast truncates, and the results must equal
    # rope_qkv run on what the plain GEMV stored (on the GPU both are cvt.rn, the same).
    y = out.to(dt).to(tl.float32)
    x1, x2 = tl.split(tl.permute(tl.reshape(y, (BM, 2, HALF)), (0, 2, 1)))  # (BM, BN/2): dims d, d + D/2
    head = pid_n // (D // (2 * HALF))  # D / BN programs per head
    d = (pid_n % (D // (2 * HALF))) * HALF + tl.arange(0, HALF)
    m_ok = offs_m < M
    b, t = offs_m // T, offs_m % T
    cs = t[:, None] * stride_ct + d[None, :]
    ss = t[:, None] * stride_st + d[None, :]
    c1 = tl.load(cos_ptr + cs, mask=m_ok[:, None], other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + D // 2, mask=m_ok[:, None], other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + ss, mask=m_ok[:, None], other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + ss + D // 2, mask=m_ok[:, None], other=0.0).to(tl.float32)
    o1, o2 = _rope_halves_as_rope_qkv(x1, x2, c1, c2, s1, s2, dt)  # rope_qkv's arithmetic: the same bits
    o1, o2 = o1.to(dt), o2.to(dt)
    q_dst = q_ptr + (((b * H + head) * T + t) * D)[:, None] + d[None, :]  # (B, H, T, D) contiguous
    tl.store(q_dst, o1, mask=m_ok[:, None] & (head < H))
    tl.store(q_dst + D // 2, o2, mask=m_ok[:, None] & (head < H))
    is_k = (head >= H) & (head < H + HKV)
    is_v = head >= H + HKV
    kh, vh = head - H, head - H - HKV  # out of range on the other kinds of head, whose stores are masked off
    v1, v2 = x1.to(dt), x2.to(dt)
    _store_kv_rows(pair, b, t, kh, vh, m_ok, d, o1, o2, v1, v2, is_k, is_v, D // 2)
    if SECOND:  # the packed decode buffer of a SparseVILA turn also receives the new token
        _store_kv_rows(pair2, b, t, kh, vh, m_ok, d, o1, o2, v1, v2, is_k, is_v, D // 2)


@triton.jit
def _store_y(y_ptr, bias_ptr, out, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr, pid_n, res_ptr,
             g_ptr, xg_ptr, pout_ptr, EPI: tl.constexpr, rope=None, ROPE_D: tl.constexpr = 0,
             SECOND: tl.constexpr = False):
    """out (BM, BN) fp32 (+ bias) -> y rows offs_m < M, columns offs_n < N, rounded once to y's dtype.
    EPI 1 (residual add + the next RMSNorm's share): y = o rounded to the dtype (o = out + bias, as EPI 0 stores
    it), h = res + y (fp32 sum rounded once: PyTorch's add) goes to y_ptr, xg = gamma * h (rounded once) to xg_ptr
    (same strides), and the row block's sum of h^2 per row to pout[pid_n, m] (stride 8), for prenorm_rows.
    EPI 2 (SwiGLU): the tile's columns are BN / 2 gate rows then the same BN / 2 up rows (mma_tile's row map);
    y (M, N / 2) = silu(gate) * up of the rounded outputs, PyTorch's roundings (silu_mul.py), columns
    pid_n BN / 2 + j. No bias (the launcher checks). EPI 3 (RoPE + KV-cache write): see _store_rope."""
    if EPI == 3:
        _store_rope(out, offs_m, offs_n, pid_n, M, bias_ptr, y_ptr, HAS_BIAS, rope, ROPE_D, SECOND)
        return
    if EPI == 2:
        BM: tl.constexpr = out.shape[0]
        HALF: tl.constexpr = out.shape[1] // 2
        dt: tl.constexpr = y_ptr.dtype.element_ty
        g, up = tl.split(tl.permute(tl.reshape(round_to(out, dt), (BM, 2, HALF)), (0, 2, 1)))
        j = pid_n * HALF + tl.arange(0, HALF)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + j[None, :], silu_mul_math(g, up, dt).to(dt),
                 mask=(offs_m < M)[:, None] & (j < N // 2)[None, :])
        return
    n_mask = offs_n < N
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & n_mask[None, :]
    offs = offs_m[:, None] * stride_ym + offs_n[None, :]
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    if EPI == 0:
        tl.store(y_ptr + offs, out.to(dtype), mask=mask)
    else:
        res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = tl.where(mask, round_to(round_to(out, dtype) + res, dtype), 0.0)  # zero past N: no share in the sum
        tl.store(y_ptr + offs, h.to(dtype), mask=mask)
        g = tl.load(g_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(xg_ptr + offs, round_to(g[None, :] * h, dtype).to(dtype), mask=mask)
        tl.store(pout_ptr + pid_n * 8 + offs_m, tl.sum(h * h, axis=1), mask=offs_m < M)


@triton.jit
def finish(out, offs_m, offs_n, pid_n, pid_k, M, N, y_ptr, stride_ym, bias_ptr, ws_ptr, lock_ptr, SPLIT_K,
           res_ptr, g_ptr, xg_ptr, pout_ptr, r,
           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FENCE: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, EPI: tl.constexpr, PRENORM: tl.constexpr, rope=None, ROPE_D: tl.constexpr = 0,
           SECOND: tl.constexpr = False):
    """out (BM, BN): this program's fp32 sum for rows offs_m, output columns offs_n (any order) -> y.
    PRENORM: x was gamma * h of an RMSNorm left unnormalised, so out (linear in x) is scaled by each row's
    r = rsqrt(mean(h^2) + eps) (prenorm_finish) before the bias. EPI: see _store_y.
    SPLIT (SPLIT_K > 1): partials go to ws (SPLIT_K, M, N) fp32; the last program of row block pid_n to arrive (an
    acq_rel counter) sums them in split order, so the result does not depend on the arrival order."""
    if PRENORM:
        out = out * r[:, None]
    if not SPLIT:
        _store_y(y_ptr, bias_ptr, out, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, pid_n, res_ptr, g_ptr, xg_ptr,
                 pout_ptr, EPI, rope, ROPE_D, SECOND)
    else:
        ws_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], out, mask=ws_mask)
        out = _gpu_fence(out, FENCE)  # release: every thread's partial stores before the count
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            out = _gpu_fence(out, FENCE)  # acquire in every thread, not only in the one that counted
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(SPLIT_K):  # fixed order: the same sum whichever split came last
                total += tl.load(ws_ptr + (k * M + offs_m[:, None]) * N + offs_n[None, :], mask=ws_mask,
                                 other=0.0, cache_modifier=".cg")
            _store_y(y_ptr, bias_ptr, total, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, pid_n, res_ptr, g_ptr,
                     xg_ptr, pout_ptr, EPI, rope, ROPE_D, SECOND)
            tl.atomic_xchg(lock_ptr + pid_n, 0)  # ready for the next call (or graph replay)
