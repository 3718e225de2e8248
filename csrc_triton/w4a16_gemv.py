"""W4A16 GEMV for decode: y (M, N) = x (M, K) @ W^T + bias, M <= 8, W packed as in tinyvila/quant.py.

Layouts: x (M, K) fp16/bf16 with unit stride along K; qweight int32 (N, K/8), nibble i of word j of
row n is q[n, 8j + i]; scales (N, K/G) in x's dtype; zeros fp32 (N, K/G); w = q * s + b. G in {32, 64, 128}.

Unpack ("magic" numbers, exact): one lop3 (w & mask) | magic drops two nibbles of a word into the mantissas
of a 16-bit pair. fp16: nibbles 0/4 (2/6 after one shift by 8) land at bits 0-3 of each half under 16.0
(ulp 2^-6), nibbles 1/5 (3/7) at bits 4-7 under 1.0 (ulp 2^-10): v = m + q u with m = 16 at even k, 1 at
odd k, u = 1/64; one shift and four lop3 per 8 weights. bf16 (7 mantissa bits): every pair is shifted to
bits 0-3 under 16.0 (ulp 2^-3): m = 16, u = 1/8. Then, per group g of row n (fp32 sums, w never rounded):

    sum_k x_k w_k = s (sum q x) + b X = (s / u) (sum_k v_k x_k - Xm) + b X,   X = sum x,  Xm = sum m x.

Two kernels share this math and the epilogue:
- "mma" (G = 128, K % 128 == 0; the GPU default): the v tile is the *register* operand A of mma.sync, built
  in the order that is exactly mma's operand layout (_mma_operand): Triton reads the words from shared memory
  straight into it, and the tensor cores do every multiply-add (~1 integer op per weight to unpack). A K step
  covers GPS groups (64 GPS contiguous bytes of each row) in GPS dots (BLOCK_N, 128) x (128, 8), all against
  one B holding the step's groups of x side by side (column jg BM + m: row m of x over group jg); dot jg keeps
  its own group's columns (_shared_x_dots), so the per-group scales are one (BN, 8) multiply (_step_scales).
  x is loaded contiguously as int32 pairs (pipelined with cp.async like the weights) and lands in mma's B
  layout with no shuffle (_x_shared); the x-only terms (Xm, X) of each step's groups, with their zero points,
  are added in that step (_step_zero_terms). Addresses are each step's scalar base plus loop-invariant offsets.
- "fma" (any G): the fp16 magic values (for either x dtype) widened to fp32 (cvt), fp32 FMAs against x,
  summed per 32-value chunk that one thread holds (4 words: one 16-byte load), scaled per chunk.
  ~4.2 SASS instructions per weight: the fallback for groups of 32 and 64.
Split-K (SPLIT_K > 1; row blocks too few to fill the GPU): every program stores an fp32 partial; the
last to arrive at its row block's counter sums the partials in split order (deterministic, whichever
arrives last), adds the bias, stores y and resets the counter. No host sync, no autotuning, no per-call
allocation (workspace and counters persist per device), so a call can be captured in a CUDA graph after
one eager call of the same shape. One CUDA stream at a time per device (shared counters).
Epilogues (EPI, _store_y): 0 plain; 1 residual add + the next RMSNorm's share (w4a16_gemv_norm); 2 SwiGLU
(w4a16_gemv_silu); 3 RoPE of q and k + the KV-cache write of k and v (w4a16_gemv_rope, its own kernel entry
_w4a16_gemv_rope_kernel). 2 and 3 (mma only) give each program rows that pair up by a row map (_mma_tile).
Configs: a fixed table (GEMV_TABLE, else a rule: gemv_config) from the H200 sweep (scripts/benches/w4a16.py,
TINYVILA_W4_SWEEP=1).
Limits: M <= 8 (larger M: w4a16_gemm), K % G == 0, N * K / 8 < 2^31.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl
from .rope_qkv import _check as _rope_check
from .rope_qkv import rope_halves
from .rounding import INTERPRET as ROUND_INTERPRET  # the interpreter flag as a constexpr, for jit code
from .rounding import round_to
from .silu_mul import silu_mul_math

GROUP_SIZES = (32, 64, 128)
MAX_M = 8
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# unpack_k_order (q in K order, as fp32) serves w4a16_dequant; the GEMV kernels use _magic_planes below.
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


# -- shared: magic unpack, scales, epilogue ---------------------------------------------------------------
def _magic_asm(out: str, magic: tuple[int, ...]) -> str:
    """PTX for one word ($8) -> its 8 nibbles as v = m + q u ($0..$7 = nibbles 0..7), two per lop3
    (src & mask) | magic. fp16 (two magics: 16.0 and 1.0): nibbles 0/4 and, after a shift by 8, 2/6 sit at
    bits 0-3 of each half, under 16.0; 1/5 and 3/7 at bits 4-7, under 1.0. bf16 (one magic, 16.0) has only
    7 mantissa bits, so every nibble pair is first shifted to bits 0-3 (by 0, 4, 8, 12).
    out == "f32": each 16-bit value widened exactly by cvt.f32.f16 ($8 the word); out == "pairs": the lop3
    results themselves, $i = (v_i, v_{i + 4}) as one 32-bit register ($4 the word), split into 16-bit
    planes by _word_halves. Handing ptxas whole 32-bit results (rather than "=h" halves from a mov.b32 {lo, hi})
    lets it use them as mma's operand registers directly: no IMAD.MOV re-pairing (docs/perf_notes.md,
    session 11)."""
    word = "$4" if out == "pairs" else "$8"
    lines = [".reg .b32 t, p;", ".reg .b16 lo, hi;"] if out == "f32" else [".reg .b32 t;"]
    if len(magic) == 2:  # (shift, mask, magic) for nibble pairs (0, 4), (1, 5), (2, 6), (3, 7)
        steps = [(0, 0x000F000F, magic[0]), (0, 0x00F000F0, magic[1]), (8, 0x000F000F, magic[0]),
                 (8, 0x00F000F0, magic[1])]
    else:
        steps = [(4 * i, 0x000F000F, magic[0]) for i in range(4)]
    for i, (shift, mask, c) in enumerate(steps):
        if shift and (i == 0 or steps[i - 1][0] != shift):
            lines.append(f"shr.u32 t, {word}, {shift};")
        src = "t" if shift else word
        if out == "f32":
            lines += [f"lop3.b32 p, {src}, {mask:#010x}, {c:#010x}, 0xEA;", "mov.b32 {lo, hi}, p;",
                      f"cvt.f32.f16 ${i}, lo;", f"cvt.f32.f16 ${i + 4}, hi;"]
        else:
            lines.append(f"lop3.b32 ${i}, {src}, {mask:#010x}, {c:#010x}, 0xEA;")
    return "{\n" + "\n".join(lines) + "\n}"


_MAGIC_F32 = tl.constexpr(_magic_asm("f32", (0x4C004C00, 0x3C003C00)))  # fp16 pairs 16.0, 1.0 -> fp32
_MAGIC_F16 = tl.constexpr(_magic_asm("pairs", (0x4C004C00, 0x3C003C00)))  # fp16 pairs 16.0, 1.0
_MAGIC_BF16 = tl.constexpr(_magic_asm("pairs", (0x41804180,)))  # bf16 pairs 16.0


@triton.jit
def _word_halves(p, dtype):
    """int32 words -> their low and high 16-bit halves as `dtype`, a bitcast each (no mask: the int16 cast
    drops the high bits and the shifted-in sign bits). For a 16-bit tensor viewed as int32: the elements at even
    and odd positions (little-endian)."""
    return p.to(tl.int16).to(dtype, bitcast=True), (p >> 16).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _magic_planes(words, dtype, UNPACK: tl.constexpr):
    """(R, W) int32 words -> 8 (R, W) tensors v_i = m_i + q_i u of nibble i in `dtype`, all exact: fp32 and
    fp16 u = 1/64, m = 16 at even i and 1 at odd i; bf16 u = 1/8, m = 16. UNPACK=1: the PTX block (GPU);
    0: plain shifts and masks (interpreter), the same values."""
    if UNPACK == 1:
        if dtype == tl.float32:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                _MAGIC_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(_MAGIC_BF16 if dtype == tl.bfloat16 else _MAGIC_F16,
                                                       "=r,=r,=r,=r,r", [words], dtype=(tl.int32,) * 4,
                                                       is_pure=True, pack=1)
            v0, v4 = _word_halves(p0, dtype)
            v1, v5 = _word_halves(p1, dtype)
            v2, v6 = _word_halves(p2, dtype)
            v3, v7 = _word_halves(p3, dtype)
    else:
        u: tl.constexpr = 0.125 if dtype == tl.bfloat16 else 0.015625
        m_odd: tl.constexpr = 16.0 if dtype == tl.bfloat16 else 1.0
        v0 = ((words & 0xF).to(tl.float32) * u + 16.0).to(dtype)
        v1 = (((words >> 4) & 0xF).to(tl.float32) * u + m_odd).to(dtype)
        v2 = (((words >> 8) & 0xF).to(tl.float32) * u + 16.0).to(dtype)
        v3 = (((words >> 12) & 0xF).to(tl.float32) * u + m_odd).to(dtype)
        v4 = (((words >> 16) & 0xF).to(tl.float32) * u + 16.0).to(dtype)
        v5 = (((words >> 20) & 0xF).to(tl.float32) * u + m_odd).to(dtype)
        v6 = (((words >> 24) & 0xF).to(tl.float32) * u + 16.0).to(dtype)
        v7 = (((words >> 28) & 0xF).to(tl.float32) * u + m_odd).to(dtype)  # the mask drops the sign bits
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _load_scales(s_ptr, idx, mask, dtype: tl.constexpr, S_PAIRS: tl.constexpr, MASKED: tl.constexpr):
    """scales[idx] as fp32. S_PAIRS: s_ptr is the scales viewed as int32 (two 16-bit scales per word), so the
    load is 4 bytes wide and Triton can stage it through shared memory with cp.async like the others."""
    if S_PAIRS:
        if MASKED:
            pair = tl.load(s_ptr + (idx >> 1), mask=mask, other=0)
        else:
            pair = tl.load(s_ptr + (idx >> 1))
        bits = (pair >> ((idx & 1) * 16)) & 0xFFFF  # little-endian: the even index is the low half
        s = bits.to(tl.int16).to(dtype, bitcast=True)
    else:
        if MASKED:
            s = tl.load(s_ptr + idx, mask=mask, other=0)
        else:
            s = tl.load(s_ptr + idx)
    return s.to(tl.float32)


@triton.jit
def _gpu_fence(t, FENCE: tl.constexpr):
    """fence.acq_rel.gpu in every thread that holds part of t (all of them), ordered after its stores."""
    if FENCE:
        t = tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.b32 $0, $1;", "=r,r", [t], dtype=tl.float32,
                                      is_pure=False, pack=1)
    return t


@triton.jit
def _prenorm_parts(pin_ptr, NP, M, BLOCK_M: tl.constexpr, NPB: tl.constexpr):
    """The producer's per-row-block sums of squares, pin (NP, 8) fp32, as (NPB, BM) (zero past NP and M)."""
    offs_p = tl.arange(0, NPB)
    offs_m = tl.arange(0, BLOCK_M)
    return tl.load(pin_ptr + offs_p[:, None] * 8 + offs_m[None, :],
                   mask=(offs_p < NP)[:, None] & (offs_m < M)[None, :], other=0.0)


@triton.jit
def _prenorm_finish(parts, norm_d, eps):
    """RMSNorm's inverse root of each row, (BM,) fp32: r[m] = rsqrt(sum_p parts[p, m] / D + eps). Every program
    sums the same values in the same order, so all agree on r bit for bit."""
    return tl.rsqrt(tl.sum(parts, axis=0) / norm_d + eps)


@triton.jit
def _prenorm_rows(pin_ptr, NP, norm_d, eps, M, BLOCK_M: tl.constexpr, NPB: tl.constexpr):
    """_prenorm_finish of _prenorm_parts: r (BM,) at once."""
    return _prenorm_finish(_prenorm_parts(pin_ptr, NP, M, BLOCK_M, NPB), norm_d, eps)


@triton.jit
def _store_kv_rows(pair, b, t, kh, vh, m_ok, d, k_lo, k_hi, v_lo, v_hi, is_k, is_v, HALF_D: tl.constexpr):
    """k halves (rotated) of KV head kh and v halves (raw) of KV head vh, rows (b, t) of tokens m (BM,), dims d
    and d + D/2 (BN/2,), into one cache pair at its slots: pair = (k_ptr, v_ptr, slot_ptr, 3 k strides (b, h, s),
    3 v strides). A program holds k rows or v rows, never both (is_k, is_v: scalar)."""
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
    """rope_qkv.rope_halves as the rope_qkv kernel computes it, for the RoPE epilogue: (x1, x2, cos and sin halves,
    all fp32 holding dtype values) -> (o1, o2) fp32 holding dtype values.
    Interpreter: rope_halves itself (ops.rope's roundings of each product and of the sum).
    GPU: what rope_halves compiles to in the rope_qkv kernel (sm_90a, triton 3.6: LLVM narrows the fp32 ops on
    widened 16-bit values to 16-bit ops, and the backend then contracts the first product of each sum into it,
    so that product is never rounded), written out so that no compiler choice is left:
        o1 = fma(x1, cos1, -rn(x2 sin1))        o2 = fma(x2, cos2, rn(x1 sin2))    (fma.rn.{f16,bf16}, one rounding)
    Compiled from rope_halves here, the choice followed the layouts instead: where x1 and x2 reached it through
    different layout conversions (x1 as 16-bit values, x2 as fp32: M >= 3, two 16-row tiles per warp, no split),
    x1 sin2 was fused in place of x2 cos2, and q and k differed from GEMV + rope_qkv by an ulp (H200, BLOCK_N 128).
    (-1.0 * p, not -p: Triton's unary minus is 0 - p, which would turn -0 into +0; LLVM makes it an fneg.)"""
    if ROUND_INTERPRET:
        o1, o2 = rope_halves(x1, x2, c1, c2, s1, s2, dtype)
    else:
        a1, a2 = x1.to(dtype), x2.to(dtype)  # exact (the inputs hold dtype values): these casts fold away
        o1 = tl.fma(a1, c1.to(dtype), (a2 * s1.to(dtype)) * -1.0).to(tl.float32)
        o2 = tl.fma(a2, c2.to(dtype), a1 * s2.to(dtype)).to(tl.float32)
    return o1, o2


@triton.jit
def _store_rope(out, offs_m, rows, pid_n, M, bias_ptr, q_ptr, HAS_BIAS: tl.constexpr, rope, D: tl.constexpr,
                SECOND: tl.constexpr):
    """EPI 3: out (BM, BN) fp32 of rows `rows` = [head h dims d | head h dims d + D/2] (d = c BN/2 + i, the
    program's chunk c of the head; _mma_tile's row map) -> y = out + bias cast to the dtype exactly as the plain
    GEMV stores it, then as csrc_triton/rope_qkv.py does with y as its qkv: q heads [0, H) rotated to q (B, H, T, D)
    contiguous; k heads [H, H + Hkv) rotated and v heads [H + Hkv, H + 2 Hkv) raw to k/v caches (B, Hkv, S, D) at
    slots[t], and to the second pair at its own slots when SECOND. Token m = b T + t. rope = ((cos, sin (T, D),
    T, cos/sin row strides, H, Hkv), first cache pair, second cache pair) (see _store_kv_rows)."""
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
    EPI 1 (the residual stream's add and the next RMSNorm's share of it): y = o rounded to the dtype
    (o = out + bias, as EPI 0 stores it), h = res + y (fp32 sum rounded once: PyTorch's add) goes to y_ptr,
    xg = gamma * h (rounded once) to xg_ptr (same strides), and the row block's sum of h^2 per row to
    pout[pid_n, m] (stride 8), for the consumer's _prenorm_rows.
    EPI 2 (SwiGLU, the fused gate/up projection): the tile's columns are BN / 2 gate rows then the same BN / 2
    up rows (_mma_tile's row map); y (M, N / 2) = silu(gate) * up of the rounded outputs, PyTorch's roundings
    (csrc_triton/silu_mul.py), columns pid_n BN / 2 + j. No bias (the launcher checks).
    EPI 3 (RoPE and the KV-cache write, the fused qkv projection): offs_n are the tile's rows (_mma_tile's row
    map: BN / 2 dims of one head's first half, then the same dims of its second half); see _store_rope."""
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
def _finish(out, offs_m, offs_n, pid_n, pid_k, M, N, y_ptr, stride_ym, bias_ptr, ws_ptr, lock_ptr, SPLIT_K,
            res_ptr, g_ptr, xg_ptr, pout_ptr, r,
            HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FENCE: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, EPI: tl.constexpr, PRENORM: tl.constexpr, rope=None, ROPE_D: tl.constexpr = 0,
            SECOND: tl.constexpr = False):
    """out (BM, BN): this program's fp32 sum for rows offs_m, output columns offs_n (any order) -> y.
    PRENORM: x was gamma * h of an RMSNorm left unnormalised, so out (linear in x) is scaled by each row's
    r = rsqrt(mean(h^2) + eps) (_prenorm_finish; the mma kernel loads the sums before its K loop and reduces them
    after it, so their round trip hides under the weights' and the first weight loads do not wait for it) before
    the bias. EPI: see _store_y.
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


# -- "fma" kernel: fp32 FMAs per 32-value chunk ------------------------------------------------------------
@triton.jit
def _chunk_sums(words, x, s, b, UNPACK: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr):
    """sum_k x_k w_k over each 32-value chunk (4 words, one thread's 16-byte load) of a tile: words
    (BN, 4 CH) int32, x (32 CH,) fp32 in K order, s and b (BN, CH) fp32 -> (BN, CH)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _magic_planes(words, tl.float32, UNPACK)
    # interleave(a, b) puts a at even and b at odd positions of the last axis, so three levels give
    # position 8 j + i = nibble i of word j, with each thread's values kept in its own registers.
    even = tl.interleave(tl.interleave(v0, v4), tl.interleave(v2, v6))
    v = tl.interleave(even, tl.interleave(tl.interleave(v1, v5), tl.interleave(v3, v7)))  # (BN, 32 CH)
    p = tl.sum(tl.reshape(v * x[None, :], (BLOCK_N, CH, 32)), axis=2)  # (BN, CH) sum v x
    x_eo = tl.sum(tl.reshape(x, (CH, 16, 2)), axis=1)  # (CH, 2): sums of x at even and odd k
    x_even, x_odd = tl.split(x_eo)
    xm64 = 1024.0 * x_even + 64.0 * x_odd  # 64 Xm (m = 16 at even k, 1 at odd), shared by all rows
    return s * (64.0 * p - xm64[None, :]) + b * (x_even + x_odd)[None, :]


@triton.jit
def _w4a16_gemv_fma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr, res_ptr, g_ptr, xg_ptr,
                           pout_ptr, pin_ptr, NP_IN, norm_d, eps, M, N, stride_xm,
                           stride_ym, K8, NG, W_SPLIT, SPLIT_K, LOG_WPG, BLOCK_M: tl.constexpr,
                           HAS_BIAS: tl.constexpr, UNPACK: tl.constexpr, S_PAIRS: tl.constexpr,
                           EVEN: tl.constexpr, FENCE: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_W: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, EPI: tl.constexpr,
                           PRENORM: tl.constexpr, NPB: tl.constexpr, PDL: tl.constexpr):
    # K8 = K / 8, NG = K / G and W_SPLIT come in as arguments (not computed) so Triton sees their
    # divisibility by 16 and issues 16-byte loads along the packed rows.
    BLOCK_K: tl.constexpr = BLOCK_W * 8
    CH: tl.constexpr = BLOCK_W // 4  # 32-value chunks per row and tile
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, CH)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    w_lo = pid_k * W_SPLIT
    w_hi = tl.minimum(w_lo + W_SPLIT, K8)  # this program's words [w_lo, w_hi) of every row
    pdl.enter(PDL)  # a decode-step kernel (csrc_triton/pdl.py): nothing is read before the previous one is done
    if PRENORM:
        r = _prenorm_rows(pin_ptr, NP_IN, norm_d, eps, M, BLOCK_M, NPB)
    else:
        r = tl.zeros((BLOCK_M,), dtype=tl.float32)  # unused
    # int32 offsets (the launcher checks N * K8 < 2^31); pointers advance by one tile per iteration.
    w_ptrs = qw_ptr + offs_n[:, None] * K8 + w_lo + offs_w[None, :]  # (BN, BW)
    x_ptrs = x_ptr + w_lo * 8 + offs_k  # (BK,)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, CH), dtype=tl.float32)  # per row and chunk slot: summed at the end
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, CH), dtype=tl.float32)
    for w0 in tl.range(w_lo, w_hi, BLOCK_W, num_stages=STAGES):
        # (BN, CH): each chunk's group (2^LOG_WPG = G / 8 words per group, a runtime argument so the group
        # size does not multiply compiled variants; a chunk of 4 words never straddles groups as G >= 32)
        meta = offs_n[:, None] * NG + ((w0 + 4 * offs_c) >> LOG_WPG)[None, :]
        if EVEN:
            words = tl.load(w_ptrs)  # (BN, BW)
            s = _load_scales(s_ptr, meta, meta, x_ptr.dtype.element_ty, S_PAIRS, False)
            b = tl.load(z_ptr + meta)
        else:
            words = tl.load(w_ptrs, mask=n_mask[:, None] & ((w0 + offs_w) < w_hi)[None, :], other=0)
            c_mask = n_mask[:, None] & ((w0 + 4 * offs_c) < w_hi)[None, :]
            s = _load_scales(s_ptr, meta, c_mask, x_ptr.dtype.element_ty, S_PAIRS, True)
            b = tl.load(z_ptr + meta, mask=c_mask, other=0.0)
        for m in tl.static_range(BLOCK_M):
            if EVEN and BLOCK_M == 1:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs + m * stride_xm, mask=((w0 * 8 + offs_k) < w_hi * 8) & (m < M), other=0.0)
            part = _chunk_sums(words, x.to(tl.float32), s, b, UNPACK, BLOCK_N, CH)
            if BLOCK_M == 1:
                acc += part
            else:
                acc = tl.where((offs_m == m)[:, None, None], acc + part[None, :, :], acc)
        w_ptrs += BLOCK_W
        x_ptrs += BLOCK_K
    if BLOCK_M == 1:
        acc = acc[None, :, :]
    out = tl.sum(acc, axis=2)  # (BM, BN)
    _finish(out, offs_m, offs_n, pid_n, pid_k, M, N, y_ptr, stride_ym, bias_ptr, ws_ptr, lock_ptr, SPLIT_K,
            res_ptr, g_ptr, xg_ptr, pout_ptr, r, HAS_BIAS, SPLIT, FENCE, BLOCK_M, BLOCK_N, EPI, PRENORM)


# -- "mma" kernel: tensor cores, G = 128 -------------------------------------------------------------------
# mma.sync's A operand (m16n8k16, here kWidth 4) wants thread (g, t) (g = lane / 4, t = lane % 4) to hold
# rows g and g + 8 of a 16-row tile and, per 32 dot positions, positions 4t..4t+3 and 16+4t..16+4t+3. With
# the dot's k order p = 64 j1 + 32 j0 + 16 c0 + 8 j3 + 4 j2 + 2 c1 + e for nibble c + 4e (c = c0 + 2 c1) of
# word j = j0 + 2 j1 + 4 j2 + 8 j3 (k = 8 j + c + 4 e), a thread's 32 positions of a group are exactly the
# 8 nibbles of 4 consecutive words 4t..4t+3 of one row (one 16-byte shared-memory read), and adjacent p
# (e = 0, 1) are nibbles c and c + 4: the 16-bit pair one lop3 makes. So the unpacked values are born in
# mma's register layout: Triton loads the words tile from shared memory straight into that layout, and the
# joins, reshapes and the permute below only rename registers (sm_90 TTGIR: no layout conversion, no
# shared-memory round trip for A). In this order positions 4t..4t+3 hold nibbles c0, c0 + 4, c0 + 2, c0 + 6;
# with c0 and c1 swapped (c0, c0 + 4, c0 + 1, c0 + 5) ptxas needed more moves to assemble the operand quads
# (offline sm_90a SASS, gate_up tile: 131 instead of 87 IMAD per K step). A K step's A holds its GPS groups
# side by side, group jg at 128 jg + p (jg is a register index). Rows are in memory order (the shared-memory
# read can serve any row to any thread); the words tile is group-major, (GPS, BN, 16), so its rows are 64
# bytes apart in shared memory and the 8 rows a warp reads at once fall in distinct banks.
@triton.jit
def _mma_operand(words, dtype, UNPACK: tl.constexpr):
    """(GPS, BN, 16) words (group jg of each row) -> A (BN, 128 GPS) magic values, k order 128 jg + p."""
    GPS: tl.constexpr = words.shape[0]
    BN: tl.constexpr = words.shape[1]
    v0, v1, v2, v3, v4, v5, v6, v7 = _magic_planes(words, dtype, UNPACK)
    t = tl.join(tl.join(tl.join(v0, v4), tl.join(v1, v5)), tl.join(tl.join(v2, v6), tl.join(v3, v7)))
    t = tl.reshape(t, (GPS, BN, 2, 2, 2, 2, 2, 2, 2))  # [jg, n, j3, j2, j1, j0, e, c0, c1]
    t = tl.permute(t, (1, 0, 4, 5, 7, 2, 3, 8, 6))  # [n, jg, j1, j0, c0, j3, j2, c1, e]
    return tl.reshape(t, (BN, 128 * GPS))


# The x operand: GPS dots of (BN, 128) x (128, 8) per K step, all with one B = x of the step's groups side by
# side (column jg BM + m: row m of x over group jg). Dot jg's column block jg is group jg's sum; its other
# columns (W_jg x_j) are dropped by a select. B is 1024 values per step, and Triton loads it from the
# cp.async'd x tile straight into mma's operand layout (4 LDS.128 + 16 PRMT per thread; sm_90 TTGIR: no
# layout conversion): a thread of mma's B layout holds 32 consecutive x values of its column's group, so
# the x tile needs no shuffle. (One dot against a block-diagonal B of all GPS groups went through shared
# memory again and was slower: docs/perf_notes.md, session 5.)
@triton.jit
def _x_shared(pairs, dtype, BLOCK_M: tl.constexpr, GPS: tl.constexpr):
    """x of GPS groups as (BM, 64 GPS) int32 pairs in K order -> B (128, 8) in _mma_operand's k order: row p,
    column jg BM + m holds x[m] at the k of position p of group jg; columns >= GPS BM repeat the others
    (finite; _shared_x_dots discards their sums). x is loaded contiguously (4-byte elements, which Triton
    pipelines with cp.async like the weights) and permuted here in registers: gathering it in p order would
    take 2-byte loads that cannot be pipelined, i.e. one exposed memory round trip per K step."""
    lo, hi = _word_halves(pairs, dtype)
    x = tl.reshape(tl.join(lo, hi), (BLOCK_M, GPS, 2, 2, 2, 2, 2, 2, 2))  # [m, jg, j3, j2, j1, j0, e, c1, c0]
    x = tl.permute(x, (4, 5, 8, 2, 3, 7, 6, 1, 0))  # [j1, j0, c0, j3, j2, c1, e, jg, m]: p, then columns
    y = tl.reshape(x, (128, GPS * BLOCK_M))
    if GPS * BLOCK_M < 8:
        R: tl.constexpr = 8 // (GPS * BLOCK_M)
        y = tl.reshape(tl.broadcast_to(y[:, None, :], (128, R, GPS * BLOCK_M)), (128, 8))
    return y


@triton.jit
def _group_operand(a, jg: tl.constexpr, GPS: tl.constexpr):
    """Group jg's columns (BN, 128) of a step's A (BN, 128 GPS) (k order 128 jg + p; jg is a register index of
    mma's operand layout, so the splits only rename registers). GPS in {2, 4, 8}."""
    BN: tl.constexpr = a.shape[0]
    if GPS == 2:  # [n, b0, p] -> [n, p, b0]
        t = tl.permute(tl.reshape(a, (BN, 2, 128)), (0, 2, 1))
    elif GPS == 4:  # [n, b1, b0, p] -> [n, p, b0, b1]: tl.split takes the last axis, the top bit of jg first
        t = tl.permute(tl.reshape(a, (BN, 2, 2, 128)), (0, 3, 2, 1))
    else:
        t = tl.permute(tl.reshape(a, (BN, 2, 2, 2, 128)), (0, 4, 3, 2, 1))
    for level in tl.static_range(GPS.bit_length() - 1):
        t0, t1 = tl.split(t)
        if (jg >> (GPS.bit_length() - 2 - level)) & 1:
            t = t1
        else:
            t = t0
    return t


@triton.jit
def _shared_x_dots(a, xs, BLOCK_M: tl.constexpr, GPS: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """A (BN, 128 GPS) (_mma_operand) and B (128, 8) (_x_shared) -> (BN, 8) fp32: column jg BM + m holds
    sum_p A[n, 128 jg + p] B[p, jg BM + m], group jg's dot sum; columns >= GPS BM hold zero."""
    BN: tl.constexpr = a.shape[0]
    col_group = tl.arange(0, 8)[None, :] // BLOCK_M
    step = tl.zeros((BN, 8), dtype=tl.float32)
    for jg in tl.static_range(GPS):
        if GPS == 1:
            ag = a
        else:
            ag = _group_operand(a, jg, GPS)
        step = tl.where(col_group == jg, _dot(ag, xs, UPCAST_DOT), step)
    return step


@triton.jit
def _step_scales(s_ptr, idx, dtype, S_PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, GPS: tl.constexpr):
    """Scales of groups idx + jg (jg < GPS; idx (BN,) a multiple of GPS) as (BN, 8) fp32 in the columns of
    _shared_x_dots' sums: column jg BM + m holds s[idx + jg]; columns of groups >= GPS (whose dot sums are
    exactly zero) repeat the others. GPS >= 2: s_ptr is the scales as int32 pairs, one load of GPS / 2."""
    BN: tl.constexpr = idx.shape[0]
    J: tl.constexpr = 8 // BLOCK_M
    if GPS == 1:
        s = _load_scales(s_ptr, idx, idx, dtype, S_PAIRS, False)[:, None]  # (BN, 1)
    else:
        pair_idx = tl.multiple_of(idx >> 1, GPS // 2)
        lo, hi = _word_halves(tl.load(s_ptr + pair_idx[:, None] + tl.arange(0, GPS // 2)[None, :]), dtype)
        s = tl.reshape(tl.join(lo, hi), (BN, GPS)).to(tl.float32)
    return tl.reshape(tl.broadcast_to(s[:, None, :, None], (BN, J // GPS, GPS, BLOCK_M)), (BN, 8))


@triton.jit
def _dot(a, b, UPCAST_DOT: tl.constexpr):
    """(BN, K) x (K, 8) -> (BN, 8) fp32 on the tensor cores. UPCAST_DOT (interpreter): Triton 3.6's
    interpreter multiplies bf16 tiles as raw integers, so both operands are widened to fp32 there (exact)."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _pair_sums(pairs, dtype):
    """(BM, G, 64) int32 pairs of x (even k low, odd k high) -> fp32 sums over each group's even k and
    odd k, (BM, G) each: the x-only parts of a group's zero-point terms."""
    lo, hi = _word_halves(pairs, dtype)
    return tl.sum(lo.to(tl.float32), axis=2), tl.sum(hi.to(tl.float32), axis=2)


@triton.jit
def _step_zero_terms(pairs, z_ptr, idx, s8, dtype, U: tl.constexpr, M_ODD: tl.constexpr, BLOCK_M: tl.constexpr,
                     GPS: tl.constexpr):
    """The x-only terms of one K step's GPS groups in _shared_x_dots' column layout, (BN, 8) fp32 in units of
    u: u b[n, g] X[m, g] - s[n, g] Xm[m, g] in column jg BM + m (zero in the columns of groups >= GPS, whose
    dot sums are zero too). pairs: the step's x as (BM, 64 GPS) int32 pairs (even k low, odd k high), so
    X = sum lo + sum hi and Xm = 16 sum lo + M_ODD sum hi; s8: the step's scales (_step_scales); zeros of
    groups idx + jg loaded here (GPS values per row, one load, pipelined like the step's other loads, so no
    memory round trip outside the pipeline: a per-program prologue over all groups cost the qkv shape's
    4-step programs 11.7 vs 10.4 us, session 4)."""
    BN: tl.constexpr = idx.shape[0]
    J: tl.constexpr = 8 // BLOCK_M
    x_even, x_odd = _pair_sums(tl.reshape(pairs, (BLOCK_M, GPS, 64)), dtype)  # (BM, GPS)
    b = tl.load(z_ptr + idx[:, None] + tl.arange(0, GPS)[None, :])  # (BN, GPS)
    b8 = tl.reshape(tl.broadcast_to(b[:, None, :, None], (BN, J // GPS, GPS, BLOCK_M)), (BN, 8))
    xs = tl.trans(x_even + x_odd)  # (GPS, BM)
    xms = tl.trans(16.0 * x_even + M_ODD * x_odd)
    col_ok = tl.arange(0, 8) < GPS * BLOCK_M
    X8 = tl.where(col_ok, tl.reshape(tl.broadcast_to(xs[None, :, :], (J // GPS, GPS, BLOCK_M)), (8,)), 0.0)
    Xm8 = tl.where(col_ok, tl.reshape(tl.broadcast_to(xms[None, :, :], (J // GPS, GPS, BLOCK_M)), (8,)), 0.0)
    return (U * b8) * X8[None, :] - s8 * Xm8[None, :]


@triton.jit
def _mma_tile(pid_n, pid_k, x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr, res_ptr, g_ptr, xg_ptr,
              pout_ptr, pin_ptr, NP_IN, norm_d, eps, M, N, stride_xm,
              stride_ym, K8, NG, W_SPLIT, SPLIT_K, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
              UNPACK: tl.constexpr, S_PAIRS: tl.constexpr, FENCE: tl.constexpr, UPCAST_DOT: tl.constexpr,
              BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, GPS: tl.constexpr,
              EPI: tl.constexpr, PRENORM: tl.constexpr, NPB: tl.constexpr, WRAP: tl.constexpr, TRIGGER: tl.constexpr = 0,
              PDL: tl.constexpr = False, rope=None, ROPE_D: tl.constexpr = 0, SECOND: tl.constexpr = False):
    """Row block pid_n, K split pid_k of the mma kernel: y (or its split-K partial) for BLOCK_N rows. Each K
    step: GPS groups' words -> A (_mma_operand), GPS dots against the step's x (_shared_x_dots), scaled per
    group and column (_step_scales), plus the step's x-only terms (_step_zero_terms). WRAP: N % BLOCK_N != 0,
    so the last row block's plain rows past N wrap around (the launcher sets it; SwiGLU and RoPE tiles never
    wrap: silu_ok, rope_ok)."""
    dtype = y_ptr.dtype.element_ty
    U_INV: tl.constexpr = 8.0 if dtype == tl.bfloat16 else 64.0  # 1 / u of the magic values (_magic_planes)
    M_ODD: tl.constexpr = 16.0 if dtype == tl.bfloat16 else 1.0  # their m at odd k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EPI == 2:  # SwiGLU: BN / 2 gate rows j, then up rows N / 2 + j (the epilogue pairs them)
        HALF: tl.constexpr = BLOCK_N // 2
        i = tl.arange(0, BLOCK_N)
        rows = pid_n * HALF + i % HALF + tl.where(i >= HALF, N // 2, 0)  # never wraps: N / 2 is whole half-tiles
    elif EPI == 3:  # RoPE: BN / 2 dims d of one head's first half, then dims d + D / 2 (the epilogue pairs them)
        HALF: tl.constexpr = BLOCK_N // 2
        CHUNKS: tl.constexpr = ROPE_D // BLOCK_N  # programs per head
        i = tl.arange(0, BLOCK_N)
        rows = ((pid_n // CHUNKS) * ROPE_D + (pid_n % CHUNKS) * HALF + i % HALF
                + tl.where(i >= HALF, ROPE_D // 2, 0))
        cols = rows  # the bias and the split-K partials are indexed by row (all rows < N: no wrap)
    elif WRAP:
        rows = cols % N  # rows past N wrap around instead of being masked (unmasked loads); the store drops them
    else:  # N % BLOCK_N == 0: no row wraps, and no runtime modulo (~16 SASS a row, after the PDL wait) is paid
        rows = cols
    if PRENORM:  # loaded here, reduced after the K loop: the loop's first weight loads must not wait for the
        parts = _prenorm_parts(pin_ptr, NP_IN, M, BLOCK_M, NPB)  # round trip and the cross-warp sum (S10-H)
    g_lo = pid_k * (W_SPLIT // 16)
    g_hi = tl.minimum(g_lo + W_SPLIT // 16, NG)  # this program's groups [g_lo, g_hi), a multiple of GPS
    offs_m = tl.arange(0, BLOCK_M)
    x_mask = (offs_m < M)[:, None]
    # Each step's addresses: its scalar base plus these loop-invariant offsets. (Pointer tiles advanced by the
    # loop were each kept twice by the software pipelining: gate_up tile 190 vs 168 registers, offline
    # sm_90a, session 5.)
    x_offs = offs_m[:, None] * stride_xm + tl.arange(0, 64 * GPS)[None, :]  # (BM, 64 GPS)
    w_offs = (rows[None, :, None] * K8 + 16 * tl.arange(0, GPS)[:, None, None]
              + tl.arange(0, 16)[None, None, :])  # (GPS, BN, 16): group-major, see above
    s_row = rows * NG
    acc = tl.zeros((BLOCK_N, 8), dtype=tl.float32)
    for g in tl.range(g_lo, g_hi, GPS, num_stages=STAGES):
        x_ptrs = (x_ptr + g * 64) + x_offs
        w_ptrs = (qw_ptr + g * 16) + w_offs
        s_idx = s_row + g
        a = _mma_operand(tl.load(w_ptrs), dtype, UNPACK)  # (BN, 128 GPS)
        pairs = tl.load(x_ptrs, mask=x_mask, other=0)
        dots = _shared_x_dots(a, _x_shared(pairs, dtype, BLOCK_M, GPS), BLOCK_M, GPS, UPCAST_DOT)
        s8 = _step_scales(s_ptr, s_idx, dtype, S_PAIRS, BLOCK_M, GPS)
        acc += s8 * dots + _step_zero_terms(pairs, z_ptr, s_idx, s8, dtype, 1.0 / U_INV, M_ODD, BLOCK_M, GPS)
    if TRIGGER == 1:
        pdl.launch_dependents(PDL)  # the next kernel may start once every program is past its K loop
    if PRENORM:
        r = _prenorm_finish(parts, norm_d, eps)
    else:
        r = tl.zeros((BLOCK_M,), dtype=tl.float32)  # unused
    # Fold the column blocks (groups; zero past GPS) into BLOCK_M columns.
    out = tl.sum(tl.reshape(acc, (BLOCK_N, 8 // BLOCK_M, BLOCK_M)), axis=1) * U_INV  # (BN, BM)
    _finish(tl.trans(out), offs_m, cols, pid_n, pid_k, M, N, y_ptr, stride_ym, bias_ptr, ws_ptr, lock_ptr, SPLIT_K,
            res_ptr, g_ptr, xg_ptr, pout_ptr, r, HAS_BIAS, SPLIT, FENCE, BLOCK_M, BLOCK_N, EPI, PRENORM, rope, ROPE_D,
            SECOND)


@triton.jit
def _w4a16_gemv_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr, res_ptr, g_ptr, xg_ptr,
                           pout_ptr, pin_ptr, NP_IN, norm_d, eps, M, N, stride_xm,
                           stride_ym, K8, NG, W_SPLIT, SPLIT_K, BLOCK_M: tl.constexpr,
                           HAS_BIAS: tl.constexpr, UNPACK: tl.constexpr, S_PAIRS: tl.constexpr,
                           FENCE: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
                           SPLIT: tl.constexpr, STAGES: tl.constexpr, GPS: tl.constexpr, EPI: tl.constexpr,
                           PRENORM: tl.constexpr, NPB: tl.constexpr, WRAP: tl.constexpr, TRIGGER: tl.constexpr,
                           PDL: tl.constexpr):
    # x_ptr: x viewed as int32 pairs (stride_xm in pairs). GPS groups per K step (GPS BM <= 8): a row's
    # 64 GPS bytes are contiguous, so each step reads longer runs of every row, and the per-step costs
    # (pipeline barriers, B operand through shared memory) are paid once per GPS groups. The launcher
    # makes every split range whole steps. BLOCK_N rows per program, BLOCK_N / (16 num_warps) 16-row tiles
    # per warp: the B operand a warp reads from shared memory serves all of its tiles.
    # One (row block, K split) tile per program (_mma_tile). A persistent form (fewer programs looping over
    # tiles in one flat, pipelined loop of K steps) was measured slower at every Llama-3-8B shape (session
    # 4, docs/perf_notes.md) and removed.
    # PDL: wait first (nothing is read before the previous kernel is done); TRIGGER says when the next kernel
    # may start: 0 at once (pdl.enter), 1 after this program's K loop, 2 at its end.
    pdl.wait(PDL)
    if TRIGGER == 0:
        pdl.launch_dependents(PDL)
    _mma_tile(tl.program_id(0), tl.program_id(1), x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr,
              res_ptr, g_ptr, xg_ptr, pout_ptr, pin_ptr, NP_IN, norm_d, eps,
              M, N, stride_xm, stride_ym, K8, NG, W_SPLIT, SPLIT_K, BLOCK_M, HAS_BIAS, UNPACK, S_PAIRS, FENCE,
              UPCAST_DOT, BLOCK_N, SPLIT, STAGES, GPS, EPI, PRENORM, NPB, WRAP, TRIGGER, PDL)
    if TRIGGER == 2:
        pdl.launch_dependents(PDL)


@triton.jit
def _w4a16_gemv_rope_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, q_ptr, ws_ptr, lock_ptr, res_ptr, g_ptr,
                            xg_ptr, pout_ptr, pin_ptr, NP_IN, norm_d, eps, M, N, stride_xm, stride_ym, K8, NG,
                            W_SPLIT, SPLIT_K, cos_ptr, sin_ptr, T, stride_ct, stride_st, H, HKV,
                            k_ptr, v_ptr, slot_ptr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                            k2_ptr, v2_ptr, slot2_ptr, stride_k2b, stride_k2h, stride_k2s, stride_v2b, stride_v2h,
                            stride_v2s, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, UNPACK: tl.constexpr,
                            S_PAIRS: tl.constexpr, FENCE: tl.constexpr, UPCAST_DOT: tl.constexpr,
                            BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, GPS: tl.constexpr,
                            EPI: tl.constexpr, PRENORM: tl.constexpr, NPB: tl.constexpr, WRAP: tl.constexpr,
                            TRIGGER: tl.constexpr, PDL: tl.constexpr, ROPE_D: tl.constexpr, SECOND: tl.constexpr):
    # The mma kernel with the RoPE epilogue (EPI 3, _store_rope): its own entry point, so the plain kernel's
    # signature (and so its compiled code) stays as it was. q_ptr takes y's place.
    pdl.wait(PDL)
    if TRIGGER == 0:
        pdl.launch_dependents(PDL)
    rope = ((cos_ptr, sin_ptr, T, stride_ct, stride_st, H, HKV),
            (k_ptr, v_ptr, slot_ptr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs),
            (k2_ptr, v2_ptr, slot2_ptr, stride_k2b, stride_k2h, stride_k2s, stride_v2b, stride_v2h, stride_v2s))
    _mma_tile(tl.program_id(0), tl.program_id(1), x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, q_ptr, ws_ptr, lock_ptr,
              res_ptr, g_ptr, xg_ptr, pout_ptr, pin_ptr, NP_IN, norm_d, eps,
              M, N, stride_xm, stride_ym, K8, NG, W_SPLIT, SPLIT_K, BLOCK_M, HAS_BIAS, UNPACK, S_PAIRS, FENCE,
              UPCAST_DOT, BLOCK_N, SPLIT, STAGES, GPS, EPI, PRENORM, NPB, WRAP, TRIGGER, PDL, rope, ROPE_D, SECOND)
    if TRIGGER == 2:
        pdl.launch_dependents(PDL)


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


# -- configs and launcher ----------------------------------------------------------------------------------
# A config: {"kernel": "mma" | "fma", "num_warps", "STAGES" (K steps in flight), "SPLIT_K" (programs per row
# block), ...}. "mma": "BLOCK_N" rows per program (a multiple of 16 num_warps: 16-row tiles per warp; default
# 16 num_warps), "GPS" groups of 128 per K step (capped to 8 / BLOCK_M and to a power of two dividing K / 128),
# "TRIGGER" (see TRIGGER below), "maxnreg" (ptxas's register cap, Triton's launch option: <= 168 lets 3
# programs of 4 warps share an SM; the sweep can time it, S5-D found it slower: gate_up 32.5 vs 24.4 us).
# "fma": BLOCK_N rows x BLOCK_W words per tile (a warp covers 128 / BLOCK_W rows x BLOCK_W words with 16-byte loads; each
# thread then holds BLOCK_N BLOCK_W / (128 num_warps) rows of one 32-value chunk per tile). No autotuning
# at call time: a decode step is captured in a CUDA graph.
INTERPRET_CONFIG = {"kernel": "fma", "BLOCK_N": 16, "BLOCK_W": 16, "num_warps": 4, "STAGES": 1, "SPLIT_K": 1}
INTERPRET_MMA_CONFIG = {"kernel": "mma", "num_warps": 4, "STAGES": 1, "SPLIT_K": 1, "GPS": 2}
CONFIG_KEYS = {"mma": ("BLOCK_N", "num_warps", "STAGES", "SPLIT_K", "GPS", "TRIGGER", "maxnreg"),
               "fma": ("BLOCK_N", "BLOCK_W", "num_warps", "STAGES", "SPLIT_K")}
N_SM = 132  # H200; the split rule only needs the order of magnitude


def mma_ok(K: int, G: int) -> bool:
    """Shapes the tensor-core kernel takes: groups of 128 (one dot each)."""
    return G == 128 and K % 128 == 0


def groups_per_step(gps: int, n_groups: int) -> int:
    """The largest power of two <= gps that divides the group count, so every K range is whole steps."""
    gps = 1 << (max(gps, 1).bit_length() - 1)
    while n_groups % gps:
        gps //= 2
    return gps


def _pairs_view(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) 16-bit as int32 (M, K/2): two consecutive k per element (a copy if x's rows are not 4-byte
    aligned, which no decode activation is)."""
    if x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.clone(memory_format=torch.contiguous_format)  # fresh storage: aligned, row stride K (even)
    return x.view(torch.int32)


# (BLOCK_M = next_pow2(M), N, K) -> config, for group 128: the fastest of the H200 sweep (TINYVILA_W4_SWEEP
# prints this dict), per call replayed from a CUDA graph with programmatic dependent launch on (run S5-D,
# docs/perf_notes.md). "S4": session 4's table, before the shared x operand and scalar-base addressing.
GEMV_TABLE: dict[tuple[int, int, int], dict] = {  # H200 sweeps, per call graph-replayed, M = 1, fp16: session 5
    # (run S5-D) chose the tiles; session 11 (run S11-B, the pairs unpack) re-timed them and moved gate_up from
    # 128 rows x 4 groups (27.1-27.3 us with the pairs unpack, 24.7 before it) to 64 x 8 (decode step +3.5%, S11-C)
    (1, 4096, 4096): {"kernel": "mma", "BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "SPLIT_K": 1,
                      "GPS": 8},  # 7.08-7.10 us (S5-D: 7.87)
    (1, 4096, 14336): {"kernel": "mma", "BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "SPLIT_K": 2,
                       "GPS": 8},  # 13.99 us (S5-D: 15.75)
    (1, 6144, 4096): {"kernel": "mma", "BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "SPLIT_K": 1,
                      "GPS": 8},  # 7.55-7.72 us (S5-D: 8.24)
    (1, 28672, 4096): {"kernel": "mma", "BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "SPLIT_K": 1,
                       "GPS": 8},  # 23.0-23.3 us (S5-D, 128 rows x 4 groups: 24.4)
}


# When the mma kernel lets the next kernel of a PDL chain start (csrc_triton/pdl.py): 0 at once, 1 after the K
# loop, 2 at the end (config key TRIGGER overrides; SILU_TRIGGER for the SwiGLU form). H200 run S6-D, decode
# step at 1K (profile_decode.py --variants): the SwiGLU GEMV triggering at once let the next (down) GEMV's
# programs take SM slots early and cost ~15 us a layer (340.7 tok/s, vs 413.5 with a separate SiLU launch);
# triggering after its K loop 419.7 (at the end 417.9). Every GEMV after its loop: 377.7 (the early start is
# worth keeping elsewhere). The (gate/up, down) pair alone (scripts/gemv_pdl_pair.py): 46.0 us at once, 40.2
# after the loop, 40.9 plain.
TRIGGER = 0
SILU_TRIGGER = 1

# TINYVILA_W4_GEMV_KERNEL=fma keeps the default off the tensor-core kernel (a switch for bisecting).
FORCE_FMA = os.environ.get("TINYVILA_W4_GEMV_KERNEL", "") == "fma"


def gemv_config(M: int, N: int, K: int, G: int) -> dict:
    """The GPU launch config of an (M, K) x (N, K)^T call: GEMV_TABLE's entry, else a rule from that sweep
    (run S5-D): 64-row programs of 4 warps, 8 groups per K step, split-K doubling while the grid stays within
    one program per SM and every split keeps >= 4 K steps (down split 2: 15.75 us vs 18.1 at 4; o unsplit:
    7.87 vs 8.55 at 2)."""
    key = (triton.next_power_of_2(M), N, K)
    if G == 128 and key in GEMV_TABLE and not (FORCE_FMA and GEMV_TABLE[key]["kernel"] == "mma"):
        return dict(GEMV_TABLE[key])
    if mma_ok(K, G) and not FORCE_FMA:
        warps, block_n, stages = 4, 64, 3
        gps = groups_per_step(8, K // G)
        steps = K // G // gps
        row_blocks, split = triton.cdiv(N, block_n), 1
        while row_blocks * split * 2 <= N_SM and steps >= 4 * 2 * split:
            split *= 2
        return {"kernel": "mma", "BLOCK_N": block_n, "num_warps": warps, "STAGES": stages, "SPLIT_K": split,
                "GPS": gps}
    R = 4 if M <= 2 else (2 if M <= 4 else 1)  # fp32 rows per thread; v stays live across the M rows
    return {"kernel": "fma", "BLOCK_N": 4 * R, "BLOCK_W": 128, "num_warps": 4, "STAGES": 4, "SPLIT_K": 1}


_SPLIT_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown workspaces: CUDA graphs captured earlier still point at them
MAX_ROW_BLOCKS = 1 << 16  # arrival counters per device: one per row block of one call


def _split_buffers(device: torch.device, ws_numel: int, row_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device fp32 partials workspace (grown, never shrunk) and int32 arrival counters (zeroed once;
    every call leaves them at zero). Shared by all calls on the device: GEMVs on one stream at a time."""
    if row_blocks > MAX_ROW_BLOCKS:
        raise ValueError(f"{row_blocks} row blocks exceed MAX_ROW_BLOCKS={MAX_ROW_BLOCKS}; use larger row tiles")
    ws, locks = _SPLIT_BUFFERS.get(device, (None, None))
    if ws is None or ws.numel() < ws_numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("w4a16_gemv's split-K workspace must grow before CUDA-graph capture: "
                               "run the same call once eagerly first")
        if ws is not None:
            _RETIRED.append(ws)  # never freed: a captured decode step may replay with its address
        ws = torch.empty(max(ws_numel, 1 << 20), dtype=torch.float32, device=device)
        locks = locks if locks is not None else torch.zeros(MAX_ROW_BLOCKS, dtype=torch.int32, device=device)
        _SPLIT_BUFFERS[device] = (ws, locks)
    return ws, locks


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               config: dict | None = None, unpack: int | None = None,
               prenorm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """(M, K) x packed (N, K) W4 -> (M, N) in x's dtype, M <= 8. `config` pins a launch config (see the
    comment above; default gemv_config on the GPU, the INTERPRET configs elsewhere); `unpack` picks the
    nibble unpacking (1: PTX, the GPU default; 0: plain shifts and masks, the interpreter's).
    prenorm (part, eps): x is gamma * h, an RMSNorm's input h times its weight but not yet normalised, and
    part (NP, 8) fp32 holds the sums of h^2 of row m in column m over NP blocks of h's columns (what
    w4a16_gemv_norm writes); y = rsqrt(mean(h^2) + eps) * (x W^T) + bias, the normalisation applied to
    the product instead of to x (one rounding of x less than the norm's own output would carry)."""
    y, = _gemv(x, qweight, scales, zeros, bias, out, config, unpack, prenorm, None, None)
    return y


def w4a16_gemv_norm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bias: torch.Tensor | None, residual: torch.Tensor, gamma: torch.Tensor, *,
                    config: dict | None = None, unpack: int | None = None,
                    prenorm: tuple[torch.Tensor, float] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual stream's add fused into the GEMV, with the next RMSNorm's share: -> (h, xg, part) with
    y = the plain GEMV's output (rounded to the dtype), h = residual + y (PyTorch's add, bit for bit),
    xg = gamma * h (rounded once) and part (row blocks, 8) fp32, part[p, m] = sum of h[m]^2 over row block p's
    columns: what a following w4a16_gemv(xg, ..., prenorm=(part, eps)) takes in place of rms_norm(h) * gamma.
    residual (M, N) and gamma (N,) in x's dtype; prenorm as in w4a16_gemv."""
    M, N = x.shape[0], qweight.shape[0]
    if residual.shape != (M, N) or residual.dtype != x.dtype or residual.stride() != (N, 1):
        raise ValueError(f"residual must be a contiguous ({M}, {N}) {x.dtype} tensor, got {tuple(residual.shape)} "
                         f"{residual.dtype} strides {residual.stride()}")
    if gamma.shape != (N,) or gamma.dtype != x.dtype or gamma.stride(0) != 1:
        raise ValueError(f"gamma must be a contiguous ({N},) {x.dtype} tensor, got {tuple(gamma.shape)} {gamma.dtype}")
    return _gemv(x, qweight, scales, zeros, bias, None, config, unpack, prenorm, residual, gamma)


def w4a16_gemv_silu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *,
                    config: dict | None = None, unpack: int | None = None,
                    prenorm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """SwiGLU fused into the gate/up GEMV: qweight holds [gate; up] (2F, K) (the checkpoint's w13) -> (M, F)
    silu(x W_gate^T) * (x W_up^T), bit for bit the plain GEMV followed by csrc_triton.silu_mul (each program
    computes gate rows j and up rows F + j of the same j; silu_ok says when). prenorm as in w4a16_gemv."""
    M, N, K, G = check_w4_args(x, qweight, scales, zeros, None)
    cfg = config if config is not None else _default_config(x, M, N, K, G)
    if not silu_ok(N, K, G, cfg):
        raise ValueError(f"w4a16_gemv_silu needs the mma kernel (G=128) and F={N // 2} a multiple of half its "
                         f"BLOCK_N; got G={G}, config {cfg}")
    y, = _gemv(x, qweight, scales, zeros, None, torch.empty(M, N // 2, dtype=x.dtype, device=x.device), cfg,
               unpack, prenorm, None, None, silu=True)
    return y


def silu_ok(N: int, K: int, G: int, config: dict) -> bool:
    """Whether the gate/up GEMV can end in SwiGLU (w4a16_gemv_silu) under `config`: the mma kernel, N even,
    and F = N / 2 whole half-tiles (so a program's gate and up rows pair up exactly)."""
    if config.get("kernel", "fma") != "mma" or not mma_ok(K, G) or N % 2:
        return False
    half = config.get("BLOCK_N", 16 * config["num_warps"]) // 2
    return (N // 2) % half == 0


def w4a16_gemv_rope(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slots: torch.Tensor, n_heads: int, n_kv_heads: int, *,
                    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    prenorm: tuple[torch.Tensor, float] | None = None, config: dict | None = None,
                    unpack: int | None = None) -> torch.Tensor:
    """RoPE and the KV-cache write fused into the qkv GEMV: x (B T, K) (token m = b T + t, B T <= 8), qweight the
    fused [q heads | k heads | v heads] (N = (H + 2 Hkv) D, K) -> rotated q (B, H, T, D) contiguous; rotated k and
    raw v go to k_cache, v_cache (B, Hkv, S, D) at slots (T,) and to second = (k2, v2, slots2) when given: bit for
    bit csrc_triton.rope_qkv.rope_qkv(w4a16_gemv(x, ...).view(B, T, N), ...) (same config), one launch. cos, sin
    (T, D); bias (N,) (Qwen2) added before the rounding, as in the plain GEMV. Needs the mma kernel with BLOCK_N / 2
    dividing D / 2 (rope_ok). prenorm as in w4a16_gemv."""
    M, N, K, G = check_w4_args(x, qweight, scales, zeros, bias)
    T = cos.shape[0] if cos.dim() == 2 else 0
    if T == 0 or M % T:
        raise ValueError(f"w4a16_gemv_rope: x's {M} rows are not B x T tokens with T = {T} rows of cos")
    qkv = x.new_empty(1).expand(M // T, T, N)  # shape, dtype and device of the GEMV's output for rope_qkv's checks
    D = _rope_check(qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads)
    if second is not None:
        _rope_check(qkv, cos, sin, *second, n_heads, n_kv_heads)
    cfg = config if config is not None else _default_config(x, M, N, K, G)
    if not rope_ok(N, K, G, cfg, D):
        raise ValueError(f"w4a16_gemv_rope needs the mma kernel (G=128) and half its BLOCK_N dividing D/2={D // 2}; "
                         f"got G={G}, config {cfg}")
    q = torch.empty(M // T, n_heads, T, D, dtype=x.dtype, device=x.device)
    _gemv(x, qweight, scales, zeros, bias, q, cfg, unpack, prenorm, None, None,
          rope=(cos, sin, T, n_heads, n_kv_heads, D, (k_cache, v_cache, slots), second))
    return q


def rope_ok(N: int, K: int, G: int, config: dict, head_dim: int) -> bool:
    """Whether the qkv GEMV can end in RoPE and the cache write (w4a16_gemv_rope) under `config`: the mma kernel
    with one 16-row tile per warp (BLOCK_N = 16 num_warps, the launcher's tiles) and whole half-tiles per half head
    (BLOCK_N / 2 divides D / 2), so a program's rows pair d with d + D / 2. Two tiles per warp are refused: there
    the epilogue's halves reach RoPE through different layout conversions and, on the H200 (session 7), a few q
    values came out 1 ulp away from GEMV + rope_qkv (bf16, M 8) even with RoPE's FMAs spelled out."""
    if config.get("kernel", "fma") != "mma" or not mma_ok(K, G) or head_dim % 2 or N % head_dim:
        return False
    block_n = config.get("BLOCK_N", 16 * config["num_warps"])
    return block_n == 16 * config["num_warps"] and (head_dim // 2) % (block_n // 2) == 0


def _default_config(x: torch.Tensor, M: int, N: int, K: int, G: int) -> dict:
    """The config a call runs when none is pinned: gemv_config on the GPU, the interpreter's otherwise."""
    if x.is_cuda and not INTERPRET:
        return gemv_config(M, N, K, G)
    return INTERPRET_MMA_CONFIG if mma_ok(K, G) else INTERPRET_CONFIG


def _gemv(x, qweight, scales, zeros, bias, out, config, unpack, prenorm, residual, gamma,
          silu: bool = False, rope: tuple | None = None) -> tuple[torch.Tensor, ...]:
    """The launcher of w4a16_gemv (residual None: -> (y,)), w4a16_gemv_norm (-> (h, xg, part)), w4a16_gemv_silu
    (silu: out is (M, N / 2)) and w4a16_gemv_rope (rope = (cos, sin, T, H, Hkv, D, (k, v, slots), second):
    out is q (B, H, T, D), checked by the caller)."""
    M, N, K, G = check_w4_args(x, qweight, scales, zeros, bias)
    if M > MAX_M:
        raise ValueError(f"w4a16_gemv takes at most {MAX_M} rows, got {M}; use w4a16_gemm")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif rope is None and (out.shape != (M, N // 2 if silu else N) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be ({M}, {N}) {x.dtype} with unit stride along N")
    K8 = K // 8
    if N * K8 >= 2**31:
        raise ValueError(f"qweight with {N * K8} words exceeds the kernel's int32 offsets")
    on_gpu = x.is_cuda and not INTERPRET
    if unpack is None:
        unpack = 1 if on_gpu else 0
    if unpack == 1 and not on_gpu:
        raise ValueError("unpack=1 (inline PTX) needs a GPU outside TRITON_INTERPRET; use unpack=0")
    if config is None:
        config = _default_config(x, M, N, K, G)
    cfg = dict(config)
    kernel = cfg.pop("kernel", "fma")
    if rope is not None and kernel != "mma":
        raise ValueError("the RoPE epilogue needs the mma kernel")
    if kernel == "mma" and not mma_ok(K, G):
        raise ValueError(f"the mma kernel needs G == 128 and K % 128 == 0 (G={G}, K={K})")
    unknown = set(cfg) - set(CONFIG_KEYS[kernel])
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)} for the {kernel} kernel; use {CONFIG_KEYS[kernel]}")
    s_pairs = (K // G) % 2 == 0 and scales.data_ptr() % 4 == 0  # 4-byte scale loads (see _load_scales)
    # Split K into SPLIT_K ranges of whole tiles (none empty: the split count shrinks for short K).
    if kernel == "mma":
        # GPS groups per step, each in BM of the dots' 8 columns (GPS BM <= 8); pairs of scales per load.
        gps = min(cfg.get("GPS", 1), 8 // triton.next_power_of_2(M)) if s_pairs else 1
        cfg["GPS"] = groups_per_step(gps, K // G)
        cfg["TRIGGER"] = int(cfg.get("TRIGGER", SILU_TRIGGER if silu else TRIGGER))
        if cfg["TRIGGER"] not in (0, 1, 2):
            raise ValueError(f"TRIGGER={cfg['TRIGGER']} must be 0, 1 or 2")
        bw = 16 * cfg["GPS"]  # one K step: GPS groups of 16 words
    else:
        bw = max(cfg["BLOCK_W"], G // 8)  # a tile holds whole groups
    w_split = triton.cdiv(triton.cdiv(K8, cfg.get("SPLIT_K", 1)), bw) * bw
    split = triton.cdiv(K8, w_split)
    cfg.pop("SPLIT_K", None)
    if kernel == "mma":
        cfg.setdefault("BLOCK_N", 16 * cfg["num_warps"])
        if cfg["BLOCK_N"] % (16 * cfg["num_warps"]):
            raise ValueError(f"mma BLOCK_N={cfg['BLOCK_N']} must be a multiple of 16 num_warps (16-row tiles per warp)")
    block_n = cfg["BLOCK_N"]
    row_blocks = triton.cdiv(N, block_n)
    ws, locks = _split_buffers(x.device, split * M * N, row_blocks) if split > 1 else (out, out)  # (unused if 1)
    # The fused residual/norm epilogue (EPI 1) and the normalising prologue (PRENORM): unused pointers
    # are `out` (never dereferenced: the constexpr switches remove their code).
    outputs: tuple[torch.Tensor, ...] = (out,)
    res = g = xg = pout = pin = out
    np_in, nd, eps = 1, float(K), 0.0
    if residual is not None:
        xg = torch.empty(M, N, dtype=x.dtype, device=x.device)
        pout = torch.empty(row_blocks, 8, dtype=torch.float32, device=x.device)
        res, g, outputs = residual, gamma, (out, xg, pout)
    if prenorm is not None:
        pin, eps = prenorm[0], float(prenorm[1])
        if pin.dtype != torch.float32 or pin.dim() != 2 or pin.shape[1] != 8 or not pin.is_contiguous():
            raise ValueError(f"prenorm's partial sums must be a contiguous (NP, 8) float32 tensor, got "
                             f"{tuple(pin.shape)} {pin.dtype}")
        if pin.device != x.device:
            raise ValueError("prenorm's partial sums must be on x's device")
        np_in = pin.shape[0]
    epi_args = (res, g, xg, pout, pin, np_in, nd, eps)
    meta = dict(BLOCK_M=triton.next_power_of_2(M), HAS_BIAS=bias is not None, UNPACK=unpack, S_PAIRS=s_pairs,
                FENCE=on_gpu, SPLIT=split > 1, EPI=3 if rope else 2 if silu else int(residual is not None),
                PRENORM=prenorm is not None,
                NPB=triton.next_power_of_2(np_in), **pdl.options(x.device))
    sc = scales.view(torch.int32) if s_pairs else scales
    b = bias if bias is not None else scales
    shape_args = (M, N)
    tail = (K8, K // G, w_split, split)
    if rope is not None:
        cos, sin, T, H, Hkv, D, pair, second = rope
        caches = [a for k, v, sl in (pair, second or pair) for a in (k, v, sl, *k.stride()[:3], *v.stride()[:3])]
        x32 = _pairs_view(x)
        _w4a16_gemv_rope_kernel[(row_blocks, split)](x32, qweight, sc, zeros, b, out, ws, locks, *epi_args, *shape_args,
                                                     x32.stride(0), out.stride(0), *tail, cos, sin, T, cos.stride(0),
                                                     sin.stride(0), H, Hkv, *caches, **meta, UPCAST_DOT=not on_gpu,
                                                     WRAP=N % block_n != 0, ROPE_D=D, SECOND=second is not None,
                                                     **cfg)
    elif kernel == "mma":
        x32 = _pairs_view(x)  # x as int32 pairs: 4-byte elements, which Triton pipelines with cp.async
        _w4a16_gemv_mma_kernel[(row_blocks, split)](x32, qweight, sc, zeros, b, out, ws, locks, *epi_args,
                                                    *shape_args, x32.stride(0), out.stride(0), *tail, **meta,
                                                    UPCAST_DOT=not on_gpu, WRAP=N % block_n != 0, **cfg)
    else:
        cfg["BLOCK_W"] = bw
        even = N % cfg["BLOCK_N"] == 0 and K8 % bw == 0  # no masks needed
        _w4a16_gemv_fma_kernel[(row_blocks, split)](x, qweight, sc, zeros, b, out, ws, locks, *epi_args,
                                                    *shape_args, x.stride(0), out.stride(0), *tail,
                                                    (G // 8).bit_length() - 1, **meta, EVEN=even, **cfg)
    return outputs


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Packed W4 -> dense (N, K) fp32 weight, w = q * s + b in fp32 (tinyvila.quant.dequantize_w4's math)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight[..., None] >> shifts) & 0xF).reshape(qweight.shape[0], -1).float()  # (N, K)
    G = q.shape[1] // scales.shape[1]
    return q * scales.float().repeat_interleave(G, dim=1) + zeros.float().repeat_interleave(G, dim=1)


def w4a16_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: torch.Tensor | None = None, prenorm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Reference: dequantize (rounded to x's dtype, as a dense checkpoint would hold it) -> fp32 matmul
    (prenorm: times each row's rsqrt(sum_p part[p, m] / K + eps)) -> + bias -> cast."""
    w = dequantize_ref(qweight, scales, zeros).to(x.dtype).float()
    y = x.float() @ w.T
    if prenorm is not None:
        part, eps = prenorm
        y = y * torch.rsqrt(part.float().sum(0)[: x.shape[0]] / x.shape[1] + eps)[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def w4a16_gemv_norm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        bias: torch.Tensor | None, residual: torch.Tensor, gamma: torch.Tensor,
                        prenorm: tuple[torch.Tensor, float] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of w4a16_gemv_norm: y = w4a16_gemv_ref(...), h = residual + y, xg = gamma * h (each rounded
    once to the dtype), part (1, 8) fp32 with the rows' sums of h^2 in columns 0..M-1 (one block)."""
    y = w4a16_gemv_ref(x, qweight, scales, zeros, bias, prenorm)
    h = (residual.float() + y.float()).to(x.dtype)
    xg = (gamma.float() * h.float()).to(x.dtype)
    part = torch.zeros(1, 8, dtype=torch.float32, device=x.device)
    part[0, : x.shape[0]] = h.float().pow(2).sum(-1)
    return h, xg, part
