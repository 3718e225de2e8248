"""Retrieval salience for Hopper in Gluon: the tensor cores' work on one half of the question overlapping the
exponentials of the other half.

    s[b, g, j] += sum_{h in group g} sum_t exp(scale * q[b, h, t] . k[b, g, start + j] - lse[b, h, t])

The operation of csrc_triton/retrieval_salience.py (its docstring has the arguments) for a span of consecutive
cache slots, sm_90 only. Why a second kernel: per 64-key tile at D = 128 and 256 question rows, the S^T = K Q^T
product is ~512 tensor-core cycles of an SM per 128 rows and its exponentials ~512 MUFU cycles, so the tile costs
~1K cycles if the two overlap and ~2K if they run one after the other. The Triton kernels cannot overlap them:
Triton 3.6 waits for each wgmma right after issuing it, and the two programs per SM of the one-block kernel
run in step (both multiply, then both exponentiate), so it ran at about the serial rate (S12-F: 40.9 us at 32K
keys, 0.336 of the question's prefill attention). Here the pipeline is written out (Gluon, Triton's
explicit-layout dialect): the question's rows are two resident halves a and b in shared memory; per key tile j

    issue wgmma b(j)          | wait a(j), exponentiate and sum a(j) while b(j) multiplies
    wait b(j), refill stage   | issue wgmma a(j+1), exponentiate and sum b(j) while a(j+1) multiplies

so the tensor cores always have a half in flight while the MUFU works on the other. Keys come by TMA through a
STAGES-deep ring (one descriptor over the whole cache viewed as rows (b * Hkv + g) * slots + slot: the keys of a
tile past the span's end are other slots, whose rows of S^T are computed and never stored; past the cache's end
TMA fills zeros). The question rows (head, t) of a KV group are loaded once per program into shared memory, with
their lse (padded rows take lse = +inf and add exp2(-inf) = 0). Per logit: one FMA (scale, minus the pre-scaled
lse: log2 units), one exp2, one add, as the Triton kernels; the sum over the question runs along each thread's
own accumulator rows. With `out` the masses are added to it (one program owns each element: load, add, store).

No interpreter form: Gluon kernels run on the GPU only. csrc_triton.retrieval_salience dispatches span calls
here on sm_90 under Triton 3.6 when `ok` (16-bit q and k, D of 64 or 128, TMA-aligned keys); everything else
runs the Triton kernels. The plain PyTorch form is `retrieval_salience_wgmma_ref` (= the Triton kernels').
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from csrc_triton.retrieval_salience import retrieval_salience_ref

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# Keys per tile; a launch's question rows per KV group (more run as further launches that add).
BLOCK_N = 64
MAX_ROWS = 256
# The forms: programs per SM the default tiling aims at and the key ring's depth. sm_90a at D = 128, 256 rows:
# "halves" (_retrieval_wgmma_kernel) 227 registers, 64 KB of question + 3 x 16 KB of keys, two programs an SM;
# "pingpong" (_retrieval_pingpong_kernel) 64 KB of question + 4 x 16 KB of keys, one program an SM.
FORMS = {"halves": (2, 3), "pingpong": (1, 4)}
FORM = "pingpong"
# The ping-pong form's consumer registers (the producer warp keeps 24) and the launch's maxnreg (168 a thread
# over 12 warps fills the register file; Triton gives the default partition what is left, 248).
PINGPONG_REGS = (232, 168)


@gluon.jit
def _load_keys(k_desc, k_smem, ready, t, row0, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Issue the TMA load of this program's key tile t (descriptor rows row0 + t * BLOCK_N ..., 16-bit keys) into
    its ring stage, signalling ready[stage] when it lands."""
    s = t % STAGES
    mbarrier.expect(ready.index(s), BLOCK_N * D * 2)
    tma.async_copy_global_to_shared(k_desc, [row0 + t * BLOCK_N, 0], ready.index(s), k_smem.index(s))


@gluon.jit
def _question_half(q_ptr, lse_ptr, q_smem, b, g, m0, T, sqb, sqh, sqt, slb, slh, slt, N_REP: gl.constexpr,
                   D: gl.constexpr, HALF: gl.constexpr, acc_layout: gl.constexpr, num_warps: gl.constexpr):
    """Question rows m0 .. m0 + HALF - 1 of group g ((head, t) flattened) into q_smem (zeros past the last row);
    returns their lse in log2 units in the accumulator's column layout (+inf past the last row)."""
    TPW_D: gl.constexpr = D // 8  # 8 elements (16 bytes) a thread along D
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [num_warps, 1], [1, 0])
    r = m0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, ld))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    h = g * N_REP + r // T
    ptrs = q_ptr + b * sqb + gl.expand_dims(h * sqh + (r % T) * sqt, 1) + gl.expand_dims(d, 0)
    q_smem.store(gl.load(ptrs, mask=gl.expand_dims(r < N_REP * T, 1), other=0.0).to(q_smem.dtype))
    c = m0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, acc_layout))
    lse = gl.load(lse_ptr + b * slb + (g * N_REP + c // T) * slh + (c % T) * slt, mask=c < N_REP * T,
                  other=float("inf"))
    return lse * 1.4426950408889634


@gluon.jit
def _mass(s, lse2, scale_log2):
    """sum over the half's question rows of exp2(scale_log2 * s - lse2) for each key row of s (BLOCK_N, HALF)."""
    return gl.sum(gl.exp2(s * scale_log2 - gl.expand_dims(lse2, 0)), axis=1)


@gluon.jit
def _emit(o_ptrs, mass, ok, ACCUMULATE: gl.constexpr):
    """Store a tile's masses, or add them to `out`: a relaxed atomic reduction at L2 (no load of the old values to
    wait for), the same fp32 round-to-nearest add as old + mass and deterministic, since one program owns each
    element within a launch."""
    if ACCUMULATE:
        gl.atomic_add(o_ptrs, mass, mask=ok, sem="relaxed")
    else:
        gl.store(o_ptrs, mass, mask=ok)


@gluon.jit
def _retrieval_wgmma_kernel(k_desc, q_ptr, lse_ptr, out_ptr, sqb, sqh, sqt, slb, slh, slt, sob, soh,
                            T, N, HKV, slots, start, scale_log2, TILES, N_REP: gl.constexpr, D: gl.constexpr,
                            HALF: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                            ACCUMULATE: gl.constexpr, num_warps: gl.constexpr):
    """Program (b * Hkv + g, chunk): key tiles chunk * TILES ... of the span for KV group g of batch b, against
    the group's question rows [0, 2 * HALF) as two resident halves (see the module docstring)."""
    bg = gl.program_id(0)
    chunk = gl.program_id(1)
    b = bg // HKV
    g = bg % HKV
    n0 = chunk * TILES * BLOCK_N
    tiles = gl.minimum(TILES, gl.cdiv(N - n0, BLOCK_N))
    row0 = bg * slots + start + n0  # descriptor row of the chunk's first key

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    # The question halves take the keys' shared layout (its swizzle depends only on a row's D * 2 bytes).
    qa_smem = gl.allocate_shared_memory(k_desc.dtype, [HALF, D], k_desc.layout)
    qb_smem = gl.allocate_shared_memory(k_desc.dtype, [HALF, D], k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):  # the first key tiles are in flight while the question loads
        if i < tiles:
            _load_keys(k_desc, k_smem, ready, i, row0, D, BLOCK_N, STAGES)

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HALF, 16])
    la = _question_half(q_ptr, lse_ptr, qa_smem, b, g, 0, T, sqb, sqh, sqt, slb, slh, slt, N_REP, D, HALF,
                        acc_layout, num_warps)
    lb = _question_half(q_ptr, lse_ptr, qb_smem, b, g, HALF, T, sqb, sqh, sqt, slb, slh, slt, N_REP, D, HALF,
                        acc_layout, num_warps)
    fence_async_shared()  # the question's stores are seen by the wgmmas (async proxy) ...
    gl.thread_barrier()  # ... of every warp
    qa_t = qa_smem.permute((1, 0))  # (D, HALF): the B operand of S^T = K Q^T
    qb_t = qb_smem.permute((1, 0))
    o_base = out_ptr + b * sob + g * soh + n0
    offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))

    # The results of the previous b and a halves are the (ignored: use_acc=False) accumulator operands of the
    # next ones, so no accumulator is zeroed a tile.
    zero = gl.zeros((BLOCK_N, HALF), gl.float32, layout=acc_layout)
    mbarrier.wait(ready.index(0), 0)
    acc_a = warpgroup_mma(k_smem.index(0), qa_t, zero, use_acc=False, is_async=True)
    for j in range(tiles - 1):
        s = j % STAGES
        acc_b = warpgroup_mma(k_smem.index(s), qb_t, zero, use_acc=False, is_async=True)
        sa = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))  # a(j) done, b(j) may run on
        mass = _mass(sa, la, scale_log2)  # while b(j) multiplies
        sb = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b,))
        gl.thread_barrier()  # every warp's wgmmas of tile j are done before its stage is refilled
        if j + STAGES < tiles:
            _load_keys(k_desc, k_smem, ready, j + STAGES, row0, D, BLOCK_N, STAGES)
        mbarrier.wait(ready.index((j + 1) % STAGES), ((j + 1) // STAGES) & 1)
        acc_a = warpgroup_mma(k_smem.index((j + 1) % STAGES), qa_t, zero, use_acc=False, is_async=True)
        mass = mass + _mass(sb, lb, scale_log2)  # while a(j + 1) multiplies
        _emit(o_base + j * BLOCK_N + offs, mass, n0 + j * BLOCK_N + offs < N, ACCUMULATE)
    # The last tile: no next half to issue.
    j = tiles - 1
    acc_b = warpgroup_mma(k_smem.index(j % STAGES), qb_t, zero, use_acc=False, is_async=True)
    sa = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))
    mass = _mass(sa, la, scale_log2)
    sb = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b,))
    _emit(o_base + j * BLOCK_N + offs, mass + _mass(sb, lb, scale_log2), n0 + j * BLOCK_N + offs < N, ACCUMULATE)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _pp_keys(k_desc, k_smem, ready, empty, row0, tiles, D: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr):
    """Ping-pong producer (one warp): the program's key tiles in order into the STAGES-deep ring; a stage is
    refilled once the consumer that read it has released it (empty)."""
    for t in range(tiles):
        mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        _load_keys(k_desc, k_smem, ready, t, row0, D, BLOCK_N, STAGES)


@gluon.jit
def _pp_tiles(k_smem, q_smem, ready, empty, turn, lse_ptr, out_ptr, b, g, T, N, n0, tiles, slb, slh, slt, sob, soh,
              scale_log2, WG: gl.constexpr, N_REP: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, ACCUMULATE: gl.constexpr):
    """Ping-pong consumer (one warpgroup): the program's key tiles WG, WG + 2, ... Each tile's wgmma (all ROWS
    question rows) is issued when the other warpgroup has issued its previous tile's (turn), so the two take the
    tensor cores in turn and each one's exponentials run under the other's wgmma."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, ROWS, 16])
    c = gl.arange(0, ROWS, layout=gl.SliceLayout(0, acc_layout))
    lse2 = gl.load(lse_ptr + b * slb + (g * N_REP + c // T) * slh + (c % T) * slt, mask=c < N_REP * T,
                   other=float("inf")) * 1.4426950408889634
    q_t = q_smem.permute((1, 0))
    zero = gl.zeros((BLOCK_N, ROWS), gl.float32, layout=acc_layout)
    offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    o_base = out_ptr + b * sob + g * soh + n0
    for t in range(WG, tiles, 2):
        s = t % STAGES
        if t > 0:
            mbarrier.wait(turn.index(WG), ((t - 1) // 2) & 1)  # the other warpgroup's tile t - 1 is issued
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        acc = warpgroup_mma(k_smem.index(s), q_t, zero, use_acc=False, is_async=True)
        mbarrier.arrive(turn.index(1 - WG), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
        _emit(o_base + t * BLOCK_N + offs, _mass(acc, lse2, scale_log2), n0 + t * BLOCK_N + offs < N, ACCUMULATE)


@gluon.jit
def _retrieval_pingpong_kernel(k_desc, q_ptr, lse_ptr, out_ptr, sqb, sqh, sqt, slb, slh, slt, sob, soh,
                               T, N, HKV, slots, start, scale_log2, TILES, N_REP: gl.constexpr, D: gl.constexpr,
                               ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                               ACCUMULATE: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Warp-specialised ping-pong form (num_warps 4): the question's ROWS rows resident in shared memory, two
    consumer warpgroups (the default partition and a worker) taking the program's key tiles alternately, one
    producer warp loading them."""
    bg = gl.program_id(0)
    chunk = gl.program_id(1)
    b = bg // HKV
    g = bg % HKV
    n0 = chunk * TILES * BLOCK_N
    tiles = gl.minimum(TILES, gl.cdiv(N - n0, BLOCK_N))
    row0 = bg * slots + start + n0
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    q_smem = gl.allocate_shared_memory(k_desc.dtype, [ROWS, D], k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, ROWS, 16])
    _question_half(q_ptr, lse_ptr, q_smem, b, g, 0, T, sqb, sqh, sqt, slb, slh, slt, N_REP, D, ROWS, acc_layout,
                   num_warps)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([
        (_pp_tiles, (k_smem, q_smem, ready, empty, turn, lse_ptr, out_ptr, b, g, T, N, n0, tiles, slb, slh, slt,
                     sob, soh, scale_log2, 0, N_REP, ROWS, BLOCK_N, STAGES, ACCUMULATE)),
        (_pp_tiles, (k_smem, q_smem, ready, empty, turn, lse_ptr, out_ptr, b, g, T, N, n0, tiles, slb, slh, slt,
                     sob, soh, scale_log2, 1, N_REP, ROWS, BLOCK_N, STAGES, ACCUMULATE)),
        (_pp_keys, (k_desc, k_smem, ready, empty, row0, tiles, D, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


def _flat_rows(k: torch.Tensor) -> int | None:
    """Slots per (batch, KV head) when k (B, Hkv, S, D)'s rows flatten to one strided row sequence,
    (b * Hkv + g) * slots + slot (a slice along S of a contiguous cache does), else None."""
    B, Hkv, S, _ = k.shape
    skb, skh, skl, _ = k.stride()
    group = skh if Hkv > 1 else skb if B > 1 else S * skl  # the stride from one (b, g) to the next
    if skl <= 0 or group % skl or group < S * skl or (B > 1 and Hkv > 1 and skb != Hkv * skh):
        return None
    return group // skl


def ok(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether this kernel can run a span call: sm_90, 16-bit q and k of one dtype, D of 64 or 128 (a power of
    two for Gluon's tensors, at most 128 so two programs' question halves and key rings share an SM), unit stride
    along D, keys TMA-aligned (16-byte base and row stride) in rows that flatten (`_flat_rows`)."""
    if not q.is_cuda or q.dtype != k.dtype or k.dtype not in _GL_DTYPES or k.shape[3] not in (64, 128):
        return False
    if torch.cuda.get_device_capability(k.device)[0] != 9 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    if k.data_ptr() % 16 or (k.stride(2) * k.element_size()) % 16:
        return False
    return _flat_rows(k) is not None and (out is None or out.stride(-1) == 1)


def retrieval_salience_wgmma(q: torch.Tensor, k: torch.Tensor, span: range, lse: torch.Tensor, scale: float,
                             out: torch.Tensor, accumulate: bool, form: str | None = None, tiles: int | None = None,
                             stages: int | None = None) -> torch.Tensor:
    """The masses of the keys at slots `span` of k (B, Hkv, S, D), written (or added, `accumulate`) into out
    (B, Hkv, len(span)) fp32, for q (B, H, T, D), lse (B, H, T) fp32. The caller (retrieval_salience) has
    checked the call and `ok`. form: "pingpong" or "halves" (default FORM); question rows beyond MAX_ROWS a group
    run as further launches that add. tiles: key tiles per program (default: one whole wave of the programs that
    fit, FORMS[form]'s per SM); stages: the key ring's depth."""
    from csrc_triton.retrieval_salience import wave_tiles

    B, H, T, D = q.shape
    Hkv = k.shape[1]
    n_rep = H // Hkv
    N = len(span)
    if N == 0 or T == 0:
        return out
    form = form or FORM
    per_sm, default_stages = FORMS[form]
    slots = _flat_rows(k)
    rows = (B * Hkv - 1) * slots + k.shape[2]  # the last group's last slot ends the descriptor
    flat = torch.as_strided(k, (rows, D), (k.stride(2), 1))
    k_desc = TensorDescriptor.from_tensor(flat, [BLOCK_N, D], gl.NVMMASharedLayout.get_default_for(
        [BLOCK_N, D], _GL_DTYPES[k.dtype]))
    n_tiles = triton.cdiv(N, BLOCK_N)
    tiles = min(tiles or wave_tiles(n_tiles, B * Hkv, q.device, per_sm), n_tiles)
    grid = (B * Hkv, triton.cdiv(n_tiles, tiles))
    t_chunk = max(1, MAX_ROWS // n_rep)  # whole question tokens a launch
    for t0 in range(0, T, t_chunk):
        tc = min(T, t0 + t_chunk) - t0
        rows_p2 = max(32, triton.next_power_of_2(n_rep * tc))
        args = (k_desc, q[:, :, t0:], lse[:, :, t0:], out, *q.stride()[:3], *lse.stride(), *out.stride()[:2], tc, N,
                Hkv, slots, span.start, scale * 1.4426950408889634, tiles)
        meta = dict(N_REP=n_rep, D=D, BLOCK_N=BLOCK_N, STAGES=stages or default_stages,
                    ACCUMULATE=accumulate or t0 > 0, num_warps=4)
        if form == "pingpong":
            _retrieval_pingpong_kernel[grid](*args, ROWS=rows_p2, CONSUMER_REGS=PINGPONG_REGS[0],
                                             maxnreg=PINGPONG_REGS[1], **meta)
        else:
            _retrieval_wgmma_kernel[grid](*args, HALF=rows_p2 // 2, **meta)
    return out


def retrieval_salience_wgmma_ref(q, k, idx, lse, scale=None, out=None):
    """Plain PyTorch: csrc_triton.retrieval_salience.retrieval_salience_ref."""
    return retrieval_salience_ref(q, k, idx, lse, scale, out)
