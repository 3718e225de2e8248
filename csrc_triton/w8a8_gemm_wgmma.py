"""W8A8 GEMM for Hopper in Gluon: int8 wgmma kept in flight across K steps.

    out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n] + bias[n] + residual[m, n]

The same operation, operands and epilogue as w8a8_gemm.py (its docstring has the layouts), for sm_90 only. Why a
second kernel: Triton 3.6's software pipeliner keeps a wgmma in flight across K steps only when its accumulator is
fp32, so every K step of the Triton int8 GEMM waits for its own wgmma before the next is issued. Here the pipeline
is written out in Gluon (Triton's explicit-layout dialect), in two forms, both persistent (one program per SM takes
tiles pid, pid + P, ... in grouped order):

- `_w8a8_wgmma_kernel`: all warps share each tile. Its tiles form ONE stream of K steps through a STAGES-deep ring
  of TMA loads that runs ahead across tile boundaries, so the next tile's first loads are in flight during this
  tile's epilogue. Each K step issues its wgmmas asynchronously and then waits only for the previous step's, whose
  operand stage is then refilled with the step STAGES - 1 ahead. The tile's two halves are two accumulators (column
  halves of 128 x 256, row halves of 256 x 128), so the epilogue runs a half at a time without reshaping.
- `_w8a8_pingpong_kernel`, warp-specialised: one producer warp issues every K step's TMA loads into one ring in
  tile order; two consumer warpgroups take the program's 128 x 128 tiles alternately, each starting its K loop when
  the other has issued its previous tile's wgmmas (an mbarrier each way), so the K loops take the tensor cores in
  turn while each warpgroup's epilogue overlaps the other's K loop. Best where K is short and the epilogue a large
  share of a tile (K = 1152); at K = 4304 its 128-wide tiles' L2 traffic limits it (docs/perf_notes.md).

Epilogue (both): fp32 in the reference's order, the residual loaded by TMA into shared memory, one rounding,
stored through shared memory by TMA. Edges (M, N, the K tail) are zero-filled by TMA loads and clipped by TMA
stores. Integer sums are exact, so every form gives the Triton kernel's bits.

No interpreter form: Gluon kernels run on the GPU only. w8a8_gemm.w8a8_gemm checks a call and dispatches here the
GEMMs it would run on its persistent 128 x 256 kernel, in the form `w8a8_gemm._wgmma_form` picks by K, on sm_90
under Triton 3.6 with TMA-suited operands (`ok`), unless called with wgmma=False. The plain PyTorch form is
`w8a8_gemm_wgmma_ref` (= the Triton kernel's reference).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import device_caps, tma_aligned, w8a8_ref


@gluon.jit
def _tile_mn(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(off_m, off_n) of output tile `tile` in grouped order (GROUP_M row tiles share a column tile of b in L2)."""
    n_pid_m = gl.cdiv(M, BLOCK_M)
    n_pid_n = gl.cdiv(N, BLOCK_N)
    group = tile // (GROUP_M * n_pid_n)
    first_m = group * GROUP_M
    size_m = gl.minimum(n_pid_m - first_m, GROUP_M)
    return (first_m + (tile % (GROUP_M * n_pid_n)) % size_m) * BLOCK_M, ((tile % (GROUP_M * n_pid_n)) // size_m) * BLOCK_N


@gluon.jit
def _load_step(a_desc, b_desc, a_smem, b_smem, ready, step, off_m, off_n, kt, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """Issue the TMA loads of this program's K step `step` (K tile kt of the tile at off_m, off_n) into its ring
    stage, signalling ready[stage] when they land."""
    s = step % STAGES
    k = kt * BLOCK_K
    mbarrier.expect(ready.index(s), (BLOCK_M + BLOCK_N) * BLOCK_K)
    tma.async_copy_global_to_shared(a_desc, [off_m, k], ready.index(s), a_smem.index(s))
    tma.async_copy_global_to_shared(b_desc, [off_n, k], ready.index(s), b_smem.index(s))


@gluon.jit
def _scaled(acc, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, HAS_BIAS: gl.constexpr, ROWS: gl.constexpr,
            COLS: gl.constexpr, layout: gl.constexpr):
    """The epilogue's arithmetic on a (ROWS, COLS) accumulator: fp32 acc * a_scale[m] * b_scale[n] (+ bias[n])."""
    rm = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    rn = off_n + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    a_s = gl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    b_s = gl.load(b_scale_ptr + rn, mask=rn < N, other=0.0)
    out = acc.to(gl.float32) * gl.expand_dims(a_s, 1) * gl.expand_dims(b_s, 0)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(gl.float32)
        out = out + gl.expand_dims(bias, 0)
    return out


@gluon.jit
def _epilogue_half(acc, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_desc, c_desc, c_smem, r_smem,
                   r_bar, PHASE: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                   SUB_M: gl.constexpr, SUB_N: gl.constexpr, layout: gl.constexpr, C_BUFS: gl.constexpr):
    """One (SUB_M, SUB_N) half of a tile: acc (int32, the wgmma layout) -> fp32 acc * a_scale[m] * b_scale[n] +
    bias[n] + residual (TMA-loaded), one rounding, TMA-stored through c_smem (this half's of C_BUFS staging buffers:
    with two, the other half's store may still be reading its own)."""
    gl.thread_barrier()  # every thread is done with r_smem and c_smem's last use (the previous half)
    if HAS_RES:  # the residual's load first: it lands while the scales are applied
        mbarrier.expect(r_bar, SUB_M * SUB_N * res_desc.dtype.primitive_bitwidth // 8)
        tma.async_copy_global_to_shared(res_desc, [off_m, off_n], r_bar, r_smem)
    out = _scaled(acc, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, HAS_BIAS, SUB_M, SUB_N, layout)
    if HAS_RES:
        mbarrier.wait(r_bar, PHASE)
        out = out + r_smem.load(layout).to(gl.float32)
    tma.store_wait(pendings=C_BUFS - 1)  # the last store out of c_smem has left ...
    gl.thread_barrier()  # ... before any thread writes it
    c_smem.store(out.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def _w8a8_wgmma_kernel(a_desc, b_desc, a_scale_ptr, b_scale_ptr, bias_ptr, res_desc, c_desc, M, N,
                       K: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       IN_FLIGHT: gl.constexpr, NUM_PROGRAMS: gl.constexpr, num_warps: gl.constexpr):
    """Persistent: this program's tiles as one stream of K steps (see the module docstring). IN_FLIGHT: K steps
    whose wgmmas may still run when the next step's are issued (1; 0 waits for each, as Triton's int8 loop)."""
    # The tile's two halves, each its own accumulator: column halves (128 x 256: int8 wgmma is at most 224 wide
    # anyway), or row halves when the tile is taller than wide (256 x 128: each half still 128 wide).
    HALF_M: gl.constexpr = BLOCK_M > BLOCK_N
    SUB_M: gl.constexpr = BLOCK_M // 2 if HALF_M else BLOCK_M
    SUB_N: gl.constexpr = BLOCK_N if HALF_M else BLOCK_N // 2
    SECOND_M: gl.constexpr = SUB_M if HALF_M else 0  # the second half's offset in the tile
    SECOND_N: gl.constexpr = 0 if HALF_M else SUB_N
    pid = gl.program_id(0)
    n_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    K_TILES: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    steps = ((n_tiles - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS) * K_TILES
    a_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    # Output staging: one buffer with a residual (its own takes the room), else one per half (no wait on the other).
    C_BUFS: gl.constexpr = 1 if HAS_RES else 2
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [C_BUFS, SUB_M, SUB_N], c_desc.layout)
    r_smem = c_smem.index(0)  # placeholder without a residual
    if HAS_RES:
        r_smem = gl.allocate_shared_memory(res_desc.dtype, [SUB_M, SUB_N], res_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    r_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(r_bar, count=1)
    # The tile the loads are on (STAGES - 1 steps ahead of the wgmmas): offsets worked out once a tile (divisions).
    ld_m, ld_n = _tile_mn(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    for i in gl.static_range(STAGES - 1):
        if i % K_TILES == 0 and i > 0:
            ld_m, ld_n = _tile_mn(pid + (i // K_TILES) * NUM_PROGRAMS, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        if i < steps:
            _load_step(a_desc, b_desc, a_smem, b_smem, ready, i, ld_m, ld_n, i % K_TILES, BLOCK_M, BLOCK_N, BLOCK_K,
                       STAGES)

    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, SUB_N, 32])
    acc0 = gl.zeros((SUB_M, SUB_N), gl.int32, layout=layout)
    acc1 = gl.zeros((SUB_M, SUB_N), gl.int32, layout=layout)
    for step in range(steps):
        k = step % K_TILES
        s = step % STAGES
        mbarrier.wait(ready.index(s), (step // STAGES) & 1)
        a_s = a_smem.index(s)
        b_s = b_smem.index(s)
        if HALF_M:
            acc0 = warpgroup_mma(a_s.slice(0, SUB_M, dim=0), b_s.permute((1, 0)), acc0, use_acc=k != 0, is_async=True)
            acc1 = warpgroup_mma(a_s.slice(SUB_M, SUB_M, dim=0), b_s.permute((1, 0)), acc1, use_acc=k != 0,
                                 is_async=True)
        else:
            acc0 = warpgroup_mma(a_s, b_s.slice(0, SUB_N, dim=0).permute((1, 0)), acc0, use_acc=k != 0,
                                 is_async=True)
            acc1 = warpgroup_mma(a_s, b_s.slice(SUB_N, SUB_N, dim=0).permute((1, 0)), acc1, use_acc=k != 0,
                                 is_async=True)
        # With IN_FLIGHT 1 this step's two wgmma groups may run on; the previous step's are done: its stage is free.
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=2 * IN_FLIGHT, deps=(acc0, acc1))
        nxt = step + STAGES - 1
        if nxt < steps:
            if nxt % K_TILES == 0:
                ld_m, ld_n = _tile_mn(pid + (nxt // K_TILES) * NUM_PROGRAMS, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _load_step(a_desc, b_desc, a_smem, b_smem, ready, nxt, ld_m, ld_n, nxt % K_TILES, BLOCK_M, BLOCK_N,
                       BLOCK_K, STAGES)
        if k == K_TILES - 1:
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            off_m, off_n = _tile_mn(pid + (step // K_TILES) * NUM_PROGRAMS, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _epilogue_half(acc0, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_desc, c_desc,
                           c_smem.index(0), r_smem, r_bar, 0, HAS_BIAS, HAS_RES, SUB_M, SUB_N, layout, C_BUFS)
            _epilogue_half(acc1, off_m + SECOND_M, off_n + SECOND_N, M, N, a_scale_ptr, b_scale_ptr,
                           bias_ptr, res_desc, c_desc, c_smem.index(C_BUFS - 1), r_smem, r_bar, 1, HAS_BIAS, HAS_RES,
                           SUB_M, SUB_N, layout, C_BUFS)
    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(r_bar)


@gluon.jit
def _pp_loads(a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, pid, n_tiles, K_TILES: gl.constexpr,
              NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Ping-pong producer (one warp): every K step of this program's tiles, in order, into the STAGES-deep ring;
    a stage is refilled once its consumer has released it (empty), and signals ready when its bytes land."""
    for j in range(n_tiles):
        off_m, off_n = _tile_mn(pid + j * NUM_PROGRAMS, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        for k in range(K_TILES):
            step = j * K_TILES + k
            s = step % STAGES
            mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            _load_step(a_desc, b_desc, a_smem, b_smem, ready, step, off_m, off_n, k, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)


@gluon.jit
def _pp_tiles(a_smem, b_smem, ready, empty, turn, c_smem, r_bar, res_desc, c_desc, a_scale_ptr, b_scale_ptr, bias_ptr,
              M, N, pid, n_tiles, WG: gl.constexpr, K_TILES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
              HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Ping-pong consumer WG (one warpgroup): this program's tiles WG, WG + 2, ... Its K loop starts when the other
    warpgroup has issued all of its previous tile's wgmmas (turn); a stage is released (empty) once the wgmma that
    read it is done. Epilogue as _epilogue_half's, the whole tile at once through this warpgroup's staging buffer
    (which the residual is TMA-loaded into while the K loop runs)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    my_c = c_smem.index(WG)
    my_r = r_bar.index(WG)
    for j in range(WG, n_tiles, 2):
        off_m, off_n = _tile_mn(pid + j * NUM_PROGRAMS, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        if HAS_RES:
            tma.store_wait(pendings=0)  # the previous tile's store has left my_c ...
            gl.thread_barrier()
            mbarrier.expect(my_r, BLOCK_M * BLOCK_N * res_desc.dtype.primitive_bitwidth // 8)
            tma.async_copy_global_to_shared(res_desc, [off_m, off_n], my_r, my_c)  # ... so the residual lands there
        if j > 0:
            mbarrier.wait(turn.index(WG), ((j - 1) // 2) & 1)  # the other warpgroup's tile j - 1 is issued
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.int32, layout=layout)
        for k in range(K_TILES):
            step = j * K_TILES + k
            s = step % STAGES
            mbarrier.wait(ready.index(s), (step // STAGES) & 1)
            acc = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, use_acc=k != 0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if k > 0:
                mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
        mbarrier.arrive(turn.index(1 - WG), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((j * K_TILES + K_TILES - 1) % STAGES), count=1)
        out = _scaled(acc, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, HAS_BIAS, BLOCK_M, BLOCK_N, layout)
        if HAS_RES:
            mbarrier.wait(my_r, (j // 2) & 1)
            out = out + my_c.load(layout).to(gl.float32)
        else:
            tma.store_wait(pendings=0)
        gl.thread_barrier()  # every thread has read the residual / the last store has left, before my_c is written
        my_c.store(out.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], my_c)
    tma.store_wait(pendings=0)


@gluon.jit
def _w8a8_pingpong_kernel(a_desc, b_desc, a_scale_ptr, b_scale_ptr, bias_ptr, res_desc, c_desc, M, N,
                          K: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                          NUM_PROGRAMS: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Warp-specialised ping-pong form (num_warps 4): two consumer warpgroups (the default partition and a worker)
    take this program's tiles alternately, one producer warp feeds both through one ring in tile order."""
    pid = gl.program_id(0)
    K_TILES: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    n_tiles = (gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N) - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS
    a_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, BLOCK_M, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    r_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
        mbarrier.init(r_bar.index(i), count=1)
    gl.warp_specialize([
        (_pp_tiles, (a_smem, b_smem, ready, empty, turn, c_smem, r_bar, res_desc, c_desc, a_scale_ptr, b_scale_ptr,
                     bias_ptr, M, N, pid, n_tiles, 0, K_TILES, NUM_PROGRAMS, HAS_BIAS, HAS_RES, BLOCK_M, BLOCK_N,
                     GROUP_M, STAGES)),
        (_pp_tiles, (a_smem, b_smem, ready, empty, turn, c_smem, r_bar, res_desc, c_desc, a_scale_ptr, b_scale_ptr,
                     bias_ptr, M, N, pid, n_tiles, 1, K_TILES, NUM_PROGRAMS, HAS_BIAS, HAS_RES, BLOCK_M, BLOCK_N,
                     GROUP_M, STAGES)),
        (_pp_loads, (a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, pid, n_tiles, K_TILES, NUM_PROGRAMS, BLOCK_M,
                     BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


def ok(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether this kernel can run the call: sm_90 (wgmma is Hopper's), a 16-bit output (an fp32 tile's staging
    buffers would not fit beside the ring), every operand TMA-aligned."""
    if not a.is_cuda or c.dtype not in (torch.float16, torch.bfloat16):
        return False
    if device_caps(a.device.index if a.device.index is not None else torch.cuda.current_device())[2] != 9:
        return False
    return tma_aligned(a, b, c, residual)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES): what w8a8_gemm_wgmma runs unless told otherwise.
DEFAULT_TILE = (128, 256, 128, 8, 3)
# The ping-pong form's tile (num_warps is each consumer's: one warpgroup) and the registers its consumers ask for
# (the producer warp keeps 24; 168 a thread over the 12 warps fills the register file).
PINGPONG_TILE = (128, 128, 128, 4, 4)
PINGPONG_REGS = (232, 168)


def w8a8_gemm_wgmma(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
                    residual: torch.Tensor | None = None, tile: tuple | None = None, in_flight: int = 1,
                    group_m: int = 8, programs_per_sm: int = 1, out: torch.Tensor | None = None,
                    pingpong: bool = False) -> torch.Tensor:
    """w8a8_gemm's operation on sm_90 (the caller, w8a8_gemm, checks shapes, dtypes and `ok`). tile: (BLOCK_M,
    BLOCK_N, BLOCK_K, num_warps, STAGES), default DEFAULT_TILE (PINGPONG_TILE with pingpong); in_flight: 1 (a step's
    wgmmas overlapped with the next step) or 0; out: the (M, N) result buffer; pingpong: the warp-specialised form."""
    M, K = a.shape
    N = b.shape[0]
    bm, bn, bk, warps, stages = tile or (PINGPONG_TILE if pingpong else DEFAULT_TILE)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device) if out is None else out
    if M == 0 or N == 0:
        return c
    # The kernels' epilogue works on half a tile at a time (the ping-pong form's on a whole one).
    half = [bm, bn] if pingpong else [bm // 2, bn] if bm > bn else [bm, bn // 2]
    c_layout = gl.NVMMASharedLayout.get_default_for(half, _GL_DTYPES[out_dtype])
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.int8))
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gl.int8))
    c_desc = TensorDescriptor.from_tensor(c, half, c_layout)
    r_desc = TensorDescriptor.from_tensor(residual, half, c_layout) if residual is not None else c_desc
    n_prog = min(triton.cdiv(M, bm) * triton.cdiv(N, bn),
                 programs_per_sm * torch.cuda.get_device_properties(a.device).multi_processor_count)
    args = (a_desc, b_desc, a_scale.contiguous(), b_scale.contiguous(), bias if bias is not None else b_scale, r_desc,
            c_desc, M, N)
    if pingpong:
        _w8a8_pingpong_kernel[(n_prog,)](
            *args, K=K, HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=group_m, STAGES=stages, NUM_PROGRAMS=n_prog, CONSUMER_REGS=PINGPONG_REGS[0], num_warps=warps,
            maxnreg=PINGPONG_REGS[1])
        return c
    _w8a8_wgmma_kernel[(n_prog,)](
        *args, K=K, HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, GROUP_M=group_m, STAGES=stages, IN_FLIGHT=in_flight, NUM_PROGRAMS=n_prog, num_warps=warps)
    return c


def w8a8_gemm_wgmma_ref(a, b, a_scale, b_scale, bias=None, out_dtype=torch.float16, residual=None):
    """Plain PyTorch: the reference of csrc_triton.w8a8_gemm (exact int32 product, then the fp32 epilogue)."""
    return w8a8_ref(a, b, a_scale, b_scale, bias, out_dtype, residual)
