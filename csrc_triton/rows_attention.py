"""Attention of a later turn's rows over the cache, split over the keys (graph-replayed follow-up questions).

    o[t, h] = softmax(scale * q[t, h] . K[g]^T over slots 0..start + t) @ V[g],   g = h // n_rep,  start = keys - T

q (1, H, T, D) and k, v (1, Hkv, S, D) cache layers, fp16/bf16 with unit stride along D (D a power of two <= 256);
`keys` (1,) int32 on the device = start + T (kv_cache.RowsIndex.keys), so one captured graph serves every cache
length. Why not PyTorch's varlen flash call: FlashAttention-2 splits the keys over thread blocks in its varlen form
only for one-row queries, so T rows over a long cache are read by one block per head (a 46-row turn over 51K keys:
53 ms on an H100). Here program (g, i, s) takes the n_rep query heads of KV head g for rows block i (BLOCK_T rows x
n_rep heads in one tile, so each K/V tile serves its whole group) and split s of the keys those rows see: whole
BLOCK_N tiles, bounds from the device count, so a short cache leaves the late splits empty. Each program with keys
writes an fp32 partial output and its log2-sum-exp; the merge kernel combines a (row, head)'s splits with keys (the
same bounds: empty ones are neither written nor read) and writes o in q's dtype and, if asked, the natural-log LSE
(as the flash call returns it: SparseVILA's scoring reads it).
"""

from __future__ import annotations

import math

import torch

from ._common import INTERPRET, device_caps
from ._triton import tl, triton

BLOCK_N = 64  # keys per tile
QUERY_TILE = 64  # query vectors (rows x heads of a group) per program
LOG2E = 1.4426950408889634


@triton.jit
def _rows_attention_kernel(q_ptr, k_ptr, v_ptr, keys_ptr, part_ptr, plse_ptr, sqh, sqt, skh, skn, svh, svn,
                           T, H, N_SPLITS, scale_log2, N_REP: tl.constexpr, NR: tl.constexpr, D: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    g, tb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(keys_ptr) - T
    offs_m = tl.arange(0, BLOCK_T * NR)  # query vector m: row t0 + m // NR, head g * N_REP + m % NR
    t = tb * BLOCK_T + offs_m // NR
    h = g * N_REP + offs_m % NR
    m_ok = (t < T) & (offs_m % NR < N_REP)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + h[:, None] * sqh + t[:, None] * sqt + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    if UPCAST:  # the CPU interpreter multiplies bf16 wrongly: fp32 dots there
        q = q.to(tl.float32)
    # The keys this block's rows see, 0 .. start + its last row, cut into N_SPLITS runs of whole tiles.
    seen = start + tl.minimum(tb * BLOCK_T + BLOCK_T, T)
    per = tl.cdiv(tl.cdiv(seen, BLOCK_N), N_SPLITS) * BLOCK_N
    lo = s * per
    hi = tl.minimum(lo + per, seen)
    last = start + t  # the last key each query vector sees
    m_i = tl.full([BLOCK_T * NR], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T * NR], tl.float32)
    acc = tl.zeros([BLOCK_T * NR, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        kt = tl.load(k_ptr + g * skh + offs_n[None, :] * skn + offs_d[:, None], mask=n_ok[None, :], other=0.0)
        v = tl.load(v_ptr + g * svh + offs_n[:, None] * svn + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if UPCAST:
            kt, v = kt.to(tl.float32), v.to(tl.float32)
        sc = tl.dot(q, kt) * scale_log2
        sc = tl.where((offs_n[None, :] <= last[:, None]) & n_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a vector that sees no key of this tile yet
        p = tl.exp2(sc - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if lo < hi:  # a split past the block's keys writes nothing: the merge stops before it
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))  # -inf: no key of this split for that row
        row = (s * H + h) * T + t  # partials (N_SPLITS, H, T[, D])
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], out, mask=m_ok[:, None])
        tl.store(plse_ptr + row, lse, mask=m_ok)


@triton.jit
def _rows_merge_kernel(part_ptr, plse_ptr, keys_ptr, o_ptr, lse_ptr, T, H, N_SPLITS, soh, sot, D: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr):
    # Program (h, i) merges rows block i of the attention kernel (same BLOCK_T): its first `used` splits hold keys.
    h, tb = tl.program_id(0), tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    offs_d = tl.arange(0, D)
    tiles = tl.cdiv(tl.load(keys_ptr) - T + tl.minimum(tb * BLOCK_T + BLOCK_T, T), BLOCK_N)
    used = tl.cdiv(tiles, tl.cdiv(tiles, N_SPLITS))
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    for s in range(0, used):
        m = tl.maximum(m, tl.load(plse_ptr + (s * H + h) * T + t, mask=t_ok, other=float("-inf")))
    m = tl.where(t_ok, m, 0.0)  # finite on real rows: split 0 holds key 0, which every row sees
    den = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, D], tl.float32)
    for s in range(0, used):
        row = (s * H + h) * T + t
        w = tl.exp2(tl.load(plse_ptr + row, mask=t_ok, other=float("-inf")) - m)
        den += w
        acc += w[:, None] * tl.load(part_ptr + row[:, None] * D + offs_d[None, :], mask=t_ok[:, None], other=0.0)
    den = tl.where(t_ok, den, 1.0)
    tl.store(o_ptr + h * soh + t[:, None] * sot + offs_d[None, :], (acc / den[:, None]).to(o_ptr.dtype.element_ty),
             mask=t_ok[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr + h * T + t, (m + tl.log2(den)) / 1.4426950408889634, mask=t_ok)


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Shapes this kernel takes: one sequence, a power-of-two head dim <= 256, whole groups of query heads."""
    D = q.shape[-1]
    return q.shape[0] == 1 and D >= 16 and D <= 256 and D & (D - 1) == 0 and q.shape[1] % k.shape[1] == 0


def default_splits(n_programs: int, capacity: int, device: torch.device) -> int:
    """Key splits: enough programs for ~4 per SM, no more than one split per 4 tiles of the cache's capacity."""
    n_sm = device_caps(device.index if device.index is not None else torch.cuda.current_device())[0] \
        if device.type == "cuda" else 132
    return max(1, min(triton.cdiv(4 * n_sm, n_programs), triton.cdiv(capacity, 4 * BLOCK_N)))


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, *, lse: bool = False,
                   splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (1, H, T, D), k, v (1, Hkv, S, D), keys (1,) int32 on the device -> o (1, H, T, D) in q's dtype (laid out as
    (T, H, D), like the flash call's output) and, with `lse`, the natural-log LSE (1, H, T) fp32 (else None).
    `splits`: the key splits (default: default_splits). No host sync; workspaces are allocated per call (a CUDA
    graph keeps them in its pool)."""
    if not supports(q, k):
        raise ValueError(f"rows_attention: q {tuple(q.shape)} over k {tuple(k.shape)} is not a shape it takes")
    _, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    n_rep = H // Hkv
    NR = triton.next_power_of_2(n_rep)
    block_t = max(1, QUERY_TILE // NR)
    n_tb = triton.cdiv(T, block_t)
    n_splits = splits or default_splits(Hkv * n_tb, S, q.device)
    part = torch.empty(n_splits, H, T, D, dtype=torch.float32, device=q.device)
    plse = torch.empty(n_splits, H, T, dtype=torch.float32, device=q.device)
    o = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    lse_out = torch.empty(1, H, T, dtype=torch.float32, device=q.device) if lse else plse
    _rows_attention_kernel[(Hkv, n_tb, n_splits)](
        q, k, v, keys, part, plse, q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        T, H, n_splits, LOG2E / math.sqrt(D), N_REP=n_rep, NR=NR, D=D, BLOCK_T=block_t, BLOCK_N=BLOCK_N,
        UPCAST=INTERPRET, num_warps=4, num_stages=2)
    _rows_merge_kernel[(H, n_tb)](part, plse, keys, o, lse_out, T, H, n_splits, o.stride(1), o.stride(0),
                                  D=D, BLOCK_T=block_t, BLOCK_N=BLOCK_N, WRITE_LSE=lse, num_warps=4)
    return o.transpose(0, 1)[None], lse_out if lse else None


def rows_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch in fp32: (o (1, H, T, D) in q's dtype, natural-log LSE (1, H, T) fp32)."""
    _, H, T, D = q.shape
    n = int(keys.reshape(-1)[0])
    rep = H // k.shape[1]
    kf = k[0, :, :n].float().repeat_interleave(rep, 0)  # (H, n, D)
    vf = v[0, :, :n].float().repeat_interleave(rep, 0)
    s = q[0].float() @ kf.transpose(1, 2) / math.sqrt(D)  # (H, T, n)
    visible = torch.arange(n, device=q.device)[None, :] <= (n - T + torch.arange(T, device=q.device))[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, -1) @ vf).to(q.dtype)[None], torch.logsumexp(s, -1)[None]
