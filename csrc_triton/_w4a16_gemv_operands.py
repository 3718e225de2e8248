"""The W4 GEMV's operands (csrc_triton/w4a16_gemv.py): packed nibbles to exact "magic" values, and a K step of the
"mma" kernel's weights, x, scales and zero-point terms in mma.sync's register layouts. Device functions only.

Magic values: one lop3 (w & mask) | magic drops two nibbles of a word into the mantissas of a 16-bit pair, v = m + q u
exactly (fp16: m = 16 at even k, 1 at odd k, u = 1/64; bf16: m = 16, u = 1/8); `magic_planes` is the PTX on the GPU
and plain shifts and masks under the interpreter, the same values. The "fma" kernel widens them to fp32; the "mma"
kernel feeds them to the tensor cores in exactly mma's operand layout (`mma_operand`), against x laid out as mma's
B (`x_shared`), so no shuffle or shared-memory round trip is added.
"""

from __future__ import annotations

from ._triton import tl, triton

# -- magic unpack and scales (both kernels) ------------------------------------------------------------------
def _magic_asm(out: str, magic: tuple[int, ...]) -> str:
    """PTX for one word ($8) -> its 8 nibbles as v = m + q u ($0..$7 = nibbles 0..7), two per lop3 (src & mask) |
    magic. fp16 (magics 16.0 and 1.0): nibbles 0/4 and, after a shift by 8, 2/6 sit at bits 0-3 of each half, under
    16.0; 1/5 and 3/7 at bits 4-7, under 1.0. bf16 (one magic, 16.0) has only 7 mantissa bits, so every nibble pair
    is first shifted to bits 0-3 (by 0, 4, 8, 12). out == "f32": each 16-bit value widened exactly by cvt.f32.f16;
    out == "pairs": the lop3 results, $i = (v_i, v_{i + 4}) as one 32-bit register ($4 the word), split by
    _word_halves. Whole 32-bit results (not "=h" halves) let ptxas use them as mma's operand registers directly."""
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


MAGIC_F32 = tl.constexpr(_magic_asm("f32", (0x4C004C00, 0x3C003C00)))  # fp16 pairs 16.0, 1.0 -> fp32
MAGIC_F16 = tl.constexpr(_magic_asm("pairs", (0x4C004C00, 0x3C003C00)))  # fp16 pairs 16.0, 1.0
MAGIC_BF16 = tl.constexpr(_magic_asm("pairs", (0x41804180,)))  # bf16 pairs 16.0


@triton.jit
def _word_halves(p, dtype):
    """int32 words -> their low and high 16-bit halves as `dtype`, a bitcast each (no mask: the int16 cast drops the
    high bits and the shifted-in sign bits). For a 16-bit tensor viewed as int32: its even and odd elements."""
    return p.to(tl.int16).to(dtype, bitcast=True), (p >> 16).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def magic_planes(words, dtype, UNPACK: tl.constexpr):
    """(R, W) int32 words -> 8 (R, W) tensors v_i = m_i + q_i u of nibble i in `dtype`, all exact (fp32 as fp16).
    UNPACK=1: the PTX block (GPU); 0: plain shifts and masks (interpreter), the same values."""
    if UNPACK == 1:
        if dtype == tl.float32:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                MAGIC_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(MAGIC_BF16 if dtype == tl.bfloat16 else MAGIC_F16,
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
def load_scales(s_ptr, idx, mask, dtype: tl.constexpr, S_PAIRS: tl.constexpr, MASKED: tl.constexpr):
    """scales[idx] as fp32. S_PAIRS: s_ptr is the scales viewed as int32 (two per word): a 4-byte load, which
    Triton can stage through shared memory with cp.async like the others."""
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


# -- the mma kernel's K step (G = 128) ------------------------------------------------------------------------
# mma.sync's A operand (m16n8k16, here kWidth 4) wants thread (g, t) (g = lane / 4, t = lane % 4) to hold rows g
# and g + 8 of a 16-row tile and, per 32 dot positions, positions 4t..4t+3 and 16+4t..16+4t+3. With the dot's k
# order p = 64 j1 + 32 j0 + 16 c0 + 8 j3 + 4 j2 + 2 c1 + e for nibble c + 4e (c = c0 + 2 c1) of word
# j = j0 + 2 j1 + 4 j2 + 8 j3 (k = 8 j + c + 4 e), a thread's 32 positions of a group are exactly the 8 nibbles of
# 4 consecutive words 4t..4t+3 of one row (one 16-byte shared-memory read), and adjacent p (e = 0, 1) are nibbles c
# and c + 4: the 16-bit pair one lop3 makes. So the unpacked values are born in mma's register layout, and the
# joins, reshapes and permute below only rename registers (sm_90 TTGIR: no layout conversion, no shared-memory round
# trip for A). Positions 4t..4t+3 hold nibbles c0, c0 + 4, c0 + 2, c0 + 6: with c0 and c1 swapped ptxas needed more
# moves to assemble the operand quads. A K step's A holds its GPS groups side by side, group jg at 128 jg + p (jg a
# register index). Rows are in memory order; the words tile is group-major, (GPS, BN, 16), so its rows are 64 bytes
# apart in shared memory and the 8 rows a warp reads at once fall in distinct banks.
@triton.jit
def mma_operand(words, dtype, UNPACK: tl.constexpr):
    """(GPS, BN, 16) words (group jg of each row) -> A (BN, 128 GPS) magic values, k order 128 jg + p."""
    GPS: tl.constexpr = words.shape[0]
    BN: tl.constexpr = words.shape[1]
    v0, v1, v2, v3, v4, v5, v6, v7 = magic_planes(words, dtype, UNPACK)
    t = tl.join(tl.join(tl.join(v0, v4), tl.join(v1, v5)), tl.join(tl.join(v2, v6), tl.join(v3, v7)))
    t = tl.reshape(t, (GPS, BN, 2, 2, 2, 2, 2, 2, 2))  # [jg, n, j3, j2, j1, j0, e, c0, c1]
    t = tl.permute(t, (1, 0, 4, 5, 7, 2, 3, 8, 6))  # [n, jg, j1, j0, c0, j3, j2, c1, e]
    return tl.reshape(t, (BN, 128 * GPS))


# The x operand: GPS dots of (BN, 128) x (128, 8) per K step, all with one B = x of the step's groups side by side
# (column jg BM + m: row m of x over group jg). Dot jg's column block jg is group jg's sum; its other columns
# (W_jg x_j) are dropped by a select. Triton loads B from the cp.async'd x tile straight into mma's operand layout
# (no layout conversion): a thread of mma's B layout holds 32 consecutive x values of its column's group, so the x
# tile needs no shuffle. (A block-diagonal B of all GPS groups was slower: docs/perf_notes.md.)
@triton.jit
def x_shared(pairs, dtype, BLOCK_M: tl.constexpr, GPS: tl.constexpr):
    """x of GPS groups as (BM, 64 GPS) int32 pairs in K order -> B (128, 8) in mma_operand's k order: row p, column
    jg BM + m holds x[m] at the k of position p of group jg; columns >= GPS BM repeat the others (finite;
    shared_x_dots discards their sums). x is loaded contiguously (4-byte elements: pipelined with cp.async) and
    permuted here in registers: gathering it in p order would take 2-byte loads that cannot be pipelined."""
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
    """Group jg's columns (BN, 128) of a step's A (BN, 128 GPS) (k order 128 jg + p; jg is a register index, so
    the splits only rename registers). GPS in {2, 4, 8}."""
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
def shared_x_dots(a, xs, BLOCK_M: tl.constexpr, GPS: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """A (BN, 128 GPS) (mma_operand) and B (128, 8) (x_shared) -> (BN, 8) fp32: column jg BM + m holds
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
def step_scales(s_ptr, idx, dtype, S_PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, GPS: tl.constexpr):
    """Scales of groups idx + jg (jg < GPS; idx (BN,) a multiple of GPS) as (BN, 8) fp32 in the columns of
    shared_x_dots' sums: column jg BM + m holds s[idx + jg]; columns of groups >= GPS (whose dot sums are
    exactly zero) repeat the others. GPS >= 2: s_ptr is the scales as int32 pairs, one load of GPS / 2."""
    BN: tl.constexpr = idx.shape[0]
    J: tl.constexpr = 8 // BLOCK_M
    if GPS == 1:
        s = load_scales(s_ptr, idx, idx, dtype, S_PAIRS, False)[:, None]  # (BN, 1)
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
def step_zero_terms(pairs, z_ptr, idx, s8, dtype, U: tl.constexpr, M_ODD: tl.constexpr, BLOCK_M: tl.constexpr,
                    GPS: tl.constexpr):
    """The x-only terms of one K step's GPS groups in shared_x_dots' column layout, (BN, 8) fp32 in units of u:
    u b[n, g] X[m, g] - s[n, g] Xm[m, g] in column jg BM + m (zero in the columns of groups >= GPS, whose dot sums
    are zero too). pairs: the step's x as (BM, 64 GPS) int32 pairs (even k low, odd k high), so X = sum lo + sum hi
    and Xm = 16 sum lo + M_ODD sum hi; s8: the step's scales (step_scales). Zeros of groups idx + jg are loaded
    here, pipelined with the step's other loads (a per-program prologue was slower: docs/perf_notes.md)."""
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

