"""Retrieval salience: how much attention each retrievable cached token receives from a question.

    s[b, g, j] += sum_{h in group g} sum_t exp(scale * q[b, h, t] . k[b, g, idx[j]] - lse[b, h, t])

q (B, H, T, D) the question's post-RoPE queries (fp16/bf16/fp32, any strides, unit stride along D); k (B, Hkv, S, D)
the cache; idx (N,) int32 cache slots of the retrievable tokens, or a range of consecutive slots (the keys are then
read as one contiguous block, no slot loaded); lse (B, H, T) fp32 natural-log log-sum-exp of each query row's
(scaled) attention logits, from the prefill attention. The result (B, Hkv, N) fp32 is each token's normalised
attention summed over the rows and the n_rep query heads of its KV group; passing `out` accumulates into it (a
question prefilled in chunks). Every retrievable token precedes every question row, so no causal mask applies.

impl "gather" (_retrieval_salience_kernel): program (b, g, chunk) streams TILES tiles of BLOCK_N keys; the group's
n_rep*T query rows (flattened as (head, t)) meet each key tile in one (BLOCK_M, D) x (D, BLOCK_N) tl.dot when they
fit in BLOCK_M (the query tile and its lse are then loaded once per program), else in a loop of row blocks. Per
logit: one FMA (scale, minus the pre-scaled lse: log2 units), one exp2 (MUFU, the floor) and one add; no matrix is
materialised and no atomics are needed. Padded rows take lse = +inf, so they contribute exp2(-inf) = 0 without a
mask. The kernel pipelines its own loads, so it runs with num_stages=1. D <= 256.

impl "pipe" (_retrieval_salience_pipe_kernel): the rows as two resident halves, so that the tensor cores multiply
one half while the MUFU exponentiates the other (FlashAttention-3's intra-warpgroup overlap), key loads left to
Triton's cp.async pipeline, adds to `out` as atomic reductions. At most 2 * PIPE_HALF = 256 rows per launch:
longer questions run as several launches.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ._common import INTERPRET
from ._triton import tl, triton
from .launch import Launch, Plans, tensor_key

LOG2E = 1.4426950408889634
# The most programs per SM the gather kernel's default tiles plan for (its whole waves use what fits, at most this),
# and the most key tiles per program.
PROGRAMS_PER_SM = 4
MAX_TILES = 64
# The dot's orientation (see _tile_mass) and its default tile. KEY_ROWS: keys are the rows of S^T = K Q^T, so
# summing over the question is in-thread; the fastest in the H200 sweep (DECODE_SWEEP=retrieval of
# scripts/benches/decode_attention.py; docs/perf_notes.md).
KEY_ROWS = True
KEY_BLOCK = 64
KEY_WARPS = 4
# The kernels (IMPLS) and the "pipe" kernel's defaults: rows per half, keys per tile, warps, Triton pipeline stages,
# programs per SM its default tiles aim at (2 fit at D=128). A call that names no impl runs "gather" when a KV
# group's question rows (n_rep * T) fit one 256-row block, else "pipe", each in whole waves of the programs that
# fit per SM (the faster of the two on each side; docs/perf_notes.md).
IMPLS = ("gather", "pipe")
DEFAULT_IMPL = None  # None: the rule above; "gather" / "pipe": always that kernel
PIPE_HALF = 128
PIPE_BLOCK = 64
PIPE_WARPS = 4
PIPE_STAGES = 3
PIPE_PER_SM = 2


@triton.jit
def _row_block(q_ptr, lse_ptr, b, g, m0, T, sqb, sqh, sqt, slb, slh, slt, N_REP: tl.constexpr,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query rows m0..m0+BLOCK_M-1 of group g, (head, t) flattened -> q (BLOCK_M, BLOCK_D), lse in log2 units
    (BLOCK_M,), +inf on padded rows."""
    r = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = r < N_REP * T
    h = g * N_REP + r // T
    t = r % T
    q = tl.load(q_ptr + b * sqb + h[:, None] * sqh + t[:, None] * sqt + offs_d[None, :],
                mask=r_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    lse2 = tl.load(lse_ptr + b * slb + h * slh + t * slt, mask=r_ok, other=float("inf")) * 1.4426950408889634
    return q, lse2


@triton.jit
def _slots(offs_n, ok, ptrs, SPAN: tl.constexpr):
    """Cache slots of the retrievable tokens offs_n (ok: < N): idx[offs_n] (ptrs: their addresses in idx), or
    offs_n itself when SPAN (the launcher then passes the cache from the span's first slot on)."""
    if SPAN:
        return offs_n
    return tl.load(ptrs, mask=ok, other=0)


@triton.jit
def _key_tile(k_base, slot, ok, offs_d, d_ok, skl, KEY_ROWS: tl.constexpr):
    """Keys at cache slots `slot` (BLOCK_N,), 0 where not `ok`: (BLOCK_N, BLOCK_D) if KEY_ROWS, else transposed."""
    if KEY_ROWS:
        kt = tl.load(k_base + slot[:, None].to(tl.int64) * skl + offs_d[None, :],
                     mask=ok[:, None] & d_ok[None, :], other=0.0)
    else:
        kt = tl.load(k_base + slot[None, :].to(tl.int64) * skl + offs_d[:, None],
                     mask=ok[None, :] & d_ok[:, None], other=0.0)
    return kt


@triton.jit
def _tile_mass(q, lse2, kt, scale_log2, PRECISION: tl.constexpr, UPCAST: tl.constexpr, KEY_ROWS: tl.constexpr):
    """sum over the query rows of exp2(scale_log2 * q k - lse2) for each key of the tile -> (BLOCK_N,).

    KEY_ROWS: kt is (BLOCK_N, D) and the dot is S^T = K Q^T (BLOCK_N, BLOCK_M), so the sum over query rows runs
    along each thread's own accumulator row (in-thread adds and a quad shuffle); otherwise kt is (D, BLOCK_N),
    S = Q K^T (BLOCK_M, BLOCK_N) and the sum runs down the rows, across warps (through shared memory, every tile)."""
    if UPCAST:  # the CPU interpreter multiplies bf16 wrongly; it runs the dot in fp32 instead
        q, kt = q.to(tl.float32), kt.to(tl.float32)
    else:
        q = q.to(kt.dtype)
    if KEY_ROWS:
        s = tl.dot(kt, tl.trans(q), input_precision=PRECISION, out_dtype=tl.float32)  # (BLOCK_N, BLOCK_M)
        mass = tl.sum(tl.exp2(s * scale_log2 - lse2[None, :]), axis=1)
    else:
        s = tl.dot(q, kt, input_precision=PRECISION, out_dtype=tl.float32)  # (BLOCK_M, BLOCK_N)
        mass = tl.sum(tl.exp2(s * scale_log2 - lse2[:, None]), axis=0)
    return mass


@triton.jit
def _program(k_ptr, skb, skh, HKV, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Where program (b * Hkv + g, chunk) works: batch b, KV group g, its key chunk, the head-dim offsets (BLOCK_D,)
    and their mask (< D), and k_base, the address of k[b, g] (the batch offset in 64 bits: B * Hkv * S * D can pass
    2^31)."""
    bg = tl.program_id(0)
    chunk = tl.program_id(1)
    b = bg // HKV
    g = bg % HKV
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    k_base = k_ptr + b.to(tl.int64) * skb + g * skh
    return b, g, chunk, offs_d, d_ok, k_base


@triton.jit
def _retrieval_salience_kernel(
    q_ptr, k_ptr, idx_ptr, lse_ptr, out_ptr,
    sqb, sqh, sqt, skb, skh, skl, slb, slh, slt, sob, soh,
    T, N, HKV, scale_log2, TILES, N_REP: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ONE_BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    KEY_ROWS: tl.constexpr, SPAN: tl.constexpr,
):
    b, g, chunk, offs_d, d_ok, k_base = _program(k_ptr, skb, skh, HKV, D, BLOCK_D)
    if ONE_BLOCK:  # all n_rep*T rows in one tile: loaded once, reused by every key tile
        q, lse2 = _row_block(q_ptr, lse_ptr, b, g, 0, T, sqb, sqh, sqt, slb, slh, slt, N_REP, D, BLOCK_M, BLOCK_D)
    # A software pipeline of its own (num_stages=1): the keys of tile j+1 and the slots of tile j+2 are requested
    # before tile j is computed. Triton's pipeliner cannot run the slot -> key gather ahead like this.
    n0 = chunk * TILES * BLOCK_N
    offs = tl.arange(0, BLOCK_N)
    slot = _slots(n0 + offs, n0 + offs < N, idx_ptr + n0 + offs, SPAN)
    kt_next = _key_tile(k_base, slot, n0 + offs < N, offs_d, d_ok, skl, KEY_ROWS)
    slot_next = _slots(n0 + BLOCK_N + offs, (n0 + BLOCK_N + offs < N) & (TILES > 1), idx_ptr + n0 + BLOCK_N + offs,
                       SPAN)
    for j in range(TILES):
        offs_n = n0 + j * BLOCK_N + offs
        n_ok = offs_n < N
        kt = kt_next  # (BLOCK_N, BLOCK_D) with KEY_ROWS, else (BLOCK_D, BLOCK_N)
        kt_next = _key_tile(k_base, slot_next, (offs_n + BLOCK_N < N) & (j + 1 < TILES), offs_d, d_ok, skl,
                            KEY_ROWS)
        slot_next = _slots(offs_n + 2 * BLOCK_N, (offs_n + 2 * BLOCK_N < N) & (j + 2 < TILES), idx_ptr + offs_n + 2 * BLOCK_N,
                           SPAN)
        ptrs = out_ptr + b * sob + g * soh + offs_n
        if ACCUMULATE:  # issued before the math too: its latency hides behind the dot and exp2
            acc = tl.load(ptrs, mask=n_ok, other=0.0)
        else:
            acc = tl.zeros([BLOCK_N], tl.float32)
        if ONE_BLOCK:
            acc += _tile_mass(q, lse2, kt, scale_log2, PRECISION, UPCAST, KEY_ROWS)
        else:
            for m0 in range(0, N_REP * T, BLOCK_M):
                qm, lm = _row_block(q_ptr, lse_ptr, b, g, m0, T, sqb, sqh, sqt, slb, slh, slt, N_REP, D,
                                    BLOCK_M, BLOCK_D)
                acc += _tile_mass(qm, lm, kt, scale_log2, PRECISION, UPCAST, KEY_ROWS)
        tl.store(ptrs, acc, mask=n_ok)


@triton.jit
def _keys(k_base, idx_ptr, offs_n, n_ok, offs_d, d_ok, skl, SPAN: tl.constexpr):
    """Key tile (BLOCK_N, BLOCK_D) at cache slots idx[offs_n], or offs_n itself when SPAN; 0 where not n_ok."""
    return _key_tile(k_base, _slots(offs_n, n_ok, idx_ptr + offs_n, SPAN), n_ok, offs_d, d_ok, skl, True)


@triton.jit
def _scores_t(kt, q, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """S^T = K q^T (BLOCK_N, HALF) fp32. A separate step from the exponents so that the wgmma is issued here and
    Triton's wait lands at the first read of the result (after the other half's exp2 block)."""
    if UPCAST:  # the CPU interpreter multiplies bf16 wrongly; it runs the dot in fp32 instead
        kt = kt.to(tl.float32)
    return tl.dot(kt, tl.trans(q), input_precision=PRECISION, out_dtype=tl.float32)


@triton.jit
def _put(ptrs, mass, ok, ACCUMULATE: tl.constexpr):
    """Store a tile's masses, or add them to `out`: a relaxed atomic reduction at L2 (no load of the old values to
    wait for), the same fp32 round-to-nearest add as old + mass (denormals flushed) and deterministic, since one
    program owns each element within a launch."""
    if ACCUMULATE:
        tl.atomic_add(ptrs, mass, mask=ok, sem="relaxed")
    else:
        tl.store(ptrs, mass, mask=ok)


@triton.jit
def _retrieval_salience_pipe_kernel(
    q_ptr, k_ptr, idx_ptr, lse_ptr, out_ptr,
    sqb, sqh, sqt, skb, skh, skl, slb, slh, slt, sob, soh,
    T, N, HKV, scale_log2, TILES, N_REP: tl.constexpr, D: tl.constexpr,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPAN: tl.constexpr,
):
    """impl "pipe": the group's rows (at most 2 * HALF) as two resident halves a and b. Iteration j issues the wgmma
    of tile j's half a, then sums the exponentials of tile j-1's half b and stores tile j-1, then issues half b's
    wgmma and sums half a's exponentials: each (BLOCK_N, HALF) accumulator is half of the one-block kernel's, so two
    fit in the same registers. The key loads are left to Triton's pipeliner (cp.async, num_stages deep; the slots a
    stage ahead). Whether the exponentials really issue under the wgmma is ptxas's choice (most do at 3 stages)."""
    b, g, chunk, offs_d, d_ok, k_base = _program(k_ptr, skb, skh, HKV, D, BLOCK_D)
    o_base = out_ptr + b * sob + g * soh
    qa, la = _row_block(q_ptr, lse_ptr, b, g, 0, T, sqb, sqh, sqt, slb, slh, slt, N_REP, D, HALF, BLOCK_D)
    qb, lb = _row_block(q_ptr, lse_ptr, b, g, HALF, T, sqb, sqh, sqt, slb, slh, slt, N_REP, D, HALF, BLOCK_D)
    if UPCAST:
        qa, qb = qa.to(tl.float32), qb.to(tl.float32)
    else:
        qa, qb = qa.to(k_ptr.dtype.element_ty), qb.to(k_ptr.dtype.element_ty)
    n0 = chunk * TILES * BLOCK_N
    offs = tl.arange(0, BLOCK_N)
    # "Tile -1": its half b adds exp2(-inf) = 0 and its store is masked off.
    ma = tl.zeros([BLOCK_N], tl.float32)
    tb = tl.full([BLOCK_N, HALF], float("-inf"), tl.float32)
    for j in range(TILES):
        offs_n = n0 + j * BLOCK_N + offs
        prev_ok = (offs_n - BLOCK_N < N) & (j > 0)
        kt = _keys(k_base, idx_ptr, offs_n, offs_n < N, offs_d, d_ok, skl, SPAN)  # Triton pipelines this load
        sa = _scores_t(kt, qa, PRECISION, UPCAST)  # wgmma issued, not awaited
        mass = ma + tl.sum(tl.exp2(tb), axis=1)  # tile j-1, half b, while half a of tile j multiplies
        _put(o_base + offs_n - BLOCK_N, mass, prev_ok, ACCUMULATE)
        ta = sa * scale_log2 - la[None, :]  # the first read of sa: the wgmma wait lands here
        sb = _scores_t(kt, qb, PRECISION, UPCAST)
        ma = tl.sum(tl.exp2(ta), axis=1)  # tile j, half a, while half b multiplies
        tb = sb * scale_log2 - lb[None, :]
    offs_n = n0 + TILES * BLOCK_N + offs
    prev_ok = offs_n - BLOCK_N < N
    _put(o_base + offs_n - BLOCK_N, ma + tl.sum(tl.exp2(tb), axis=1), prev_ok, ACCUMULATE)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def wave_tiles(n_tiles: int, n_groups: int, device: torch.device, per_sm: int) -> int:
    """Key tiles per program so that the n_groups * chunks programs make one whole wave of at most `per_sm`
    programs on every SM (rounded up: no partial second wave). A runtime argument: a new N never recompiles."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 8
    return max(1, min(MAX_TILES, triton.cdiv(n_tiles * n_groups, per_sm * sms)))


def _check(q, k, idx, lse, out):
    B, H, T, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != D or H % k.shape[1]:
        raise ValueError(f"retrieval_salience: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
                         "(B, H, T, D) and (B, Hkv, S, D) with H a multiple of Hkv")
    if lse.shape != (B, H, T) or lse.dtype != torch.float32:
        raise ValueError(f"retrieval_salience: lse must be float32 {(B, H, T)}, got {lse.dtype} {tuple(lse.shape)}")
    if isinstance(idx, range):
        if idx.step != 1 or idx.start < 0 or (len(idx) and idx.stop > k.shape[2]):
            raise ValueError(f"retrieval_salience: a range idx must be a step-1 span of cache slots, got {idx}")
    elif idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError("retrieval_salience: idx must be a 1-D int32/int64 tensor of cache slots (or a range)")
    want = (B, k.shape[1], len(idx) if isinstance(idx, range) else idx.numel())
    if out is not None and (out.shape != want or out.dtype != torch.float32 or out.stride(-1) != 1):
        raise ValueError(f"retrieval_salience: out must be a float32 {want} tensor with a contiguous last dim")


@functools.lru_cache(maxsize=None)
def _no_slots(device: torch.device) -> torch.Tensor:
    """The idx argument of a span launch (never read)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


class _Plan(NamedTuple):
    """What one distinct call launches (built by _plan)."""
    shape: tuple[int, int, int]  # (B, Hkv, N) of the result
    span: bool  # idx is a range: the kernels read a view of k's span and no slots
    launches: tuple[tuple[int, int, Launch, tuple], ...]  # (t0, t1, launch, _RESIDENT key): question rows [t0, t1)
    provisional: bool  # its tiles assumed programs per SM that _RESIDENT learns at the first launch: not kept


# Plans per distinct call (every tensor's shape, strides, dtype and device, the span, the options and the module
# switches read): a prefill makes the same call every layer, so it pays dispatch, checks and tiles once (launch.py).
_PLANS = Plans()


def retrieval_salience(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor | range, lse: torch.Tensor,
                       scale: float | None = None, out: torch.Tensor | None = None,
                       block_m: int | None = None, block_n: int | None = None, tiles: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None, key_rows: bool | None = None,
                       impl: str | None = None, per_sm: int | None = None, *, direct: bool = True) -> torch.Tensor:
    """q (B, H, T, D), k (B, Hkv, S, D), idx (N,), lse (B, H, T) fp32 -> (B, Hkv, N) fp32 (added to `out`).

    idx may be a range (start, stop) of consecutive cache slots (an image's span). impl (default DEFAULT_IMPL, else
    the rule in IMPLS' comment): "gather" or "pipe" (module docstring; a question of more than 256 rows per group
    runs as several launches, each reading every key). Tuning knobs, swept by scripts/benches/retrieval_variants.py
    and scripts/benches/decode_attention.py (DECODE_SWEEP=retrieval): block_m (gather: rows per row block, default
    all of a group's n_rep*T rows up to 256; pipe: rows per half, default 128), block_n, tiles (key tiles per
    program; default: whole waves of `per_sm` programs per SM, by default the programs of the compiled kernel that
    fit, at most PROGRAMS_PER_SM for gather), num_warps, num_stages (gather: 1, it pipelines its own loads; pipe:
    Triton's pipeline depth), key_rows (gather: the dot's orientation). direct: after a plan's first launch, skip
    Triton's dispatch (launch.py)."""
    key = (tensor_key(q), tensor_key(k), (idx.start, idx.stop, idx.step) if isinstance(idx, range) else tensor_key(idx),
           tensor_key(lse), scale, tensor_key(out), block_m, block_n, tiles, num_warps, num_stages, key_rows, impl,
           per_sm, DEFAULT_IMPL, KEY_ROWS, KEY_BLOCK, KEY_WARPS, PIPE_HALF, PIPE_BLOCK, PIPE_WARPS, PIPE_STAGES,
           PIPE_PER_SM, PROGRAMS_PER_SM, MAX_TILES)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, idx, lse, scale, out, block_m, block_n, tiles, num_warps, num_stages, key_rows, impl,
                     per_sm)
        if not plan.provisional:
            _PLANS.put(key, plan)
    if not plan.launches:  # no keys or no question rows
        return torch.zeros(plan.shape, device=q.device, dtype=torch.float32) if out is None else out
    out = torch.empty(plan.shape, device=q.device, dtype=torch.float32) if out is None else out  # all written
    if plan.span:  # the span's first slot becomes slot 0 of the view; the kernels read no idx
        k, idx = k[:, :, idx.start:idx.stop], _no_slots(q.device)
    else:
        idx = idx.to(torch.int32)
    whole = len(plan.launches) == 1
    for t0, t1, launch, rkey in plan.launches:
        qc, lc = (q, lse) if whole else (q[:, :, t0:t1], lse[:, :, t0:t1])
        compiled = launch(qc, k, idx, lc, out, direct=direct)  # None once launches go direct: nothing left to learn
        if compiled is not None and rkey not in _RESIDENT and q.is_cuda and hasattr(compiled, "n_regs"):
            _RESIDENT[rkey] = _resident(compiled, launch.meta["num_warps"], q.device)
    return out


def _plan(q, k, idx, lse, scale, out, block_m, block_n, tiles, num_warps, num_stages, key_rows, impl, per_sm) -> _Plan:
    """Checks, impl, tiles, grids, constexprs and scalar arguments of a call: see retrieval_salience."""
    _check(q, k, idx, lse, out)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    N = len(idx) if isinstance(idx, range) else idx.numel()
    if q.stride(-1) != 1 or k.stride(-1) != 1 or D > 256:
        raise ValueError("retrieval_salience: the last dim must be contiguous and at most 256")
    impl = impl or DEFAULT_IMPL or ("gather" if (H // Hkv) * T <= 256 else "pipe")
    if impl not in IMPLS:
        raise ValueError(f"retrieval_salience: impl must be one of {IMPLS}, got {impl!r}")
    span = isinstance(idx, range)
    if N == 0 or T == 0:
        return _Plan((B, Hkv, N), span, (), False)
    accumulate = out is not None
    out_strides = (Hkv * N, N) if out is None else out.stride()[:2]  # torch.empty(B, Hkv, N)'s, or the caller's
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    common = dict(D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), SPAN=span,
                  # fp32 caches (tests) get exact products; tf32 would blur the ranking for no gain here.
                  PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
                  UPCAST=INTERPRET and torch.bfloat16 in (q.dtype, k.dtype))
    # Every launch's scalars: strides of q (a chunk of q has q's), k (the span view has k's), lse, out.
    strides = (*q.stride()[:3], *k.stride()[:3], *lse.stride()[:3], *out_strides)
    if impl == "pipe":
        return _pipe(q, k, N, scale, accumulate, common, strides, block_m or PIPE_HALF, block_n or PIPE_BLOCK,
                     tiles, num_warps or PIPE_WARPS, num_stages or PIPE_STAGES, per_sm, span)
    rows = (H // Hkv) * T
    key_rows = KEY_ROWS if key_rows is None else key_rows
    block_n = block_n or (KEY_BLOCK if key_rows else 32)
    num_warps = num_warps or (KEY_WARPS if key_rows else 8)
    block_m = block_m or min(256, max(16, triton.next_power_of_2(rows)))
    n_tiles = triton.cdiv(N, block_n)
    meta = dict(N_REP=H // Hkv, BLOCK_M=block_m, BLOCK_N=block_n, ONE_BLOCK=rows <= block_m, ACCUMULATE=accumulate,
                KEY_ROWS=key_rows, num_warps=num_warps, num_stages=num_stages or 1, **common)
    key = ("gather", q.device, q.dtype, k.dtype, *meta.values())  # meta is built in one fixed order
    # Default: whole waves of the programs that fit per SM (at most PROGRAMS_PER_SM; 2 until compiled).
    provisional = q.is_cuda and not tiles and not per_sm and key not in _RESIDENT
    per_sm = per_sm or min(PROGRAMS_PER_SM, _RESIDENT.get(key, 2))
    tiles = min(tiles or wave_tiles(n_tiles, B * Hkv, q.device, per_sm), n_tiles)
    launch = Launch(_retrieval_salience_kernel, (B * Hkv, triton.cdiv(n_tiles, tiles)),
                    (*strides, T, N, Hkv, scale * LOG2E, tiles), meta)
    return _Plan((B, Hkv, N), span, ((0, T, launch, key),), provisional)


# Programs per SM each compiled configuration fits, filled after its first launch; plans built before: provisional.
_RESIDENT: dict[tuple, int] = {}


def _resident(compiled, num_warps: int, device: torch.device) -> int:
    """Programs of a compiled kernel that fit on one SM at once: registers (64K per SM, allocated per warp in units
    of 256), shared memory (1 KB reserved per program) and threads."""
    props = torch.cuda.get_device_properties(device)
    by_regs = 65536 // (triton.cdiv(max(compiled.n_regs, 1) * 32, 256) * 256 * num_warps)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = smem // (compiled.metadata.shared + 1024)
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads))


def _pipe(q, k, N, scale, accumulate, common, strides, half_max, block_n, tiles, num_warps, num_stages, per_sm,
          span) -> _Plan:
    """impl "pipe": launches of at most 2 * half_max rows per group (question chunks of whole tokens); the first
    writes `out` (unless accumulating), the others add to it. Default tiles: one whole wave at the programs per SM
    that fit (known once a configuration has compiled; PIPE_PER_SM before)."""
    B, H, T, _ = q.shape
    Hkv = k.shape[1]
    n_rep = H // Hkv
    if n_rep > 2 * half_max:
        raise ValueError(f"retrieval_salience: impl 'pipe' takes at most {2 * half_max} query heads per KV head")
    n_tiles = triton.cdiv(N, block_n)
    t_chunk = 2 * half_max // n_rep
    launches, provisional = [], False
    for t0 in range(0, T, t_chunk):
        tc = min(T, t0 + t_chunk) - t0  # rows of this chunk
        meta = dict(N_REP=n_rep, HALF=max(16, triton.next_power_of_2(n_rep * tc) // 2), BLOCK_N=block_n,
                    ACCUMULATE=accumulate or t0 > 0, num_warps=num_warps, num_stages=num_stages, **common)
        key = (q.device, q.dtype, k.dtype, *meta.values())  # meta is built in one fixed order
        provisional |= q.is_cuda and not tiles and not per_sm and key not in _RESIDENT
        n = min(tiles or wave_tiles(n_tiles, B * Hkv, q.device, per_sm or _RESIDENT.get(key, PIPE_PER_SM)), n_tiles)
        launch = Launch(_retrieval_salience_pipe_kernel, (B * Hkv, triton.cdiv(n_tiles, n)),
                        (*strides, tc, N, Hkv, scale * LOG2E, n), meta)
        launches.append((t0, t0 + tc, launch, key))
    return _Plan((B, Hkv, N), span, tuple(launches), provisional)


def retrieval_salience_ref(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor | range, lse: torch.Tensor,
                           scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch (materialises the (B, H, T, N) probabilities); computed in fp32 or wider."""
    _check(q, k, idx, lse, out)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if isinstance(idx, range):
        idx = torch.arange(idx.start, idx.stop, device=k.device)
    wide = torch.promote_types(q.dtype, torch.float32)
    kr = k[:, :, idx.long()].to(wide).repeat_interleave(H // Hkv, dim=1)  # (B, H, N, D)
    p = torch.exp(scale * (q.to(wide) @ kr.transpose(-1, -2)) - lse.to(wide)[..., None])  # (B, H, T, N)
    s = p.sum(2).view(B, Hkv, H // Hkv, -1).sum(2).float()  # (B, Hkv, N)
    return s if out is None else out.add_(s)
