"""Decoding attention: one query token per sequence over a (packed) KV buffer, GQA, split-K.

    o[b, h] = softmax(scale * q[b, h] . K[b, g]ᵀ over slots 0..lengths[b]-1) @ V[b, g],  g = h // n_rep

q (B, H, D), k/v (B, Hkv, L_max, D) fp16/bf16 with unit stride along D, lengths (B,) int32 on the device (read by
the kernel, so a CUDA graph can replay the step as the length grows; 1 <= length <= L_max is checked only by
`decode_attention_ref`). Flash-decoding: program (b, g, s) streams split s of the keys once for all n_rep query
heads of KV head g, keeping an online max/sum in fp32, and writes an fp32 partial output with its log-sum-exp. The
split merge is fused: each program then bumps the int32 arrival counter of its (b, g); the last of the n_splits
programs to arrive reads the partials back from L2, merges them and resets the counter to 0 for the next call, so
the step is ONE launch with no host sync (`fused=False` keeps the older second merge kernel for comparison). The
split count (from L_max and the SM count) is a runtime argument, so a new buffer size never recompiles; split
boundaries come from the device length. K, V are read once. D <= 256.

The counters live in a per-device int32 workspace allocated (zeroed) on the first call, which must therefore happen
outside a CUDA graph capture; calls on one device must not overlap on two streams.

The fixed cost of a call is shortened (docs/perf_notes.md): the grid is (Hkv, splits, B), so the length load waits
on no integer division; the length, split bounds and addresses are computed before the PDL wait; the query is
staged with each tile's K/V (cp.async) rather than stored to shared memory behind a barrier; the merging program
loads every split's LSE and partial in one round trip (up to MERGE_S splits). `prefetch` (chosen by buffer length,
CONFIG_BY_LENGTH): how many K/V tiles of each split are asked into L2 before the PDL wait.

Contract of the early length read: `lengths` was written before the last kernel launched WITHOUT programmatic
dependent launch started (such a launch waits for everything before it to complete). In the decode step the
previous step's ops.argmax_step writes it and the next step's embedding gather (a PyTorch kernel) runs before any
layer, so it holds at every layer's attention.
"""

from __future__ import annotations

import math

import torch

from . import pdl
from ._common import INTERPRET
from ._triton import tl, triton
from .pdl import options as pdl_options

LOG2E = 1.4426950408889634
# Programs per SM that the split count aims for: enough loads in flight to cover HBM latency.
CTAS_PER_SM = 4
MIN_SPLIT = 128  # keys per split at least: below that the per-program prologue/epilogue dominates
MERGE_ELEMS = 8192  # fp32 partial elements the merging program holds per step (64 registers at 4 warps)
# Launch config by buffer length L_max (the only length known on the host: the real one is on the device):
# (largest L_max, block_n, num_warps, num_stages, programs per SM, prefetched tiles), first row that covers L_max.
# From the H200 sweeps (scripts/benches/decode_attention.py; docs/benchmarks.md): 128-key tiles, 3 stages up to 32K
# keys, above that 64-key tiles and 4 stages; prefetch 2 tiles, none for [6K, 16K) (the buffer length stands for
# the keys: a packed buffer holds the kept rows plus the turn's room; 16K unmeasured). [2K, 6K): 64-key tiles, no
# prefetch, timed inside the decode step (a 74 KB program shares an SM with the GEMVs under PDL; docs/perf_notes.md).
CONFIG_BY_LENGTH = ((2047, 128, 4, 3, 1, 2), (6143, 64, 4, 3, 1, 0), (16383, 128, 4, 3, 1, 0),
                    (32768, 128, 4, 3, 1, 2), (None, 64, 4, 4, 1, 2))


def default_config(max_len: int) -> tuple[int, int, int, int, int]:
    """(block_n, num_warps, num_stages, programs per SM, prefetched tiles) for max_len slots (CONFIG_BY_LENGTH)."""
    for bound, *cfg in CONFIG_BY_LENGTH:
        if bound is None or max_len <= bound:
            return tuple(cfg)
    raise AssertionError("CONFIG_BY_LENGTH ends with an unbounded row")


@triton.jit
def _merge_splits(o_part_ptr, lse_ptr, out_ptr, s_outb, s_outh, b, g, H, N_SPLITS,
                  N_REP: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                  MERGE_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[b, h] = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m) over the splits of the n_rep heads of group g.
    Loads bypass L1 (.cg): the partials were written by other SMs during this launch. Up to MERGE_S splits are
    merged from one round trip of loads; more take the stepped merge."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < N_REP
    d_ok = offs_d < D
    row0 = (b * H + g * N_REP + offs_r) * N_SPLITS  # (BLOCK_R,) first partial of each head
    if BLOCK_S <= MERGE_S:
        # Every LSE and partial in ONE step: independent loads share one L2 round trip (stepped: LSEs first).
        ok = r_ok[:, None] & (offs_s < N_SPLITS)[None, :]  # (BLOCK_R, BLOCK_S)
        lse = tl.load(lse_ptr + row0[:, None] + offs_s[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(o_part_ptr + (row0[:, None, None] + offs_s[None, :, None]) * D + offs_d[None, None, :],
                        mask=ok[:, :, None] & d_ok[None, None, :], other=0.0,
                        cache_modifier=".cg")  # (BLOCK_R, BLOCK_S, BLOCK_D)
        m = tl.where(r_ok, tl.max(lse, axis=1), 0.0)  # finite on real heads: split 0 holds keys
        w = tl.exp2(lse - m[:, None])
        denom = tl.where(r_ok, tl.sum(w, axis=1), 1.0)
        res = tl.sum(parts * w[:, :, None], axis=1) / denom[:, None]
    else:
        lse = tl.load(lse_ptr + row0[:, None] + offs_s[None, :], cache_modifier=".cg",
                      mask=r_ok[:, None] & (offs_s < N_SPLITS)[None, :], other=float("-inf"))  # (BLOCK_R, BLOCK_S)
        # Split 0 always holds keys (length >= 1), so m is finite on real heads; padded heads get 0.
        m = tl.max(lse, axis=1)
        m = tl.where(r_ok, m, 0.0)
        denom = tl.sum(tl.exp2(lse - m[:, None]), axis=1)
        denom = tl.where(r_ok, denom, 1.0)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for s0 in range(0, N_SPLITS, MERGE_S):  # one step for <= MERGE_S splits: the loads overlap
            s = s0 + tl.arange(0, MERGE_S)
            ok = r_ok[:, None] & (s < N_SPLITS)[None, :]  # (BLOCK_R, MERGE_S)
            w = tl.exp2(tl.load(lse_ptr + row0[:, None] + s[None, :], mask=ok, other=float("-inf"),
                                cache_modifier=".cg") - m[:, None])
            o = tl.load(o_part_ptr + (row0[:, None, None] + s[None, :, None]) * D + offs_d[None, None, :],
                        mask=ok[:, :, None] & d_ok[None, None, :], other=0.0,
                        cache_modifier=".cg")  # (BLOCK_R, MERGE_S, BLOCK_D)
            acc += tl.sum(o * w[:, :, None], axis=1)
        res = acc / denom[:, None]
    heads = g * N_REP + offs_r
    tl.store(out_ptr + b * s_outb + heads[:, None] * s_outh + offs_d[None, :], res.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _load_tile(ptrs, d_ok, EVEN_D: tl.constexpr):
    """A whole tile of keys: no mask at all when the head dim fills the block (the common D = 128)."""
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=d_ok, other=0.0)


@triton.jit
def _load_q(ptrs, ok, UPCAST: tl.constexpr):
    """The query rows of a group (BLOCK_H, BLOCK_D); padding rows load zeros."""
    q = tl.load(ptrs, mask=ok, other=0.0)
    if UPCAST:  # the CPU interpreter multiplies bf16 wrongly; it runs the dots in fp32 instead
        q = q.to(tl.float32)
    return q


@triton.jit
def _attend(q, kt, v, m_i, l_i, acc, scale_log2, offs_n, n_valid, UPCAST: tl.constexpr):
    """One online-softmax step over a tile of keys; columns >= n_valid (a partial last tile) score -inf. The
    running max is kept in scaled log2 units, so each score costs one FFMA before its exp2."""
    if UPCAST:  # the CPU interpreter multiplies bf16 wrongly; it runs the dots in fp32 instead
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt)  # (BLOCK_H, BLOCK_N) raw scores
    if n_valid < kt.shape[1]:
        s = tl.where(offs_n[None, :] < n_valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _program(HKV):
    """(b, g, b * HKV + g, split) of this program; no integer division stands before the length load."""
    g = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    return b, g, b * HKV + g, split


@triton.jit
def _split_rows(length, split, N_SPLITS, BLOCK_N: tl.constexpr):
    """Split s covers whole BLOCK_N tiles [start, end) of the valid keys."""
    tiles = tl.cdiv(length, BLOCK_N)
    per_split = tl.cdiv(tiles, N_SPLITS)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, length)
    return start, end


@triton.jit
def _prefetch_l2(base, stride_n, start, end, D: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
                 LINES: tl.constexpr, ELEMS: tl.constexpr, ASM: tl.constexpr):
    """prefetch.global.L2 of every 128-byte line of rows [start, min(end, start + TILES * BLOCK_N)) (LINES lines of
    ELEMS elements per row, padded to a power of two). A prefetch has no effect on what any load returns (L2 is the
    point of coherence; L1 is not filled), so it may run before the PDL wait, even over the row the preceding
    kernel writes: the HBM reads overlap that kernel's tail."""
    idx = tl.arange(0, BLOCK_N * LINES)
    col = (idx % LINES) * ELEMS
    row = start + idx // LINES
    for t in tl.static_range(TILES):
        ok = (row + t * BLOCK_N < end) & (col < D)
        ptrs = base + (row + t * BLOCK_N) * stride_n + col
        if ASM:  # the interpreter has no inline asm (there the prefetch is a no-op)
            tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                                      "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, o_ptr, lse_ptr, out_ptr, cnt_ptr,
    sqb, sqh, skb, skh, skl, svb, svh, svl, s_outb, s_outh,
    scale_log2, HKV, H, N_SPLITS, N_REP: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr,
    FUSED: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, PF_LINES: tl.constexpr, PF_ELEMS: tl.constexpr, ASM: tl.constexpr,
):
    # Before the PDL wait: only what the preceding kernel cannot have written: the length, by contract (module
    # docstring); the split's rows and the L2 prefetch come from it.
    b, g, bg, split = _program(HKV)
    length = tl.load(len_ptr + b)
    start, end = _split_rows(length, split, N_SPLITS, BLOCK_N)
    if PREFETCH > 0:
        _prefetch_l2(k_ptr + b.to(tl.int64) * skb + g * skh, skl, start, end, D, BLOCK_N, PREFETCH,
                     PF_LINES, PF_ELEMS, ASM)
        _prefetch_l2(v_ptr + b.to(tl.int64) * svb + g * svh, svl, start, end, D, BLOCK_N, PREFETCH,
                     PF_LINES, PF_ELEMS, ASM)
    pdl.enter(PDL)  # a decode-step kernel: may start early, reads nothing the previous one writes before it is done

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < N_REP
    # With D == BLOCK_D (64, 128, 256) this mask is all-true and constant along D: loads still vectorise.
    d_ok = offs_d < D
    heads = g * N_REP + offs_h
    # Rows past N_REP are padding so tl.dot sees M >= 16; they load zeros and are never stored.
    q_ptrs = q_ptr + b * sqb + heads[:, None] * sqh + offs_d[None, :]  # (BLOCK_H, BLOCK_D)
    q_ok = h_ok[:, None] & d_ok[None, :]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = k_ptr + b.to(tl.int64) * skb + g * skh
    v_base = v_ptr + b.to(tl.int64) * svb + g * svh
    # Whole tiles first, with no key mask (nor head-dim mask when D == BLOCK_D): only the split that holds the last
    # key can end in a partial tile, which the masked step after the loop takes.
    full_end = start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N
    # Loop-invariant int32 offsets inside a tile; the tile's base is a scalar (uniform) pointer.
    k_off = offs_n[None, :] * skl + offs_d[:, None]  # (BLOCK_D, BLOCK_N)
    v_off = offs_n[:, None] * svl + offs_d[None, :]  # (BLOCK_N, BLOCK_D)
    for n0 in range(start, full_end, BLOCK_N):
        kt = _load_tile(k_base + n0 * skl + k_off, d_ok[:, None], D == BLOCK_D)
        v = _load_tile(v_base + n0 * svl + v_off, d_ok[None, :], D == BLOCK_D)
        # q is pipelined with the tile (cp.async); the mask (always true) depends on n0 so the load is not hoisted
        qn = _load_q(q_ptrs, q_ok & (n0 >= start), UPCAST)
        m_i, l_i, acc = _attend(qn, kt, v, m_i, l_i, acc, scale_log2, offs_n, BLOCK_N, UPCAST)
    if full_end < end:
        kp = k_base + full_end * skl + k_off
        vp = v_base + full_end * svl + v_off
        n_ok = full_end + offs_n < end
        kt = tl.load(kp, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(vp, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        qn = _load_q(q_ptrs, q_ok, UPCAST)
        m_i, l_i, acc = _attend(qn, kt, v, m_i, l_i, acc, scale_log2, offs_n, end - full_end, UPCAST)
    # An empty split (start >= length) leaves l_i = 0: it stores lse = -inf and o = 0.
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    st_ok = h_ok[:, None] & d_ok[None, :]
    if N_SPLITS == 1:  # one split (specialised at compile time): the partial is the answer
        tl.store(out_ptr + b * s_outb + heads[:, None] * s_outh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=st_ok)
    else:
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        # Partials are contiguous (B, H, N_SPLITS, D) and (B, H, N_SPLITS).
        row = (b * H + heads) * N_SPLITS + split  # (BLOCK_H,)
        tl.store(o_ptr + row[:, None] * D + offs_d[None, :], o, mask=st_ok)
        tl.store(lse_ptr + row, lse, mask=h_ok)
        if FUSED:
            # Every thread's partial stores must precede the (one-thread) release of the counter.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + bg, 1, sem="acq_rel", scope="gpu")
            if arrived == N_SPLITS - 1:  # the last program of (b, g): all partials are visible
                _merge_splits(o_ptr, lse_ptr, out_ptr, s_outb, s_outh, b, g, H, N_SPLITS, N_REP, D,
                              BLOCK_R, BLOCK_S, MERGE_S, BLOCK_D)
                tl.store(cnt_ptr + bg, 0)  # ready for the next launch (kernel boundary orders it)


@triton.jit
def _decode_attention_reduce_kernel(
    o_part_ptr, lse_ptr, out_ptr, s_outb, s_outh, H, N_SPLITS,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < N_SPLITS
    lse = tl.load(lse_ptr + bh * N_SPLITS + offs_s, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
    m = tl.max(lse, axis=0)  # finite: split 0 always holds keys (length >= 1)
    w = tl.exp2(lse - m)
    w = w / tl.sum(w, axis=0)
    o = tl.load(o_part_ptr + (bh * N_SPLITS + offs_s[:, None]) * D + offs_d[None, :],
                mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # (BLOCK_S, BLOCK_D)
    o = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + b * s_outb + h * s_outh + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < D)


_SMS: dict[int, int] = {}
_COUNTERS: dict[str, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counter buffers, kept alive for captured graphs


def _sm_count(device: torch.device) -> int:
    """Cached: the launcher runs once per layer per token, so its host time matters."""
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The per-device int32 arrival counters (all 0 between launches: the merging program resets its own).
    Allocated and zeroed eagerly: inside a graph capture a fresh zero-fill would not run."""
    key = str(device)
    cnt = _COUNTERS.get(key)
    if cnt is None or cnt.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_attention: call it once outside the CUDA graph capture first "
                               "(it allocates its split counters on the first call)")
        if cnt is not None:  # graphs captured earlier still point at it: never free it
            _RETIRED.append(cnt)
        cnt = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = cnt
    return cnt


def default_splits(max_len: int, n_programs: int, device: torch.device, ctas_per_sm: int = CTAS_PER_SM) -> int:
    """Splits so that B*Hkv*splits programs fill every SM about `ctas_per_sm` times, each split keeping >= MIN_SPLIT
    keys (at most 256 splits). Rounded down: one program more than the SMs hold would run in a second wave."""
    want = max(1, ctas_per_sm * _sm_count(device) // max(n_programs, 1))
    return int(min(want, max(1, -(-max_len // MIN_SPLIT)), 256))


def _check(q, k, v, lengths, out):
    B, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or H % k.shape[1]:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "must be (B, H, D), (B, Hkv, L, D) with H a multiple of Hkv")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"decode_attention: q, k, v must share dtype float16/bfloat16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if lengths.shape != (B,) or lengths.dtype != torch.int32 or lengths.device != q.device:
        raise ValueError("decode_attention: lengths must be an int32 (B,) tensor on q's device")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or D > 256:
        raise ValueError("decode_attention: the last dim must be contiguous and at most 256")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"decode_attention: out must be {q.dtype} {tuple(q.shape)} with a contiguous last dim")


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     scale: float | None = None, n_splits: int | None = None,
                     block_n: int | None = None, out: torch.Tensor | None = None,
                     num_warps: int | None = None, num_stages: int | None = None, fused: bool = True,
                     prefetch: int | None = None, *, pdl: bool = True) -> torch.Tensor:
    """q (B, H, D) x k, v (B, Hkv, L_max, D), lengths (B,) int32 on q's device -> (B, H, D) in q's dtype.

    `out` (like q) receives the result when given (a captured graph's fixed output buffer). block_n, num_warps,
    num_stages, n_splits, fused (merge in the same launch) and prefetch (K/V tiles of each split asked into L2
    before the PDL wait) are tuning knobs; left None they come from the buffer length (default_config).
    pdl: programmatic dependent launch where the device has it (csrc_triton/pdl.py).
    """
    _check(q, k, v, lengths, out)
    B, H, D = q.shape
    Hkv, L_max = k.shape[1], k.shape[2]
    out = torch.empty_like(q) if out is None else out
    n_rep = H // Hkv
    d_block, d_warps, d_stages, per_sm, d_prefetch = default_config(L_max)
    block_n, num_warps, num_stages = block_n or d_block, num_warps or d_warps, num_stages or d_stages
    prefetch = d_prefetch if prefetch is None else prefetch
    n_splits = n_splits or default_splits(L_max, B * Hkv, q.device, per_sm)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    # One fp32 workspace: partial outputs (B, H, n_splits, D) then their log-sum-exps (B, H, n_splits).
    work = torch.empty(B * H * n_splits * (D + 1) if n_splits > 1 else 1, device=q.device, dtype=torch.float32)
    o_part, lse = work[: B * H * n_splits * D], work[B * H * n_splits * D:]
    cnt = _counters(q.device, B * Hkv) if fused and n_splits > 1 else lengths  # unused when not fused
    block_d = max(16, triton.next_power_of_2(D))
    block_r, block_s = triton.next_power_of_2(n_rep), triton.next_power_of_2(n_splits)
    per_line = 128 // q.element_size()  # elements in a 128-byte line (the prefetch granule)
    _decode_attention_kernel[(Hkv, n_splits, B)](
        q, k, v, lengths, o_part, lse, out, cnt,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), scale * LOG2E, Hkv, H, n_splits,
        N_REP=n_rep, D=D, BLOCK_H=max(16, triton.next_power_of_2(n_rep)), BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_R=block_r, BLOCK_S=block_s, MERGE_S=min(block_s, max(1, MERGE_ELEMS // (block_r * block_d))),
        FUSED=fused, UPCAST=INTERPRET and q.dtype == torch.bfloat16, PREFETCH=prefetch,
        PF_LINES=triton.next_power_of_2(-(-D // per_line)), PF_ELEMS=per_line, ASM=not INTERPRET,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(q.device, pdl),
    )
    if n_splits > 1 and not fused:
        _decode_attention_reduce_kernel[(B * H,)](
            o_part, lse, out, out.stride(0), out.stride(1), H, n_splits,
            D=D, BLOCK_D=block_d, BLOCK_S=block_s, num_warps=4,
        )
    return out


def decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """Plain PyTorch: per sequence, SDPA of the one query over slots 0..length-1 (GQA expanded)."""
    B, H, D = q.shape
    n_rep = H // k.shape[1]
    outs = []
    for b, n in enumerate(lengths.tolist()):
        if not 1 <= n <= k.shape[2]:
            raise ValueError(f"decode_attention: length {n} outside 1..{k.shape[2]}")
        kb = k[b, :, :n].repeat_interleave(n_rep, dim=0)  # (H, n, D)
        vb = v[b, :, :n].repeat_interleave(n_rep, dim=0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[b, :, None], kb, vb, scale=scale)[:, 0])
    return torch.stack(outs)  # (B, H, D)
