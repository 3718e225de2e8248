"""Retrieval salience: how much attention each retrievable cached token receives from a question.

    s[b, g, j] += sum_{h in group g} sum_t exp(scale * q[b, h, t] . k[b, g, idx[j]] - lse[b, h, t])

q (B, H, T, D) the question's post-RoPE queries (fp16/bf16/fp32, any strides, unit stride along D);
k (B, Hkv, S, D) the cache; idx (N,) int32 cache slots of the retrievable tokens; lse (B, H, T) fp32
natural-log log-sum-exp of each query row's (scaled) attention logits, from the prefill attention.
The result (B, Hkv, N) fp32 is each token's normalised attention summed over the rows and the n_rep
query heads of its KV group; passing `out` accumulates into it (a question prefilled in chunks).
Every retrievable token precedes every question row, so no causal mask applies.

Program (b, g, chunk) streams TILES tiles of BLOCK_N gathered keys; the group's n_rep*T query rows
(flattened as (head, t)) meet each key tile in one (BLOCK_M, D) x (D, BLOCK_N) tl.dot when they fit
in BLOCK_M (the query tile and its lse are then loaded once per program), else in a loop of row
blocks. Per logit the work is one FMA (scale, minus the pre-scaled lse: log2 units), one exp2 and
one add, and the exp2 (MUFU) is the floor: no matrix is materialised and no atomics are needed.
Padded rows take lse = +inf, so they contribute exp2(-inf) = 0 without a mask. The kernel
pipelines its own loads (keys of tile j+1 and slots of tile j+2 in flight while tile j is
computed), so it runs with num_stages=1. D <= 256.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Programs per SM the key chunks aim for when `tiles` is not given (the default tile fits three
# per SM: 84 registers x 256 threads, 74 KB of shared memory, for sm_90), and the most tiles each.
PROGRAMS_PER_SM = 4
MAX_TILES = 64
# The dot's orientation (see _tile_mass) and its default tile. KEY_ROWS: keys are the rows of S^T = K Q^T,
# so summing over the question is in-thread (the layout that made the prefill salience's column pass
# 2-2.7x faster). H200 sweep (run S5-C, DECODE_SWEEP=retrieval of scripts/benches/decode_attention.py;
# 64-token question, 32K keys, graph-replayed): S = Q K^T with 32-key tiles and 8 warps 78.8 us, S^T with
# 64-key tiles and 4 warps 51.5 us (8 warps: 70.1; 128-key tiles: 64.6).
KEY_ROWS = True
KEY_BLOCK = 64
KEY_WARPS = 4


@triton.jit
def _row_block(q_ptr, lse_ptr, b, g, m0, T, sqb, sqh, sqt, slb, slh, slt, N_REP: tl.constexpr,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query rows m0..m0+BLOCK_M-1 of group g, (head, t) flattened -> q (BLOCK_M, BLOCK_D) and
    lse in log2 units (BLOCK_M,), +inf on padded rows."""
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
def _key_tile(k_base, slot, ok, offs_d, d_ok, skl, KEY_ROWS: tl.constexpr):
    """Keys at cache slots `slot` (BLOCK_N,), 0 where not `ok`: (BLOCK_N, BLOCK_D) when KEY_ROWS, else
    transposed (BLOCK_D, BLOCK_N)."""
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

    KEY_ROWS: kt is (BLOCK_N, D) and the dot is S^T = K Q^T (BLOCK_N, BLOCK_M), so the sum over query rows
    runs along each thread's own accumulator row (in-thread adds and a quad shuffle); otherwise kt is
    (D, BLOCK_N), S = Q K^T (BLOCK_M, BLOCK_N) and the sum runs down the rows, across warps (through shared
    memory, every tile)."""
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
def _retrieval_salience_kernel(
    q_ptr, k_ptr, idx_ptr, lse_ptr, out_ptr,
    sqb, sqh, sqt, skb, skh, skl, slb, slh, slt, sob, soh,
    T, N, HKV, scale_log2, TILES, N_REP: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ONE_BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    KEY_ROWS: tl.constexpr,
):
    bg = tl.program_id(0)
    chunk = tl.program_id(1)
    b = bg // HKV
    g = bg % HKV
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    k_base = k_ptr + b.to(tl.int64) * skb + g * skh
    if ONE_BLOCK:  # all n_rep*T rows in one tile: loaded once, reused by every key tile
        q, lse2 = _row_block(q_ptr, lse_ptr, b, g, 0, T, sqb, sqh, sqt, slb, slh, slt, N_REP, D, BLOCK_M, BLOCK_D)
    # A software pipeline of its own (launched with num_stages=1): the keys of tile j+1 and the
    # slots of tile j+2 are requested before tile j is computed. Triton's pipeliner cannot run the
    # slot -> key gather ahead like this (it waits for each tile's keys at the top of its iteration).
    n0 = chunk * TILES * BLOCK_N
    offs = tl.arange(0, BLOCK_N)
    slot = tl.load(idx_ptr + n0 + offs, mask=n0 + offs < N, other=0)
    kt_next = _key_tile(k_base, slot, n0 + offs < N, offs_d, d_ok, skl, KEY_ROWS)
    slot_next = tl.load(idx_ptr + n0 + BLOCK_N + offs, mask=(n0 + BLOCK_N + offs < N) & (TILES > 1), other=0)
    for j in range(TILES):
        offs_n = n0 + j * BLOCK_N + offs
        n_ok = offs_n < N
        kt = kt_next  # (BLOCK_N, BLOCK_D) with KEY_ROWS, else (BLOCK_D, BLOCK_N)
        kt_next = _key_tile(k_base, slot_next, (offs_n + BLOCK_N < N) & (j + 1 < TILES), offs_d, d_ok, skl,
                            KEY_ROWS)
        slot_next = tl.load(idx_ptr + offs_n + 2 * BLOCK_N, mask=(offs_n + 2 * BLOCK_N < N) & (j + 2 < TILES),
                            other=0)
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


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_tiles(n_tiles: int, n_groups: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Key tiles per program so that n_groups * chunks programs fill each SM about `per_sm` times
    (a runtime argument: a new N never recompiles)."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 8
    return max(1, min(MAX_TILES, n_tiles * n_groups // (per_sm * sms)))


def _check(q, k, idx, lse, out):
    B, H, T, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != D or H % k.shape[1]:
        raise ValueError(f"retrieval_salience: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
                         "(B, H, T, D) and (B, Hkv, S, D) with H a multiple of Hkv")
    if lse.shape != (B, H, T) or lse.dtype != torch.float32:
        raise ValueError(f"retrieval_salience: lse must be float32 {(B, H, T)}, got {lse.dtype} {tuple(lse.shape)}")
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError("retrieval_salience: idx must be a 1-D int32/int64 tensor of cache slots")
    want = (B, k.shape[1], idx.numel())
    if out is not None and (out.shape != want or out.dtype != torch.float32 or out.stride(-1) != 1):
        raise ValueError(f"retrieval_salience: out must be a float32 {want} tensor with a contiguous last dim")


def retrieval_salience(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor,
                       scale: float | None = None, out: torch.Tensor | None = None,
                       block_m: int | None = None, block_n: int | None = None, tiles: int | None = None,
                       num_warps: int | None = None, num_stages: int = 1, key_rows: bool | None = None
                       ) -> torch.Tensor:
    """q (B, H, T, D), k (B, Hkv, S, D), idx (N,), lse (B, H, T) fp32 -> (B, Hkv, N) fp32 (added to `out`).

    block_m (default: all of a group's n_rep*T rows, up to 256), block_n, tiles (key tiles per
    program; default from the SM count), num_warps and num_stages are tuning knobs swept by
    scripts/benches/decode_attention.py (DECODE_SWEEP=retrieval); key_rows picks the dot's orientation. The
    defaults (KEY_ROWS, KEY_BLOCK, KEY_WARPS) come from that sweep on the H200 (run S5-C): 51.5 us (graph)
    for a 64-token question over 32K keys (docs/benchmarks.md)."""
    _check(q, k, idx, lse, out)
    B, H, T, D = q.shape
    Hkv, N = k.shape[1], idx.numel()
    if q.stride(-1) != 1 or k.stride(-1) != 1 or D > 256:
        raise ValueError("retrieval_salience: the last dim must be contiguous and at most 256")
    if N == 0 or T == 0:
        return torch.zeros(B, Hkv, N, device=q.device, dtype=torch.float32) if out is None else out
    accumulate = out is not None
    out = torch.empty(B, Hkv, N, device=q.device, dtype=torch.float32) if out is None else out  # all written
    idx = idx.to(torch.int32)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    rows = (H // Hkv) * T
    key_rows = KEY_ROWS if key_rows is None else key_rows
    block_n = block_n or (KEY_BLOCK if key_rows else 32)
    num_warps = num_warps or (KEY_WARPS if key_rows else 8)
    block_m = block_m or min(256, max(16, triton.next_power_of_2(rows)))
    n_tiles = triton.cdiv(N, block_n)
    tiles = min(tiles or default_tiles(n_tiles, B * Hkv, q.device), n_tiles)
    _retrieval_salience_kernel[(B * Hkv, triton.cdiv(n_tiles, tiles))](
        q, k, idx, lse, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), out.stride(0), out.stride(1),
        T, N, Hkv, scale * LOG2E, tiles, N_REP=H // Hkv, D=D,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        ONE_BLOCK=rows <= block_m, ACCUMULATE=accumulate,
        # fp32 caches (tests) get exact products; tf32 would blur the ranking for no gain here.
        PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
        UPCAST=os.environ.get("TRITON_INTERPRET", "0") == "1" and torch.bfloat16 in (q.dtype, k.dtype),
        KEY_ROWS=key_rows, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def retrieval_salience_ref(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor,
                           scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch (materialises the (B, H, T, N) probabilities); computed in fp32 or wider."""
    _check(q, k, idx, lse, out)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    wide = torch.promote_types(q.dtype, torch.float32)
    kr = k[:, :, idx.long()].to(wide).repeat_interleave(H // Hkv, dim=1)  # (B, H, N, D)
    p = torch.exp(scale * (q.to(wide) @ kr.transpose(-1, -2)) - lse.to(wide)[..., None])  # (B, H, T, N)
    s = p.sum(2).view(B, Hkv, H // Hkv, -1).sum(2).float()  # (B, Hkv, N)
    return s if out is None else out.add_(s)
