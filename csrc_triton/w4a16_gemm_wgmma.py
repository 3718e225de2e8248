"""W4A16 GEMM for Hopper in Gluon, for short prompts: the weights stream through a ring of TMA loads.

    y (M, N) = x (M, K) @ W^T + bias, W packed as in tinyvila/quant.py (layouts: w4a16_gemm.py's docstring)

Why a second kernel: the Triton kernel (w4a16_gemm.py) loads each K step's packed words with plain loads that its
software pipeliner does not run ahead, so at 16..64 rows (a follow-up question) every step waits for its words
from HBM, at one program per SM: the loop is latency-bound, at about a quarter of the bandwidth floor
(docs/perf_notes.md). Here the words and the x tile come by TMA into a STAGES-deep ring of shared memory that
runs STAGES steps ahead of the tensor cores, so the HBM latency is hidden behind the steps in between. Measured on
an H100 over vila-8b's 32 layers: 1.16-1.35x the Triton kernel at 16-48 rows (docs/benchmarks.md).

A program computes the transposed tile y^T (BLOCK_N, BLOCK_M) = W_tile (BLOCK_N, BK) @ x_tile^T over its split of K,
as the Triton kernel does: the dequantized weights are wgmma's register operand A, x (zero-filled past M by TMA) the
shared-memory operand B. One or two warpgroups a program, each 64 or 128 weight rows (one or two m64 blocks; four
warpgroups sharing each x tile measured slower everywhere: perf_notes). Each wgmma is waited for before the next
step's dequantization: the registers it reads are packed by the compiler from the fp16 tile and freed at issue, so an
in-flight wgmma would read overwritten operands; other programs on the SM fill the wait. Tiles with smem_a instead
store each step's weights (stmatrix) into one of two shared-memory buffers and keep one async wgmma in flight, so a
step's dequantization overlaps the last step's wgmma: 3-4% faster at 48 rows for qkv and down (H100), slower
elsewhere. Its 128-row tiles (long prompts) lose to dequant + cuBLAS (0.63-1.02x at 447-588 rows, 0.44-0.76x the fp16
cuBLAS call: perf_notes), so the table lists none. ws tiles warp-specialise a two-warpgroup program: each warpgroup is
a consumer of its own half of the rows and releases a stage through an mbarrier instead of meeting the other at a
barrier every step, and a producer warp keeps the ring full, so one's dequantization runs beside the other's wgmma: at
48 rows 1.04-1.16x the best one-partition tile (gate_up 49.4 vs 57.3 us, H100).
Dequantization in natural K order, in 16-bit pairs: the four lanes of a quad each need one byte of every word of
their rows (byte c = lane % 4 holds k = 8j + 2c, 8j + 2c + 1, exactly its fragment of A), so every lane reads the
whole words of its rows from shared memory (a broadcast within the quad) and turns byte c into a pair {q s + b}
with PRMT + LOP3 + HSUB2 + HFMA2 (bf16: a shift more), as w4a16_gemm's pair form (_h2_meta: the same operands, so the same bits). The
layout of the words says so (_word_layout): the quad's lanes are a third axis c of size 4, and joining the pair and
flattening (j, c, e) gives k = 8j + 2c + e in wgmma's A layout without moving data (asserted at compile time).
Each K step lies in one quantization group (BK <= G), so the scales are one per row and step; the split's scales
and zeros are loaded once into shared memory (GROUPS x BLOCK_N), where each step reads its group's. Split-K as in
w4a16_gemm.py: the last split of a tile (per-tile counter) sums the fp32 partials in split order (deterministic),
adds the bias and stores.
Limits: sm_90, fp16 or bf16, K % BK == 0, G in {32, 64, 128}; no interpreter form (Gluon runs on the GPU only):
the plain PyTorch reference is `w4a16_gemm_wgmma_ref` (the CPU path is w4a16_gemm's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import w4a16_ref


def _pair_asm(bf16: bool) -> str:
    """PTX of one byte c of a word (c = the lane's, in the selector register $4) as a dequantized pair {w_q, w_q'}:
    PRMT places the byte, LOP3 masks the two nibbles under magic halves, giving {m + q, m' + q'}; HSUB2 of {m + z,
    m' + z} leaves {q - z, q' - z} exactly, and HFMA2 by s plus d gives the weights, the pair form's (q - z) s + d
    with one rounding. fp16: byte c goes to bytes 0 and 2, q stays at bits 0..3 under m = 1024 (spacing 1) and q'
    at bits 20..23 under m' = 64 (spacing 1/16: q' counts whole units), 4 instructions. bf16 has too few mantissa
    bits for the second: as w4a16_gemm's pair form, byte c of the word and of the word >> 4 ($3), both under
    m = m' = 128."""
    if bf16:
        t, mask, magic = "bf16x2", 0x000F000F, 0x43004300
    else:
        t, mask, magic = "f16x2", 0x00F0000F, 0x54006400
    return ("{ .reg .b32 t, z, s, d; mov.b32 z, {$5, $6}; mov.b32 s, {$7, $7}; mov.b32 d, {$8, $8}; "
            f"prmt.b32 t, $2, $3, $4; lop3.b32 t, t, {mask}, {magic}, 0xEA; sub.{t} t, t, z; "
            f"fma.rn.{t} t, t, s, d; mov.b32 {{$0, $1}}, t; }}")


PAIR_F16 = gl.constexpr(_pair_asm(False))
PAIR_BF16 = gl.constexpr(_pair_asm(True))


def _word_layout(block_n: int, block_w: int, num_warps: int) -> gl.DistributedLinearLayout:
    """(BLOCK_N, BLOCK_W, 4) words x byte c: lane bits 0, 1 are c (k + 2, k + 4 in wgmma's A layout), lane bits 2..4
    rows + 1, + 2, + 4, warps rows + 16, + 32 (+ 64 with two warpgroups); in registers the words j (k + 8, + 16, ...),
    row + 8 and the further m64 blocks of the tile."""
    regs = [[0, 1 << i, 0] for i in range(block_w.bit_length() - 1)] + [[8, 0, 0]]
    r = 16 * num_warps
    while r < block_n:
        regs.append([r, 0, 0])
        r *= 2
    warps = [[16 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                      warp_bases=warps, block_bases=[], shape=[block_n, block_w, 4])


@gluon.jit
def _meta(s, b, BF16: gl.constexpr):
    """A group's pair-form operands of each row from its scale s and zero b (as w4a16_gemm._h2_meta): m + z, m' + z
    (_pair_asm's magic halves), s and d = b + z s in the dtype, with z = rint(-b / s) (0 where s is 0, clamped so
    that both stay integers of the dtype)."""
    MAG: gl.constexpr = 128.0 if BF16 else 1024.0
    MAG_HI: gl.constexpr = 128.0 if BF16 else 64.0
    dt = s.dtype
    s = s.to(gl.float32)
    z = gl.where(s == 0.0, 0.0, gl.extra.libdevice.rint(gl.extra.libdevice.fast_dividef(-b, s)))
    z = gl.minimum(gl.maximum(z, -MAG), MAG - 1.0)
    return (z + MAG).to(dt), (z + MAG_HI).to(dt), s.to(dt), (b + z * s).to(dt)


@gluon.jit
def _selector(WORDS: gl.constexpr, BF16: gl.constexpr):
    """PRMT's selector of byte c = lane % 4: fp16 c | c << 8; bf16 c | c << 4 | (4 + c) << 8 | (4 + c) << 12."""
    cs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, WORDS)))
    return gl.expand_dims(gl.expand_dims(cs * 0x1111 + 0x4400 if BF16 else cs * 0x101, 0), 0)


@gluon.jit
def _dequant(words, s, b, sel, BF16: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_W: gl.constexpr,
             a_layout: gl.constexpr):
    """(BN, BW) words (replicated over the quad), per-row scales and zeros (BN,) -> (BN, 8 BW) weights in wgmma's A
    layout."""
    z_lo, z_hi, sh, dh = _meta(s, b, BF16)
    w3, sel3 = gl.broadcast(gl.expand_dims(words, 2), sel)
    z_lo = gl.expand_dims(gl.expand_dims(z_lo, 1), 2)
    z_hi = gl.expand_dims(gl.expand_dims(z_hi, 1), 2)
    sh = gl.expand_dims(gl.expand_dims(sh, 1), 2)
    dh = gl.expand_dims(gl.expand_dims(dh, 1), 2)
    if BF16:
        w43, _ = gl.broadcast(gl.expand_dims(words >> 4, 2), sel)
        lo, hi = gl.inline_asm_elementwise(PAIR_BF16, "=h,=h,r,r,r,h,h,h,h", [w3, w43, sel3, z_lo, z_hi, sh, dh],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    else:
        lo, hi = gl.inline_asm_elementwise(PAIR_F16, "=h,=h,r,r,r,h,h,h,h", [w3, w3, sel3, z_lo, z_hi, sh, dh],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
    w = gl.reshape(gl.join(lo, hi), (BLOCK_N, 8 * BLOCK_W))  # (row, j, c, e) -> k = 8j + 2c + e
    return gl.convert_layout(w, a_layout, assert_trivial=True)


@gluon.jit
def _load_step(x_desc, w_desc, x_smem, w_smem, ready, t, it0, off_m, off_n, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_W: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of this program's K step t (K tile it0 + t) into stage t % STAGES; ready[stage] when they land."""
    s = t % STAGES
    kt = it0 + t
    mbarrier.expect(ready.index(s), BLOCK_N * BLOCK_W * 4 + BLOCK_M * BLOCK_W * 16)
    tma.async_copy_global_to_shared(w_desc, [off_n, kt * BLOCK_W], ready.index(s), w_smem.index(s))
    tma.async_copy_global_to_shared(x_desc, [off_m, kt * BLOCK_W * 8], ready.index(s), x_smem.index(s))


@gluon.jit
def _ws_loads(x_desc, w_desc, x_smem, w_smem, ready, empty, it0, n_steps, off_m, off_n, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_W: gl.constexpr, STAGES: gl.constexpr):
    """The ws tiles' producer warp: each K step into the ring once both consumers have released its stage."""
    for t in range(n_steps):
        mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        _load_step(x_desc, w_desc, x_smem, w_smem, ready, t, it0, off_m, off_n, BLOCK_M, BLOCK_N, BLOCK_W, STAGES)


@gluon.jit
def _ws_consumer(x_smem, w_smem, s_smem, z_smem, ready, empty, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym,
                 SPLIT_K, it0, n_steps, g0, pid_k, off_m, off_n, tile, WG: gl.constexpr, HAS_BIAS: gl.constexpr,
                 BF16: gl.constexpr, BLOCK_M: gl.constexpr, ROWS: gl.constexpr, BLOCK_W: gl.constexpr,
                 STAGES: gl.constexpr, GPK: gl.constexpr, WORDS: gl.constexpr):
    """A ws tile's consumer warpgroup WG: rows WG * ROWS.. of each stage's words, dequantized and multiplied as the
    one-partition kernel does, the stage released once its wgmma is done; no barrier with the other consumer, so
    one's dequantization runs beside the other's wgmma. Its rows are a split-K tile of their own (counter tile + WG)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    words_layout: gl.constexpr = gl.SliceLayout(2, WORDS)
    row_layout: gl.constexpr = gl.SliceLayout(1, words_layout)
    sel = _selector(WORDS, BF16)
    acc = gl.zeros((ROWS, BLOCK_M), gl.float32, layout=acc_layout)
    for t in range(n_steps):
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        words = w_smem.index(s).slice(WG * ROWS, ROWS).load(words_layout)
        g = (it0 + t) // GPK - g0
        a = _dequant(words, s_smem.index(g).slice(WG * ROWS, ROWS).load(row_layout),
                     z_smem.index(g).slice(WG * ROWS, ROWS).load(row_layout), sel, BF16, ROWS, BLOCK_W, a_layout)
        acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc)
        fence_async_shared()  # this stage's shared-memory reads are ordered before the TMA that refills it
        mbarrier.arrive(empty.index(s), count=1)
    _epilogue(acc, acc_layout, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, SPLIT_K, off_m, off_n + WG * ROWS,
              tile + WG, pid_k, HAS_BIAS, BLOCK_M, ROWS)


@gluon.jit(do_not_specialize=["M", "SPLIT_K"])
def _w4a16_wgmma_kernel(x_desc, w_desc, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, NG, SPLIT_K,
                        K: gl.constexpr, G: gl.constexpr, HAS_BIAS: gl.constexpr, BF16: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_W: gl.constexpr, STAGES: gl.constexpr,
                        GROUPS: gl.constexpr, WORDS: gl.constexpr, SMEM_A: gl.constexpr, READ_ONLY: gl.constexpr,
                        WS: gl.constexpr, WS_REGS: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_K: gl.constexpr = 8 * BLOCK_W
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    n_k: gl.constexpr = K // BLOCK_K
    per_split = gl.cdiv(n_k, SPLIT_K)
    it0 = pid_k * per_split
    n_steps = gl.minimum(per_split, n_k - it0)

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_W], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        if i < n_steps and not WS:
            _load_step(x_desc, w_desc, x_smem, w_smem, ready, i, it0, off_m, off_n, BLOCK_M, BLOCK_N, BLOCK_W, STAGES)

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    words_layout: gl.constexpr = gl.SliceLayout(2, WORDS)
    row_layout: gl.constexpr = gl.SliceLayout(1, words_layout)
    sel = _selector(WORDS, BF16)
    # This split's scales and zeros (GROUPS groups from g0), loaded once into shared memory as (group, row): a
    # step reads its group's row there instead of waiting on global loads.
    GPK: gl.constexpr = G // BLOCK_K  # K steps a group
    g0 = it0 // GPK
    LG: gl.constexpr = GROUPS if GROUPS < 32 else 32
    meta_layout: gl.constexpr = gl.BlockedLayout([1, 1], [LG, 32 // LG], [1, num_warps], [0, 1])
    gi = g0 + gl.arange(0, GROUPS, layout=gl.SliceLayout(1, meta_layout))
    rn = ((off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, meta_layout))) % N).to(gl.int64) * NG
    m_offs = gl.expand_dims(gi, 1) + gl.expand_dims(rn, 0)
    m_mask = gl.expand_dims(gi < NG, 1) & gl.expand_dims(rn >= 0, 0)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    rows_1d: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # the same bytes as GROUPS rows of BLOCK_N
    s_smem = gl.allocate_shared_memory(s_ptr.dtype.element_ty, [GROUPS, BLOCK_N], plain,
                                       value=gl.load(s_ptr + m_offs, mask=m_mask, other=0.0))
    z_smem = gl.allocate_shared_memory(gl.float32, [GROUPS, BLOCK_N], plain,
                                       value=gl.load(z_ptr + m_offs, mask=m_mask, other=0.0))
    s_smem = s_smem._reinterpret(s_ptr.dtype.element_ty, [GROUPS, BLOCK_N], rows_1d)
    z_smem = z_smem._reinterpret(gl.float32, [GROUPS, BLOCK_N], rows_1d)
    gl.thread_barrier()
    if WS:  # two consumer warpgroups (this partition and a worker), BLOCK_N / 2 rows each, fed by a producer warp
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
        tile = (pid_n * gl.num_programs(0) + pid_m) * 2
        ROWS: gl.constexpr = BLOCK_N // 2
        gl.warp_specialize([
            (_ws_consumer, (x_smem, w_smem, s_smem, z_smem, ready, empty, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N,
                            stride_ym, SPLIT_K, it0, n_steps, g0, pid_k, off_m, off_n, tile, 0, HAS_BIAS, BF16,
                            BLOCK_M, ROWS, BLOCK_W, STAGES, GPK, WORDS)),
            (_ws_consumer, (x_smem, w_smem, s_smem, z_smem, ready, empty, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N,
                            stride_ym, SPLIT_K, it0, n_steps, g0, pid_k, off_m, off_n, tile, 1, HAS_BIAS, BF16,
                            BLOCK_M, ROWS, BLOCK_W, STAGES, GPK, WORDS)),
            (_ws_loads, (x_desc, w_desc, x_smem, w_smem, ready, empty, it0, n_steps, off_m, off_n, BLOCK_M, BLOCK_N,
                         BLOCK_W, STAGES))], [4, 1], [WS_REGS, 24])
        return
    acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=acc_layout)
    if SMEM_A:  # two buffers of dequantized weights: step t writes one while step t - 1's wgmma reads the other
        a_smem = gl.allocate_shared_memory(x_desc.dtype, [2, BLOCK_N, BLOCK_K],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], x_desc.dtype))
    for t in range(n_steps):
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        if not READ_ONLY:  # (the bench's floor: the same ring and epilogue, no dequantization or wgmma)
            words = w_smem.index(s).load(words_layout)
            g = (it0 + t) // GPK - g0
            a = _dequant(words, s_smem.index(g).load(row_layout), z_smem.index(g).load(row_layout), sel, BF16,
                         BLOCK_N, BLOCK_W, a_layout)
            if SMEM_A:  # one wgmma in flight: this step's dequantization overlapped the last step's wgmma
                a_buf = a_smem.index(t % 2)
                a_buf.store(a)
                fence_async_shared()
                gl.thread_barrier()  # the warpgroup's rows are all written before its wgmma reads them
                acc = warpgroup_mma(a_buf, x_smem.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])  # step t - 1's is done: its stage and A buffer are free
            else:
                # Synchronous: wgmma reads A from registers that the compiler packs from `a` and frees at issue, so
                # the next step's dequantization would overwrite them under an in-flight wgmma. Other programs on the
                # SM (and the other warpgroups) fill the wait.
                acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc)
        if num_warps > 4:
            gl.thread_barrier()  # every warpgroup is done with the stage that refills
        LAG: gl.constexpr = 1 if SMEM_A else 0  # steps whose wgmma may still read their stage
        if t >= LAG and t - LAG + STAGES < n_steps:
            _load_step(x_desc, w_desc, x_smem, w_smem, ready, t - LAG + STAGES, it0, off_m, off_n, BLOCK_M, BLOCK_N,
                       BLOCK_W, STAGES)
    if SMEM_A and not READ_ONLY:
        acc = warpgroup_mma_wait(0, deps=[acc])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    _epilogue(acc, acc_layout, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, SPLIT_K, off_m, off_n,
              pid_n * gl.num_programs(0) + pid_m, pid_k, HAS_BIAS, BLOCK_M, BLOCK_N)


@gluon.jit
def _epilogue(acc, acc_layout: gl.constexpr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, SPLIT_K, off_m, off_n,
              tile, pid_k, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """A y^T tile (BLOCK_N rows of W from off_n, BLOCK_M rows of x from off_m) to y; with SPLIT_K > 1 through the
    fp32 workspace, the last split of the tile (its counter `tile`) summing the partials in split order."""
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))  # rows of W = columns of y
    ms = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
    mask = gl.expand_dims(cols < N, 1) & gl.expand_dims(ms < M, 0)
    out_offs = gl.expand_dims(ms.to(gl.int64) * stride_ym, 0) + gl.expand_dims(cols, 1)
    if SPLIT_K == 1:
        _store(acc, y_ptr, out_offs, mask, bias_ptr, cols, N, HAS_BIAS)
    else:
        part_offs = gl.expand_dims(ms.to(gl.int64) * N, 0) + gl.expand_dims(cols, 1)
        tile_elems = M.to(gl.int64) * N
        gl.store(ws_ptr + pid_k * tile_elems + part_offs, acc, mask=mask)
        gl.thread_barrier()  # every thread's partial is written before one increment publishes them
        count = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if count == SPLIT_K - 1:  # the last split owns the tile: the partials in split order
            total = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=acc_layout)
            for k in range(SPLIT_K):
                total += gl.load(ws_ptr + k * tile_elems + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            _store(total, y_ptr, out_offs, mask, bias_ptr, cols, N, HAS_BIAS)
            gl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call


@gluon.jit
def _store(acc, y_ptr, out_offs, mask, bias_ptr, cols, N, HAS_BIAS: gl.constexpr):
    """y^T tile (BN, BM) fp32 (+ bias per row of W) -> y, rounded once to y's dtype."""
    if HAS_BIAS:
        acc += gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 1)
    gl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_GL = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


class Tile(NamedTuple):
    """One tile configuration of the Gluon kernel."""

    block_m: int  # prompt rows per tile (wgmma N): 16, 32 or 64
    block_n: int  # weight rows per tile: 64 per warpgroup, one or two m64 blocks each
    block_w: int  # packed words per weight row per K step (BK = 8 block_w, at most one group)
    split_k: int  # programs sharing one output tile's K range
    stages: int  # TMA ring depth
    num_warps: int  # 4 or 8 (one or two warpgroups)
    smem_a: bool = False  # dequantized weights through shared memory, one async wgmma in flight
    ws: bool = False  # warp-specialised: two consumer warpgroups (num_warps 8) and a producer warp

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.block_w}k{self.split_k}s{self.stages}"
                f"x{self.num_warps}" + ("a" if self.smem_a else "") + ("p" if self.ws else ""))


# Tiles the table lacks (path="wgmma" forced at other shapes).
DEFAULT_TILE = Tile(64, 128, 16, 4, 4, 4)
# (M bucket, N, K) -> Tile, measured (scripts/benches/w4a16.py --w4-wgmma-sweep 16,32,48; fp16, group 128, Llama-3-8B
# layers; H100 SXM, each call replayed from a CUDA graph, at 7c69fe2; the ws entries from --w4-wgmma-sweep 48 at
# 8270602, buckets 16 and 32 not re-swept): the best tile where it beat the Triton kernel's table tile (all 12, by
# 3-44%); the Triton kernel runs the rest. Long prompts: none (docs/perf_notes.md).
TILE_TABLE: dict[tuple[int, int, int], Tile] = {
    (16, 4096, 4096): Tile(16, 64, 16, 4, 6, 4),  # x1.03
    (16, 4096, 14336): Tile(16, 64, 16, 8, 6, 4),  # x1.11
    (16, 6144, 4096): Tile(16, 64, 16, 4, 6, 4),  # x1.03
    (16, 28672, 4096): Tile(16, 64, 16, 2, 6, 4),  # x1.26
    (32, 4096, 4096): Tile(32, 64, 16, 4, 6, 4),  # x1.11
    (32, 4096, 14336): Tile(32, 64, 16, 4, 6, 4),  # x1.44
    (32, 6144, 4096): Tile(32, 64, 16, 2, 6, 4),  # x1.35
    (32, 28672, 4096): Tile(32, 128, 16, 1, 4, 4),  # x1.28
    (64, 4096, 4096): Tile(64, 64, 16, 2, 6, 4),  # x1.16
    (64, 4096, 14336): Tile(64, 128, 16, 4, 4, 8, ws=True),  # x1.35
    (64, 6144, 4096): Tile(64, 128, 16, 2, 4, 8, ws=True),  # x1.27
    (64, 28672, 4096): Tile(64, 256, 16, 1, 4, 8, ws=True),  # x1.43
}


def tile_ok(t: Tile) -> bool:
    """Whether a tile compiles without spills (sm_90, Triton 3.6): 64 weight rows a warpgroup, at most two m64 blocks
    each (245 registers a thread at two), 16-byte TMA rows of words (BLOCK_W >= 4), a ring that fits; 128-row tiles
    only with smem_a or ws and one block a warpgroup (ws there: 24-32 B of spills); ws tiles have two warpgroups, A in
    registers."""
    if t.num_warps not in (4, 8) or t.block_m not in (16, 32, 64, 128) or t.block_w not in (4, 8, 16):
        return False
    blocks = t.block_n // (16 * t.num_warps)
    if t.block_n not in (16 * t.num_warps * r for r in (1, 2)):
        return False
    if t.block_m > 64 and not ((t.smem_a or t.ws) and blocks == 1) or t.ws and (t.num_warps != 8 or t.smem_a):
        return False
    return t.split_k >= 1 and 2 <= t.stages


SMEM_LIMIT = 227 * 1024  # sm_90's shared memory a block


def smem_bytes(t: Tile, K: int, G: int) -> int:
    """A fitted tile's shared memory as compiled (tested; ws: at most, by 24 B): words, x, barriers, scales, zeros."""
    a = 2 * t.block_n * t.block_w * 16 if t.smem_a else 0  # two buffers of (BLOCK_N, BLOCK_K) 16-bit weights
    bars, ws = (16, 224) if t.ws else (8, 0)  # ready (and empty) a stage; ws: the partitions' captured arguments
    return (t.stages * (t.block_n * t.block_w * 4 + t.block_m * t.block_w * 16 + bars) + groups(t, K, G) * t.block_n * 6
            + a + ws)


def available(device: torch.device) -> bool:
    """sm_90 (wgmma, TMA) under Triton 3.6, the Gluon API this kernel is written against."""
    return (device.type == "cuda" and triton.__version__.startswith("3.6.")
            and torch.cuda.get_device_capability(device)[0] == 9)


def ok(x: torch.Tensor, qweight: torch.Tensor, group_size: int, block_w: int = 16) -> bool:
    """Whether this kernel can run the call: sm_90 under Triton 3.6, fp16/bf16, K a multiple of the K step,
    TMA-aligned rows."""
    if x.dtype not in _GL or not available(x.device):
        return False
    K = x.shape[1]
    bk = min(8 * block_w, group_size)
    return (group_size % bk == 0 and K % bk == 0 and x.stride(1) == 1 and (x.stride(0) * 2) % 16 == 0
            and x.data_ptr() % 16 == 0 and qweight.is_contiguous() and (qweight.shape[1] * 4) % 16 == 0
            and qweight.data_ptr() % 16 == 0)


def fit_tile(t: Tile, K: int, G: int) -> Tile:
    """BLOCK_W at most one group and a divisor of K's words; SPLIT_K at most the K steps, with no empty split."""
    bw = min(t.block_w, G // 8)
    while (K // 8) % bw:
        bw //= 2
    n_k = K // (8 * bw)
    split = max(1, min(t.split_k, n_k))
    return t._replace(block_w=bw, split_k=triton.cdiv(n_k, triton.cdiv(n_k, split)))


def groups(t: Tile, K: int, G: int) -> int:
    """Quantization groups a split's K range touches at most (a power of two: the shared-memory block of scales)."""
    gpk = G // (8 * t.block_w)
    per = triton.cdiv(K // (8 * t.block_w), t.split_k)
    return triton.next_power_of_2(triton.cdiv(per, gpk) + (gpk > 1))


# ws tiles: the registers a thread of the worker consumer asks for, and the kernel's limit (12 warps: the producer
# keeps 24, the default consumer gets the rest, 240; the file holds one program an SM).
WS_REGS = (240, 168)


def counters(t: Tile, M: int, N: int) -> int:
    """Split-K counters a call needs: one a tile (a ws tile's two consumers count their rows apart)."""
    return triton.cdiv(M, t.block_m) * triton.cdiv(N, t.block_n) * (2 if t.ws else 1)


class WgmmaLaunch:
    """One call shape's launch (a w4a16_gemm plan holds it): the shared-memory layouts, grid, scalars and constexprs
    fixed; per call the two TMA descriptors (x moves between calls), then Triton's own dispatch (~150 us of host time
    a call, measured: tinyvila runs this kernel where a CUDA graph is being built, tinyvila/cuda_graph.building)."""

    def __init__(self, M: int, N: int, K: int, G: int, tile: Tile, dtype: torch.dtype, has_bias: bool,
                 stride_ym: int):
        bm, bn, bw = tile.block_m, tile.block_n, tile.block_w
        self.x_block, self.w_block = [bm, 8 * bw], [bn, bw]
        self.x_layout = gl.NVMMASharedLayout.get_default_for(self.x_block, _GL[dtype])
        self.w_layout = gl.NVMMASharedLayout.get_default_for(self.w_block, gl.int32)
        self.grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), tile.split_k)
        self.scalars = (M, N, stride_ym, K // G, tile.split_k)
        self.meta = dict(K=K, G=G, HAS_BIAS=has_bias, BF16=dtype == torch.bfloat16, BLOCK_M=bm, BLOCK_N=bn,
                         BLOCK_W=bw, STAGES=tile.stages, GROUPS=groups(tile, K, G),
                         WORDS=_word_layout(bn // 2, bw, 4) if tile.ws else _word_layout(bn, bw, tile.num_warps),
                         SMEM_A=tile.smem_a, READ_ONLY=False, WS=tile.ws, WS_REGS=WS_REGS[0],
                         num_warps=4 if tile.ws else tile.num_warps, **({"maxnreg": WS_REGS[1]} if tile.ws else {}))

    def __call__(self, x, qweight, scales, zeros, bias, out, ws, counters):
        x_desc = TensorDescriptor(x, x.shape, x.stride(), self.x_block, self.x_layout)
        w_desc = TensorDescriptor(qweight, qweight.shape, qweight.stride(), self.w_block, self.w_layout)
        _w4a16_wgmma_kernel[self.grid](x_desc, w_desc, scales, zeros, bias if bias is not None else scales, out, ws,
                                       counters, *self.scalars, **self.meta)
        return out


def w4a16_gemm_wgmma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                     tile: Tile | None = None) -> torch.Tensor:
    """y = x @ W^T + bias by this kernel. The launcher is w4a16_gemm's "wgmma" path (it checks the call, fits the
    tile, keeps the split-K workspaces and the plan); this is that path by name."""
    from .w4a16_gemm import w4a16_gemm  # (w4a16_gemm imports this module)

    return w4a16_gemm(x, qweight, scales, zeros, bias, out=out, config=tile, path="wgmma")


def w4a16_gemm_wgmma_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch: dequantize (rounded to x's dtype) -> fp32 matmul -> cast, as w4a16_gemm_ref (the test oracle)."""
    return w4a16_ref(x, qweight, scales, zeros, bias)
