"""W8A8 GEMM for Hopper in Gluon: int8 wgmma kept in flight across K steps.

    out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n] + bias[n] + residual[m, n]

The same operation, operands and epilogue as csrc_triton/w8a8_gemm.py (its docstring has the layouts), for
sm_90 only. Why a second kernel: Triton 3.6's software pipeliner keeps a wgmma in flight across K steps only
when its accumulator is fp32, so every K step of the Triton int8 GEMM waits for its own wgmma before the next
is issued (docs/perf_notes.md, session 5). Here the pipeline is written out in Gluon (Triton's explicit-layout
dialect): a STAGES-deep ring of TMA loads, each K step issues its wgmma asynchronously and then waits only
for the previous one (`warpgroup_mma_wait(1)`), whose operand stage is then refilled with the tile STAGES - 1
steps ahead. Edges (M, N and the K tail) are zero-filled by TMA; the epilogue runs in the wgmma accumulator's
layout, in fp32 in the reference's order, one rounding, masked pointer stores.

No interpreter form: Gluon kernels run on the GPU only, so `w8a8_gemm_wgmma` is what ops dispatches to on
sm_90 where it was measured faster (see w8a8_gemm.py `_auto_config`), with `w8a8_gemm_wgmma_ref` (= the
Triton kernel's reference) as its plain PyTorch form.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from csrc_triton.w8a8_gemm import w8a8_gemm_ref


@gluon.jit
def _w8a8_wgmma_kernel(a_desc, b_desc, a_scale_ptr, b_scale_ptr, bias_ptr, res_ptr, c_ptr, M, N, stride_rm,
                       stride_cm, K: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                       STAGES: gl.constexpr, INSTR_N: gl.constexpr, IN_FLIGHT: gl.constexpr,
                       num_warps: gl.constexpr):
    """One (BLOCK_M, BLOCK_N) output tile per program, tiles in grouped order. IN_FLIGHT: wgmmas left running
    when a K step moves on (1: the overlap this kernel exists for; 0: wait for each, as Triton's int8 loop)."""
    off_m, off_n = _tile_mn(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    K_TILES: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    NBYTES: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K
    a_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES - 1):  # the prologue: the first STAGES - 1 K tiles
        if i < K_TILES:
            mbarrier.expect(ready.index(i), NBYTES)
            tma.async_copy_global_to_shared(a_desc, [off_m, i * BLOCK_K], ready.index(i), a_smem.index(i))
            tma.async_copy_global_to_shared(b_desc, [off_n, i * BLOCK_K], ready.index(i), b_smem.index(i))

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, INSTR_N, 32])
    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.int32, layout=mma_layout)
    for k in range(K_TILES):
        s = k % STAGES
        mbarrier.wait(ready.index(s), (k // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, is_async=True)
        # At most IN_FLIGHT wgmmas still running: with 1, step k - 1's is done, so its stage is free again.
        acc = warpgroup_mma_wait(num_outstanding=IN_FLIGHT, deps=(acc, ))
        nk = k + STAGES - 1
        if nk < K_TILES:
            ns = nk % STAGES
            mbarrier.expect(ready.index(ns), NBYTES)
            tma.async_copy_global_to_shared(a_desc, [off_m, nk * BLOCK_K], ready.index(ns), a_smem.index(ns))
            tma.async_copy_global_to_shared(b_desc, [off_n, nk * BLOCK_K], ready.index(ns), b_smem.index(ns))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    _epilogue(acc, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_ptr, c_ptr, stride_rm, stride_cm,
              HAS_BIAS, HAS_RES, BLOCK_M, BLOCK_N, mma_layout)


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
def _epilogue(acc, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_ptr, c_ptr, stride_rm, stride_cm,
              HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              mma_layout: gl.constexpr):
    """acc (int32, the wgmma layout) -> fp32 acc * a_scale[m] * b_scale[n] + bias[n] + residual, one rounding."""
    rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
    rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    a_s = gl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    b_s = gl.load(b_scale_ptr + rn, mask=rn < N, other=0.0)
    out = acc.to(gl.float32) * gl.expand_dims(a_s, 1) * gl.expand_dims(b_s, 0)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(gl.float32)
        out = out + gl.expand_dims(bias, 0)
    mask = gl.expand_dims(rm < M, 1) & gl.expand_dims(rn < N, 0)
    if HAS_RES:
        res = gl.load(res_ptr + gl.expand_dims(rm, 1) * stride_rm + gl.expand_dims(rn, 0), mask=mask, other=0.0)
        out = out + res.to(gl.float32)
    gl.store(c_ptr + gl.expand_dims(rm, 1) * stride_cm + gl.expand_dims(rn, 0), out.to(c_ptr.dtype.element_ty),
             mask=mask)


@gluon.jit
def _w8a8_wgmma_persistent_kernel(a_desc, b_desc, a_scale_ptr, b_scale_ptr, bias_ptr, res_ptr, c_ptr, M, N,
                                  stride_rm, stride_cm, K: gl.constexpr, HAS_BIAS: gl.constexpr,
                                  HAS_RES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                  BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                                  INSTR_N: gl.constexpr, IN_FLIGHT: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                                  num_warps: gl.constexpr):
    """Tiles pid, pid + NUM_PROGRAMS, ... as ONE stream of K steps: the TMA ring runs STAGES - 1 steps ahead across
    tile boundaries, so the next tile's first loads are in flight while this tile's epilogue runs."""
    pid = gl.program_id(0)
    n_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    K_TILES: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    NBYTES: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K
    steps = ((n_tiles - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS) * K_TILES  # this program's (tile, k) steps
    a_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        if i < steps:
            off_m, off_n = _tile_mn(pid + (i // K_TILES) * NUM_PROGRAMS, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            mbarrier.expect(ready.index(i), NBYTES)
            tma.async_copy_global_to_shared(a_desc, [off_m, (i % K_TILES) * BLOCK_K], ready.index(i), a_smem.index(i))
            tma.async_copy_global_to_shared(b_desc, [off_n, (i % K_TILES) * BLOCK_K], ready.index(i), b_smem.index(i))
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, INSTR_N, 32])
    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.int32, layout=mma_layout)
    for step in range(steps):
        k = step % K_TILES
        s = step % STAGES
        mbarrier.wait(ready.index(s), (step // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, use_acc=k != 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=IN_FLIGHT, deps=(acc, ))
        nxt = step + STAGES - 1  # its stage held step - 1's operands, whose wgmma is done now
        if nxt < steps:
            ns = nxt % STAGES
            off_m, off_n = _tile_mn(pid + (nxt // K_TILES) * NUM_PROGRAMS, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            mbarrier.expect(ready.index(ns), NBYTES)
            tma.async_copy_global_to_shared(a_desc, [off_m, (nxt % K_TILES) * BLOCK_K], ready.index(ns),
                                            a_smem.index(ns))
            tma.async_copy_global_to_shared(b_desc, [off_n, (nxt % K_TILES) * BLOCK_K], ready.index(ns),
                                            b_smem.index(ns))
        if k == K_TILES - 1:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            off_m, off_n = _tile_mn(pid + (step // K_TILES) * NUM_PROGRAMS, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _epilogue(acc, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_ptr, c_ptr, stride_rm,
                      stride_cm, HAS_BIAS, HAS_RES, BLOCK_M, BLOCK_N, mma_layout)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


def instr_n(block_n: int, num_warps: int, block_m: int) -> int:
    """The wgmma instruction's N for an int8 (BLOCK_M, BLOCK_N) tile on num_warps warps along M: the largest
    of int8's allowed N (multiples of 16 up to 224, and 8) that divides BLOCK_N."""
    assert block_m >= 16 * num_warps, "one 16-row wgmma slice per warp at least"
    return next(n for n in [*range(224, 15, -16), 8] if block_n % n == 0)


def ok(a: torch.Tensor, b: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether this kernel can run the call: sm_90 (not later: wgmma is Hopper's), TMA-aligned a and b."""
    if not a.is_cuda or torch.cuda.get_device_capability(a.device) != (9, 0):
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (a, b))


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES): what w8a8_gemm_wgmma runs unless told otherwise.
DEFAULT_TILE = (128, 256, 128, 8, 3)


def w8a8_gemm_wgmma(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
                    residual: torch.Tensor | None = None, tile: tuple | None = None, in_flight: int = 1,
                    group_m: int = 8, programs_per_sm: int = 0) -> torch.Tensor:
    """w8a8_gemm's operation on sm_90 (the caller checks shapes and dtypes: csrc_triton.w8a8_gemm.w8a8_gemm
    does, then dispatches here). tile: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES), default DEFAULT_TILE;
    in_flight: 1 (wgmma overlapped with the next K step) or 0 (the A/B form)."""
    M, K = a.shape
    N = b.shape[0]
    bm, bn, bk, warps, stages = tile or DEFAULT_TILE
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.int8))
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gl.int8))
    res = residual if residual is not None else c
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if programs_per_sm:
        n_prog = min(tiles, programs_per_sm * torch.cuda.get_device_properties(a.device).multi_processor_count)
        _w8a8_wgmma_persistent_kernel[(n_prog,)](
            a_desc, b_desc, a_scale.contiguous(), b_scale.contiguous(), bias if bias is not None else b_scale, res, c,
            M, N, res.stride(0), c.stride(0), K=K, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, STAGES=stages, INSTR_N=instr_n(bn, warps, bm),
            IN_FLIGHT=in_flight, NUM_PROGRAMS=n_prog, num_warps=warps)
        return c
    grid = (tiles,)
    _w8a8_wgmma_kernel[grid](
        a_desc, b_desc, a_scale.contiguous(), b_scale.contiguous(), bias if bias is not None else b_scale, res, c,
        M, N, res.stride(0), c.stride(0), K=K, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, STAGES=stages, INSTR_N=instr_n(bn, warps, bm),
        IN_FLIGHT=in_flight, num_warps=warps)
    return c


def w8a8_gemm_wgmma_ref(a, b, a_scale, b_scale, bias=None, out_dtype=torch.float16, residual=None):
    """Plain PyTorch: csrc_triton.w8a8_gemm.w8a8_gemm_ref (exact int32 product, then the fp32 epilogue)."""
    return w8a8_gemm_ref(a, b, a_scale, b_scale, bias, out_dtype, residual)
