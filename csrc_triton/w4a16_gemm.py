"""W4A16 GEMM for prefill: y (M, N) = x (M, K) @ W^T + bias, W packed as in tinyvila/quant.py.

Layouts and dtypes as in w4a16_gemv.py: x (M, K) fp16/bf16 (unit stride along K), qweight int32 (N, K/8) with
nibble i of word j = q[n, 8j + i], scales (N, K/G) in x's dtype, zeros fp32 (N, K/G), G in {32, 64, 128}.

Orientation: a program computes the transposed tile y^T (BLOCK_N, BLOCK_M) = W_tile (BLOCK_N, BK) @ x_tile^T, so
the dequantized weights are wgmma's *register* operand A (never stored to shared memory) and the small activation
tile is the shared-memory operand B, whose width BLOCK_M (MMA's N: 16..256) fits short prompts.
K order: a dot does not care in which order it sums over k, so each K tile (BK = 8 BLOCK_W = BW words per row) is
summed in the order the nibbles leave the words: position p = c * 2BW + 2j + e holds k = 8j + 2c + e (word j,
nibble pair c, nibble e of the pair). In that order the thread that holds words j = t (mod 4) of a row computes
exactly its own fragment of A, so the dequantized tile needs no data exchange; x is gathered in the same order as
4-byte pairs by cp.async (pipelined, num_stages deep).
Dequantization, exact: one LOP3 (after at most one shift, shared by two nibbles) puts nibble q into the mantissa of
1.0f at bit 12 or 16: f = 1 + q 2^-11 (or 2^-7). One FMA then gives (2^7 for the latter)
w = f * (2^11 s) + (b - 2^11 s) = q s + b with an exact product and one rounding to fp32, as the reference's fp32
q * s + b, whenever b - 2^11 s is exact in fp32: always for b = -z s with an integer zero point z in [0, 15]
((z + 2^11) s has <= 23 significant bits), i.e. every format we build or import; otherwise off by <= 2^-12 |s|
before the final rounding. w is then rounded once to x's dtype, like `_ref`.
Pairs (UNPACK=2): the same weights in 16-bit pair arithmetic, which is what the tile holds anyway (the two nibbles of
byte c of word j are adjacent in the K order above): PRMT + LOP3 make {m + q, m + q'} (m = 1024 fp16, 128 bf16), then
HSUB2 of m + z and HFMA2 by s plus d, with z = rint(-b / s), d = b + z s (_h2_meta): 17 instructions a word instead
of 24, the reference's bits whenever q s + b is exact in fp32 and d in the dtype (integer and fp16 zero points).
Split-K (SPLIT_K > 1, for prompts whose tiles do not fill the GPU): each split writes its fp32 partial tile to a
workspace; the last split of a tile (an atomic counter per tile) sums the partials in split order
(deterministic), adds the bias and stores y, then resets the counter for the next call.
Paths: on CUDA, M >= DEQUANT_MIN_M dequantizes W once (w4a16_dequant, into a reused workspace) and calls cuBLAS;
so do K not divisible by 64. On sm_90 the shapes of w4a16_gemm_wgmma.TILE_TABLE (short prompts) take that module's
Gluon kernel (weights through a TMA ring; measured faster there), the rest this module's. Tiles: CONFIG_TABLE
(H200 sweep, scripts/benches/w4a16.py) keyed by (M bucket, N, K), else `rule_config`; never autotuned at call time.
`warmup` compiles every bucket's kernel ahead of the first prompt.
Limits: K % G == 0; any M, N. One CUDA stream at a time (the split-K counters are shared per device).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ._common import INTERPRET, check_w4_args, w4a16_ref
from ._triton import tl, triton
from .launch import Launch, Plans, tensor_key
from .w4a16_dequant import w4a16_dequant

try:  # the Gluon kernel (sm_90, Triton 3.6); absent on builds without triton.experimental.gluon
    from . import w4a16_gemm_wgmma as _wgmma
except ImportError:  # pragma: no cover - depends on the Triton build
    _wgmma = None

# From this many rows on (CUDA), W is dequantized once into an (N, K) workspace and cuBLAS runs the GEMM
# (~2.5 bytes of traffic per weight, then the fp16 GEMM at full rate). Below it, the fused kernel reads 0.5 byte
# per weight and dequantizes each weight once per BLOCK_M rows: cheaper while a few row tiles cover the prompt
# (crossover below 256 rows on the H200: TINYVILA_W4_GEMM_SWEEP, docs/benchmarks.md).
DEQUANT_MIN_M = 256


class Config(NamedTuple):
    """One tile configuration of the fused kernel."""

    block_m: int  # prompt rows per tile (wgmma N): 16..256
    block_n: int  # weight rows per tile (wgmma M: 64 per warpgroup)
    block_w: int  # packed words per weight row per K step (BK = 8 block_w): 8 or 16
    split_k: int  # programs sharing one output tile's K range
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.block_w}k{self.split_k}"
                f"x{self.num_warps}s{self.num_stages}")


# (M bucket, N, K) -> Config for the H200 (TINYVILA_W4_GEMM_SWEEP prints this dict; fp16, group 128, Llama-3-8B).
CONFIG_TABLE: dict[tuple[int, int, int], Config] = {
    (16, 4096, 4096): Config(16, 64, 16, 4, 4, 4),
    (16, 4096, 14336): Config(16, 64, 16, 8, 4, 3),
    (16, 6144, 4096): Config(16, 64, 16, 4, 4, 4),
    (16, 28672, 4096): Config(16, 64, 16, 2, 4, 4),
    (64, 4096, 4096): Config(64, 128, 8, 8, 8, 3),  # M 33..64: the pair form's best on an H100 (16-warp tiles)
    (64, 4096, 14336): Config(64, 128, 8, 8, 8, 3),
    (64, 6144, 4096): Config(64, 128, 8, 4, 8, 3),
    (64, 28672, 4096): Config(64, 256, 16, 1, 16, 3),
    (256, 4096, 4096): Config(128, 128, 16, 2, 8, 4),  # M 129..255 (256 itself takes the dequant path)
    (256, 4096, 14336): Config(128, 128, 16, 2, 8, 3),
    (256, 6144, 4096): Config(128, 128, 16, 1, 8, 4),
    (256, 28672, 4096): Config(128, 128, 16, 1, 8, 4),
}


@triton.jit
def _mantissa(v, MASK: tl.constexpr, UNPACK: tl.constexpr):
    """(v & MASK) | 0x3F800000 (1.0f) as fp32. UNPACK=1 (GPU): one lop3 in inline PTX (plain Triton ops give two
    LOP3s, and the constant as a runtime argument sends the tile through shared memory). UNPACK=0: plain ops."""
    if UNPACK == 1:
        if MASK == 0xF000:
            r = tl.inline_asm_elementwise("lop3.b32 $0, $1, 61440, 1065353216, 0xEA;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise("lop3.b32 $0, $1, 983040, 1065353216, 0xEA;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = (v & MASK) | 0x3F800000
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _nibble(words, i: tl.constexpr, UNPACK: tl.constexpr):
    """Nibble i of each word as the fp32 1 + q 2^-11 (i in 0, 2, 3, 6: q moved to bits 12..15) or 1 + q 2^-7 (i in
    1, 4, 5, 7: q at bits 16..19). Four shifts serve the eight nibbles (CSE'd across calls)."""
    if i == 0:
        f = _mantissa(words << 12, 0xF000, UNPACK)
    elif i == 1:
        f = _mantissa(words << 12, 0xF0000, UNPACK)
    elif i == 2:
        f = _mantissa(words << 4, 0xF000, UNPACK)
    elif i == 3:
        f = _mantissa(words, 0xF000, UNPACK)
    elif i == 4:
        f = _mantissa(words, 0xF0000, UNPACK)
    elif i == 5:
        f = _mantissa(words >> 4, 0xF0000, UNPACK)  # arithmetic shifts are fine: the mask drops sign bits
    elif i == 6:
        f = _mantissa(words >> 12, 0xF000, UNPACK)
    else:
        f = _mantissa(words >> 12, 0xF0000, UNPACK)
    return f


@triton.jit
def _weight(words, i: tl.constexpr, UNPACK: tl.constexpr, s_lo, b_lo, s_hi, b_hi, dtype: tl.constexpr):
    """Nibble i of each word dequantized: f * (2^11 s) + (b - 2^11 s) = q s + b (2^7 at bits 16..19), one fp32 FMA,
    one rounding to dtype."""
    f = _nibble(words, i, UNPACK)
    if i == 1 or i == 4 or i == 5 or i == 7:
        w = f * s_hi + b_hi
    else:
        w = f * s_lo + b_lo
    return w.to(dtype)


def _h2_asm(c: int, bf16: bool) -> str:
    """PTX of one nibble pair c (byte c of a word) in 16-bit pair arithmetic: PRMT puts byte c of the word and of the
    word >> 4 in the two halves, one LOP3 makes the magic pair {m + q_2c, m + q_2c+1} (m = 1024 in fp16, 128 in bf16:
    there the spacing is 1), then (v - (m + z)) s + d, exact up to the FMA's one rounding."""
    t, magic = ("bf16x2", 0x43004300) if bf16 else ("f16x2", 0x64006400)
    sel = c | c << 4 | (4 + c) << 8 | (4 + c) << 12
    return ("{ .reg .b32 t, z, s, d; mov.b32 z, {$4, $4}; mov.b32 s, {$5, $5}; mov.b32 d, {$6, $6}; "
            f"prmt.b32 t, $2, $3, {sel}; lop3.b32 t, t, 983055, {magic}, 0xEA; sub.{t} t, t, z; "
            f"fma.rn.{t} t, t, s, d; mov.b32 {{$0, $1}}, t; }}")


_H2_F16 = [tl.constexpr(_h2_asm(c, False)) for c in range(4)]
_H2_BF16 = [tl.constexpr(_h2_asm(c, True)) for c in range(4)]
H2_F16_0, H2_F16_1, H2_F16_2, H2_F16_3 = _H2_F16  # jit bodies read constexpr globals, not list items
H2_BF16_0, H2_BF16_1, H2_BF16_2, H2_BF16_3 = _H2_BF16


@triton.jit
def _h2_meta(s, b, dtype: tl.constexpr):
    """Per-row (or per-word) operands of the pair form: m + z, s and d in dtype, with z = rint(-b / s) (0 where s is
    0; clamped so that m + z stays an integer of the dtype) and d = b + z s. For b = -z s (integer zero points: every
    format we build) d = 0; for llm-awq v2's fp16 zero points d is exact in the dtype (|d| <= |s| / 2 on s's grid), so
    (q - z) s + d = q s + b exactly before the FMA's rounding: the reference's bits (q s + b is exact in fp32)."""
    MAG: tl.constexpr = 128.0 if dtype == tl.bfloat16 else 1024.0
    z = tl.where(s == 0.0, 0.0, tl.extra.cuda.libdevice.rint(tl.extra.cuda.libdevice.fast_dividef(-b, s)))
    z = tl.minimum(tl.maximum(z, -MAG), MAG - 1.0)
    return (z + MAG).to(dtype), s.to(dtype), (b + z * s).to(dtype)


@triton.jit
def _h2_asm_call(words, w4, zm, sh, dh, ASM: tl.constexpr, dtype: tl.constexpr):
    if dtype == tl.bfloat16:  # the result dtypes as literals: a tuple of constexpr dtypes does not lower
        lo, hi = tl.inline_asm_elementwise(ASM, "=h,=h,r,r,h,h,h", [words, w4, zm, sh, dh],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        lo, hi = tl.inline_asm_elementwise(ASM, "=h,=h,r,r,h,h,h", [words, w4, zm, sh, dh],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    return tl.join(lo, hi)


@triton.jit
def _h2_pair(words, w4, zm, sh, dh, c: tl.constexpr, dtype: tl.constexpr):
    """Nibbles 2c, 2c + 1 of each word dequantized in one 32-bit register (BN, BW) x 2, as (BN, BW, 2)."""
    if dtype == tl.bfloat16:
        if c == 0:
            return _h2_asm_call(words, w4, zm, sh, dh, H2_BF16_0, dtype)
        elif c == 1:
            return _h2_asm_call(words, w4, zm, sh, dh, H2_BF16_1, dtype)
        elif c == 2:
            return _h2_asm_call(words, w4, zm, sh, dh, H2_BF16_2, dtype)
        else:
            return _h2_asm_call(words, w4, zm, sh, dh, H2_BF16_3, dtype)
    else:
        if c == 0:
            return _h2_asm_call(words, w4, zm, sh, dh, H2_F16_0, dtype)
        elif c == 1:
            return _h2_asm_call(words, w4, zm, sh, dh, H2_F16_1, dtype)
        elif c == 2:
            return _h2_asm_call(words, w4, zm, sh, dh, H2_F16_2, dtype)
        else:
            return _h2_asm_call(words, w4, zm, sh, dh, H2_F16_3, dtype)


@triton.jit
def _dequant_tile(words, s, b, UNPACK: tl.constexpr, dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_W: tl.constexpr):
    """(BN, BW) packed words, s and b fp32 (BN,) or (BN, BW) -> (BN, 8 BW) weights in the K order p = c * 2BW + 2j + e
    <-> k = 8j + 2c + e. The joins, the permute and the reshapes only rename registers."""
    if len(s.shape) == 1:  # one group per row: broadcast along the tile
        s = s[:, None]
        b = b[:, None]
    if UNPACK == 2:  # pairs in 16-bit arithmetic (GPU only: inline PTX); one shift serves the four pairs
        zm, sh, dh = _h2_meta(s, b, dtype)
        w4 = words >> 4
        p0 = _h2_pair(words, w4, zm, sh, dh, 0, dtype)  # (BN, BW, 2): nibbles 0, 1
        p1 = _h2_pair(words, w4, zm, sh, dh, 1, dtype)
        p2 = _h2_pair(words, w4, zm, sh, dh, 2, dtype)
        p3 = _h2_pair(words, w4, zm, sh, dh, 3, dtype)
    else:
        s_lo = s * 2048.0
        b_lo = b - s_lo  # exact for b = -z s (module docstring)
        s_hi = s * 128.0
        b_hi = b - s_hi
        p0 = tl.join(_weight(words, 0, UNPACK, s_lo, b_lo, s_hi, b_hi, dtype),
                     _weight(words, 1, UNPACK, s_lo, b_lo, s_hi, b_hi, dtype))  # (BN, BW, 2): q = 2j + e
        p1 = tl.join(_weight(words, 2, UNPACK, s_lo, b_lo, s_hi, b_hi, dtype),
                     _weight(words, 3, UNPACK, s_lo, b_lo, s_hi, b_hi, dtype))
        p2 = tl.join(_weight(words, 4, UNPACK, s_lo, b_lo, s_hi, b_hi, dtype),
                     _weight(words, 5, UNPACK, s_lo, b_lo, s_hi, b_hi, dtype))
        p3 = tl.join(_weight(words, 6, UNPACK, s_lo, b_lo, s_hi, b_hi, dtype),
                     _weight(words, 7, UNPACK, s_lo, b_lo, s_hi, b_hi, dtype))
    Q: tl.constexpr = 2 * BLOCK_W
    quad = tl.join(tl.join(tl.reshape(p0, (BLOCK_N, Q)), tl.reshape(p1, (BLOCK_N, Q))),
                   tl.join(tl.reshape(p2, (BLOCK_N, Q)), tl.reshape(p3, (BLOCK_N, Q))))  # (BN, Q, c & 1, c >> 1)
    return tl.reshape(tl.permute(quad, (0, 3, 2, 1)), (BLOCK_N, 4 * Q))  # p = c * Q + q


@triton.jit
def _group_meta(s_ptr, z_ptr, meta_rows, k0, offs_w, G: tl.constexpr, BLOCK_W: tl.constexpr):
    """Scales (as fp32) and zeros of the K tile starting at k0: (BN,) when the tile lies in one group (a 1-D load
    takes the layout its use wants; a 2-D one would cost a shuffle of the dequantized tile), else (BN, BW), one per
    word (a word's nibbles share a group). The fp16 scale load stays a plain load in the loop (too narrow for
    cp.async; as int32 pairs, Triton routed the tile through shared memory, and so did a scale loaded one step
    ahead by hand: the loop-carried value took another layout)."""
    GW: tl.constexpr = G // 8  # words per group
    if BLOCK_W <= GW:
        off = meta_rows + k0 // G
    else:
        off = meta_rows[:, None] + (k0 // G + offs_w // GW)[None, :]
    return tl.load(s_ptr + off).to(tl.float32), tl.load(z_ptr + off)


# M and SPLIT_K are not specialized (Triton would compile a variant per divisibility of M, and make SPLIT_K = 1 a
# constant): one compiled kernel serves every prompt length and split of a tile config.
@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym,
                       K8, NG, SPLIT_K, G: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, UNPACK: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # UPCAST_DOT (interpreter + bf16 only): Triton 3.6's interpreter multiplies bf16 tiles as raw uint16, so both
    # operands are widened to fp32 first (exact). Grid (row tiles, column tiles, splits): row tiles vary fastest, so
    # the programs that read one weight tile run together and it comes from HBM once.
    BLOCK_K: tl.constexpr = 8 * BLOCK_W
    Q: tl.constexpr = 2 * BLOCK_W
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # Rows past M / N wrap around instead of being masked, so every load is unmasked; the store drops them.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_w = tl.arange(0, BLOCK_W)
    p = tl.arange(0, BLOCK_K)
    # The K order of _dequant_tile, k = 8j + 2c + e, in the form whose runs of 2 contiguous, 4-byte aligned elements
    # Triton's axis analysis sees: x is copied with 4-byte cp.async (other forms give 2-byte loads).
    kk = p % 2 + 8 * ((p // 2) % BLOCK_W) + 2 * (p // Q)
    # x tile, transposed (BK, BM): loop-invariant int32 offsets from one scalar pointer that moves (the launcher
    # checks M * stride_xm < 2^31): 64-bit pointer tiles advanced every step cost ~6 instructions per 4-byte copy.
    xt_offs = offs_m[None, :] * stride_xm + kk[:, None]
    qw_ptrs = qw_ptr + offs_n[:, None].to(tl.int64) * K8 + offs_w[None, :]  # (BN, BW)
    meta_rows = offs_n.to(tl.int64) * NG
    # This split's K tiles.
    n_k = K // BLOCK_K
    per_split = tl.cdiv(n_k, SPLIT_K)
    it0 = pid_k * per_split
    it1 = tl.minimum(it0 + per_split, n_k)
    qw_ptrs += it0 * BLOCK_W
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(it0, it1):
        s, b = _group_meta(s_ptr, z_ptr, meta_rows, it * BLOCK_K, offs_w, G, BLOCK_W)
        xt = tl.load((x_ptr + it * BLOCK_K) + xt_offs)  # (BK, BM)
        words = tl.load(qw_ptrs)  # (BN, BW) int32
        w = _dequant_tile(words, s, b, UNPACK, xt.dtype, BLOCK_N, BLOCK_W)  # (BN, BK), permuted K
        if UPCAST_DOT:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
        else:
            acc = tl.dot(w, xt, acc)
        qw_ptrs += BLOCK_W
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (cols < N)[:, None] & (rows < M)[None, :]  # (BN, BM)
    out_offs = rows[None, :].to(tl.int64) * stride_ym + cols[:, None]
    if SPLIT_K == 1:
        _store_tile(acc, y_ptr, out_offs, mask, bias_ptr, cols, N, HAS_BIAS)
    else:
        part_offs = rows[None, :].to(tl.int64) * N + cols[:, None]
        tile_elems = M.to(tl.int64) * N
        tl.store(ws_ptr + pid_k * tile_elems + part_offs, acc, mask=mask)
        # Every thread's partial is written (barrier) before one thread's release-acquire increment publishes them;
        # the split that sees count SPLIT_K - 1 is the last and owns the tile.
        tl.debug_barrier()
        tile = pid_n * tl.num_programs(0) + pid_m
        count = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if count == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            # Fixed order: the same sum whichever split came last. A runtime loop (unrolled, all loads live: spills).
            for k in tl.range(0, SPLIT_K, num_stages=1):
                total += tl.load(ws_ptr + k * tile_elems + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            _store_tile(total, y_ptr, out_offs, mask, bias_ptr, cols, N, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call


@triton.jit
def _store_tile(acc, y_ptr, out_offs, mask, bias_ptr, cols, N, HAS_BIAS: tl.constexpr):
    """y^T tile (BN, BM) fp32 (+ bias per row of W) -> y, rounded once to y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# -- tile choice ------------------------------------------------------------------------------------------
def m_bucket(M: int) -> int:
    """Prompt lengths that share a config (and a compiled kernel): powers of two from 16 up."""
    return max(16, triton.next_power_of_2(M))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def config_ok(cfg: Config) -> bool:
    """Whether a config compiles well for sm_90 (Triton 3.6's ptxas, fp16 and bf16): one warpgroup per 64 weight rows
    (BLOCK_N = 16 num_warps; else the dequantized tile goes through shared memory), BLOCK_W 8 or 16, and no register
    spills in the main loop (128-row tiles need BLOCK_W 8 or 8+ warps; 256-row tiles BLOCK_W 8 and 8 warps; 16 warps
    fit 128 registers a thread up to 128 rows)."""
    if cfg.num_warps not in (4, 8, 16) or cfg.block_n != 16 * cfg.num_warps or cfg.block_w not in (8, 16):
        return False
    if cfg.block_m == 128:
        return cfg.block_w == 8 or cfg.num_warps >= 8
    if cfg.block_m == 256:
        return cfg.block_w == 8 and cfg.num_warps == 8
    return cfg.block_m in (16, 32, 64) and cfg.split_k >= 1 and cfg.num_stages >= 1


def split_for(tiles: int, n_k: int, target: int) -> int:
    """Split-K factor: doubles while the grid stays within `target` programs and each split keeps >= 4 K steps."""
    split = 1
    while tiles * split * 2 <= target and n_k // (split * 2) >= 4:
        split *= 2
    return split


def rule_config(M: int, N: int, K: int, n_sm: int = 132) -> Config:
    """Tiles by rule, for shapes the table lacks. One row tile covers the prompt up to 256 rows (each weight is
    dequantized once per row tile); 64 weight rows per program below 64 prompt rows (more, smaller programs for the
    memory-bound case), else 128 (two warpgroups). Split-K until the grid reaches 2 programs per SM (1 from 128 rows:
    those programs fill an SM's registers)."""
    bm = min(m_bucket(M), 256)
    if bm <= 32:
        bn, warps, bw, stages = 64, 4, 16, 4
    elif bm == 64:
        bn, warps, bw, stages = 128, 8, 16, 4
    elif bm == 128:
        bn, warps, bw, stages = 128, 8, 16, 3
    else:
        bn, warps, bw, stages = 128, 8, 8, 4
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split = split_for(tiles, K // (8 * bw), n_sm * (2 if bm <= 64 else 1))
    return Config(bm, bn, bw, split, warps, stages)


def pick_config(M: int, N: int, K: int, device: torch.device) -> Config:
    """CONFIG_TABLE's tile for (M bucket, N, K), else the rule (with the device's SM count)."""
    cfg = CONFIG_TABLE.get((m_bucket(M), N, K))
    if cfg is None:
        n_sm = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 132
        cfg = rule_config(M, N, K, n_sm)
    return cfg


def fit_config(cfg: Config, K: int, G: int) -> Config:
    """Adapts a config to K and G: BLOCK_W at most one group (G / 8 words; per-word scales' 2-D loads send the
    dequantized tile through shared memory) and at least 8 (a nibble pair then spans one 16-deep MMA step), a
    divisor of K's words, and SPLIT_K at most the number of K steps."""
    bw = max(8, min(cfg.block_w, G // 8))
    while bw > 8 and (K // 8) % bw:
        bw //= 2
    return cfg._replace(block_w=bw, split_k=max(1, min(cfg.split_k, K // (8 * bw))))


# -- workspaces -------------------------------------------------------------------------------------------
_SCRATCH: dict[tuple, torch.Tensor] = {}
_CAPTURED: set[tuple] = set()      # keys whose buffer a CUDA graph captured (a prefill graph bakes its address)
_RETIRED: list[torch.Tensor] = []  # such buffers once outgrown: never freed, since the graph still replays them


def scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
    """A flat buffer of >= numel elements kept per (name, dtype, device) and grown (x1.5) when too small, so prefill
    does not allocate per call. Stream-ordered reuse: valid until the next call that asks for it. `zero` buffers
    (the split-K counters) start at zero and are returned to zero by their users. Under CUDA-graph capture a buffer
    must already be large enough (run the call once eagerly first); one handed to a capture outlives its growth."""
    key = (name, dtype, device)  # the device itself: str(device) cost ~1 us per call, and eager prefill is host-bound
    buf = _SCRATCH.get(key)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if buf is None or buf.numel() < numel:
        if capturing:
            raise RuntimeError(f"w4a16_gemm: workspace {name!r} must grow before CUDA-graph capture: "
                               "run the same call once eagerly first")
        if key in _CAPTURED:
            _RETIRED.append(buf)
            _CAPTURED.discard(key)
        size = max(numel, int(1.5 * buf.numel()) if buf is not None else 0)
        buf = (torch.zeros if zero else torch.empty)(size, dtype=dtype, device=device)
        _SCRATCH[key] = buf
    if capturing:
        _CAPTURED.add(key)
    return buf[:numel]


# -- launcher -------------------------------------------------------------------------------------------
class _Plan(NamedTuple):
    """What one distinct call runs (built by _plan)."""
    M: int
    N: int
    K: int
    path: str  # "fused", "wgmma" or "dequant"
    split_k: int  # the fused or Gluon kernel's split (1: its workspace and counters are 1-element placeholders)
    counters: int  # split-K counters (one per output tile)
    launch: object  # the fused kernel's Launch, the Gluon kernel's WgmmaLaunch; None on the dequant path or M == 0


# Plans per distinct call (every tensor's shape, strides, dtype and device, the options and the module switches
# read): a prefill makes the same 4 calls every layer, so each pays dispatch and the tile choice once (launch.py).
_PLANS = Plans()


def _plan(x, qweight, scales, zeros, bias, out, config, path, unpack, wgmma) -> _Plan:
    M, N, K, G = check_w4_args(x, qweight, scales, zeros, bias)
    if path is None:  # a pinned Gluon tile or its table; else dequant + cuBLAS at long prompts (and odd K); else fused
        pinned = _wgmma is not None and isinstance(config, _wgmma.Tile)
        path = ("wgmma" if pinned or (config is None and wgmma and wgmma_wins(x, qweight, G)) else
                "dequant" if (x.is_cuda and not INTERPRET and M >= DEQUANT_MIN_M) or K % 64 else "fused")
    if path not in ("fused", "wgmma", "dequant"):
        raise ValueError(f"path must be 'fused', 'wgmma' or 'dequant', got {path!r}")
    if path == "fused" and K % 64:
        raise ValueError(f"the fused W4 GEMM needs K % 64 == 0 (got K={K}); use path='dequant'")
    if path == "fused" and M * x.stride(0) >= 2**31:
        raise ValueError(f"the fused W4 GEMM addresses x with int32 offsets: M * stride ({M} * {x.stride(0)}) must "
                         "be < 2^31; use path='dequant'")
    if out is not None and (out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be ({M}, {N}) {x.dtype} with unit stride along N")
    if path == "wgmma":
        return _wgmma_plan(x, qweight, bias, out, config, M, N, K, G)
    if M == 0 or path == "dequant":
        return _Plan(M, N, K, path, 1, 1, None)
    if config is None:
        config = pick_config(M, N, K, x.device)
    if unpack is None:
        unpack = 0 if INTERPRET or not x.is_cuda else 1
    if unpack not in (0, 1, 2):
        raise ValueError(f"unpack must be 0 (plain ops), 1 (PTX lop3) or 2 (16-bit pairs), got {unpack!r}")
    if unpack and INTERPRET:
        raise ValueError(f"unpack={unpack} (inline PTX) cannot run under TRITON_INTERPRET; use unpack=0")
    cfg = fit_config(config, K, G)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), cfg.split_k)
    stride_ym = N if out is None else out.stride(0)
    launch = Launch(_w4a16_gemm_kernel, grid, (M, N, K, x.stride(0), stride_ym, K // 8, K // G, cfg.split_k),
                    dict(G=G, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                         BLOCK_W=cfg.block_w, UNPACK=unpack, UPCAST_DOT=not x.is_cuda and x.dtype == torch.bfloat16,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return _Plan(M, N, K, path, cfg.split_k, grid[0] * grid[1], launch)


def wgmma_wins(x: torch.Tensor, qweight: torch.Tensor, G: int) -> bool:
    """Whether the default dispatch takes the Gluon kernel: on sm_90 under Triton 3.6, for the (M bucket, N, K) that
    its TILE_TABLE lists (where the sweep measured it faster than this module's kernel), when the operands suit TMA
    and the tile's shared memory fits at this group size."""
    M, K = x.shape
    if _wgmma is None or INTERPRET or not x.is_cuda:
        return False
    tile = _wgmma.TILE_TABLE.get((m_bucket(M), qweight.shape[0], K))
    return (tile is not None and _wgmma.ok(x, qweight, G)
            and _wgmma.smem_bytes(_wgmma.fit_tile(tile, K, G), K, G) <= _wgmma.SMEM_LIMIT)


def _wgmma_plan(x, qweight, bias, out, config, M, N, K, G) -> _Plan:
    if _wgmma is None or not _wgmma.ok(x, qweight, G):
        raise ValueError("path='wgmma' needs an sm_90 GPU under Triton 3.6, fp16/bf16 x with 16-byte aligned rows, "
                         f"K (={K}) a multiple of min(128, G={G}) and a contiguous qweight; use path='fused'")
    tile = config if config is not None else _wgmma.TILE_TABLE.get((m_bucket(M), N, K), _wgmma.DEFAULT_TILE)
    if not _wgmma.tile_ok(tile):
        raise ValueError(f"w4a16_gemm: {tile} is not a valid tile of the Gluon kernel (w4a16_gemm_wgmma.tile_ok)")
    tile = _wgmma.fit_tile(tile, K, G)
    if _wgmma.smem_bytes(tile, K, G) > _wgmma.SMEM_LIMIT:
        raise ValueError(f"w4a16_gemm: {tile.name} needs {_wgmma.smem_bytes(tile, K, G)} bytes of shared memory at "
                         f"K={K}, G={G} (limit {_wgmma.SMEM_LIMIT}): fewer stages, a larger split or path='fused'")
    counters = _wgmma.counters(tile, M, N)
    launch = _wgmma.WgmmaLaunch(M, N, K, G, tile, x.dtype, bias is not None, N if out is None else out.stride(0))
    return _Plan(M, N, K, "wgmma", tile.split_k, counters, launch)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               config: Config | None = None, path: str | None = None, unpack: int | None = None,
               direct: bool = True, wgmma: bool = True) -> torch.Tensor:
    """(M, K) x packed (N, K) W4 -> (M, N) in x's dtype. `config` pins the tiles (a Config of the fused kernel, else
    CONFIG_TABLE / rule_config; a w4a16_gemm_wgmma.Tile: the Gluon kernel, else its TILE_TABLE); `path` forces
    "fused" (this module's Triton kernel), "wgmma" (the Gluon kernel: sm_90, Triton 3.6) or "dequant" (dequantize to
    a workspace + a dense matmul); default: the Gluon kernel where its TILE_TABLE lists the shape, `wgmma` is on and
    no Config is pinned; else dequant (from DEQUANT_MIN_M rows on CUDA, or K % 64 != 0); else fused. `unpack`: the
    fused kernel's dequantization, 1 inline PTX (GPU default), 2 16-bit pairs (GPU), 0 plain ops, same bits. direct:
    after the first launch, skip Triton's dispatch (launch.py; fused and dequant paths, not the Gluon kernel)."""
    key = (tensor_key(x), tensor_key(qweight), tensor_key(scales), tensor_key(zeros), tensor_key(bias), tensor_key(out),
           config, path, unpack, DEQUANT_MIN_M, INTERPRET, wgmma)
    plan = _PLANS.get_or_build(key, lambda: _plan(x, qweight, scales, zeros, bias, out, config, path, unpack, wgmma))
    M, N, K = plan.M, plan.N, plan.K
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if plan.path == "dequant":
        w = w4a16_dequant(qweight, scales, zeros, out=scratch("w4_dequant", N * K, x.dtype, x.device).view(N, K),
                          direct=direct)
        if bias is None:
            return torch.mm(x, w.T, out=out)
        return torch.addmm(bias, x, w.T, out=out)
    # Same buffer types always (1 element if unused): pointer dtypes are in the signature; one kernel serves all splits.
    split = plan.split_k > 1
    ws = scratch("w4_splitk", plan.split_k * M * N if split else 1, torch.float32, x.device)
    cnt = scratch("w4_counters", plan.counters if split else 1, torch.int32, x.device, zero=True)
    if plan.path == "wgmma":  # the Gluon kernel (the same workspaces and counter protocol)
        return plan.launch(x, qweight, scales, zeros, bias, out, ws, cnt)
    plan.launch(x, qweight, scales, zeros, bias if bias is not None else scales, out, ws, cnt, direct=direct)
    return out


def _buckets(max_m: int) -> list[int]:
    """The M buckets of prompts of 9..max_m rows (the GEMV takes up to 8)."""
    out, b = [], 16
    while True:
        out.append(b)
        if b >= max_m:
            return out
        b *= 2


def warmup(shapes: list[tuple[int, int]], group_size: int, dtype: torch.dtype, device: torch.device | str,
           bias: bool = False, max_m: int = DEQUANT_MIN_M - 1) -> int:
    """Compiles the kernel the default dispatch runs (the fused Triton GEMM, or the Gluon one at its table's shapes) for
    every M bucket up to max_m and each (N, K) in `shapes`, so the first prompts of a chat do not wait for Triton's
    compiler (later runs: its disk cache). Returns the number of calls made."""
    device = torch.device(device)
    calls = 0
    for N, K in shapes:
        if K % 64:
            continue
        qweight = torch.zeros(N, K // 8, dtype=torch.int32, device=device)
        scales = torch.ones(N, K // group_size, dtype=dtype, device=device)
        zeros = torch.zeros(N, K // group_size, dtype=torch.float32, device=device)
        b = torch.zeros(N, dtype=dtype, device=device) if bias else None
        for bucket in _buckets(max_m):
            x = torch.zeros(min(bucket, max_m), K, dtype=dtype, device=device)
            w4a16_gemm(x, qweight, scales, zeros, b)
            calls += 1
    return calls


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: dequantize (rounded to x's dtype) -> fp32 matmul -> cast; the CPU path and test oracle."""
    return w4a16_ref(x, qweight, scales, zeros, bias)
