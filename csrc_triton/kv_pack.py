"""KV packing: gather the kept cache slots of every KV head into one contiguous decode buffer.

    dst[..., g, i, :] = src[..., g, idx[..., g, i], :]   for i < idx.shape[-1]

src (..., Hkv, S, D) the full K or V cache: one layer (B, Hkv, S, D) or all of them at once (n_layers, B, Hkv, S,
D); idx (..., Hkv, L) int32 slots, per head in increasing order; dst (..., Hkv, L_cap, D) with L_cap >= L, same
dtype; only rows 0..L-1 are written. src and dst may also be (K, V) pairs of tensors with equal shapes and strides:
both are packed by the same launch (one launch per question for the whole model). Keys were rotated at their
logical positions when cached, so packing copies bits and never re-rotates. Program (o, g, l-block, pair) copies
BLOCK_L rows of one head; the leading dims (...) must flatten into one (views, as the cache's stacked layers do);
any dtype, D <= 256, unit stride along D.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import tl, triton
from .launch import Launch, Plans, tensor_key


@triton.jit
def _kv_pack_kernel(src_ptr, src2_ptr, idx_ptr, dst_ptr, dst2_ptr, sso, ssh, ssl, sio, sih, sdo, sdh, sdl,
                    L, HKV, D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    og = tl.program_id(0)
    o = (og // HKV).to(tl.int64)  # flattened leading dims: layer * B + b (int64: a whole model's cache)
    g = og % HKV
    if tl.program_id(2) == 0:  # the first tensor of the pair (K), else the second (V)
        src = src_ptr
        dst = dst_ptr
    else:
        src = src2_ptr
        dst = dst2_ptr
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    l_ok = offs_l < L
    ok = l_ok[:, None] & (offs_d[None, :] < D)
    slot = tl.load(idx_ptr + o * sio + g * sih + offs_l, mask=l_ok, other=0).to(tl.int64)
    rows = tl.load(src + o * sso + g * ssh + slot[:, None] * ssl + offs_d[None, :], mask=ok)
    tl.store(dst + o * sdo + g * sdh + offs_l[:, None].to(tl.int64) * sdl + offs_d[None, :], rows, mask=ok)


def _pair(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _check(srcs: tuple, idx: torch.Tensor, dsts: tuple) -> None:
    if len(srcs) != len(dsts) or not 1 <= len(srcs) <= 2:
        raise ValueError(f"kv_pack: src and dst must both be a tensor or both a (K, V) pair, got {len(srcs)}, {len(dsts)}")
    src, dst = srcs[0], dsts[0]
    if any(s.shape != src.shape or s.stride() != src.stride() or s.dtype != src.dtype for s in srcs) or \
            any(d.shape != dst.shape or d.stride() != dst.stride() or d.dtype != dst.dtype for d in dsts):
        raise ValueError("kv_pack: the K and V of a pair must share shape, strides and dtype")
    if src.dim() < 4 or dst.dim() != src.dim() or src.shape[:-2] != dst.shape[:-2] or src.shape[-1] != dst.shape[-1]:
        raise ValueError(f"kv_pack: src {tuple(src.shape)} and dst {tuple(dst.shape)} must be (..., Hkv, *, D)")
    if idx.dim() != src.dim() - 1 or idx.shape[:-1] != src.shape[:-2] or idx.shape[-1] > dst.shape[-2]:
        raise ValueError(f"kv_pack: idx {tuple(idx.shape)} must be (..., Hkv, L) with L <= dst's {dst.shape[-2]} rows")
    if src.dtype != dst.dtype or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_pack: src/dst dtypes {src.dtype}/{dst.dtype} differ or idx is not int32/int64")


class _Plan(NamedTuple):
    """What one distinct call launches (built by _plan): the launch (None when there are no rows) and whether
    idx must first become a contiguous int32 (O, Hkv, L) tensor (else it is passed itself)."""
    launch: Launch | None
    idx_copy: bool


# Plans per distinct call (every tensor's shape, strides, dtype and device, block_l): a question packs once, but its
# eager host time counts, so it skips Triton's per-call dispatch like the prefill launchers (launch.py).
_PLANS = Plans()


def _plan(srcs: tuple, idx: torch.Tensor, dsts: tuple, block_l: int) -> _Plan:
    _check(srcs, idx, dsts)
    Hkv, L = idx.shape[-2:]
    S, D = srcs[0].shape[-2:]
    if any(t.stride(-1) != 1 for t in srcs + dsts) or D > 256:
        raise ValueError("kv_pack: the last dim must be contiguous and at most 256")
    # (O, Hkv, rows, D) views: .view raises if the leading dims cannot flatten without a copy. The kernel gets the
    # tensors themselves (same memory) with these views' strides.
    s4 = srcs[0].view(-1, Hkv, S, D)
    d4 = dsts[0].view(-1, Hkv, dsts[0].shape[-2], D)
    idx_copy = idx.dtype != torch.int32 or not idx.is_contiguous()
    if not L:
        return _Plan(None, idx_copy)
    launch = Launch(_kv_pack_kernel, (s4.shape[0] * Hkv, triton.cdiv(L, block_l), len(srcs)),
                    (*s4.stride()[:3], Hkv * L, L, *d4.stride()[:3], L, Hkv),
                    dict(D=D, BLOCK_L=block_l, BLOCK_D=triton.next_power_of_2(D), num_warps=4))
    return _Plan(launch, idx_copy)


def kv_pack(src, idx: torch.Tensor, dst, block_l: int = 32, *, direct: bool = True):
    """Write src's rows idx (..., Hkv, L) into dst[..., :L, :]; src and dst are tensors or (K, V)
    pairs. Returns dst. direct: after the first launch, skip Triton's dispatch (csrc_triton/launch.py)."""
    srcs, dsts = _pair(src), _pair(dst)
    key = (tuple(tensor_key(t) for t in srcs), tensor_key(idx), tuple(tensor_key(t) for t in dsts), block_l)
    plan = _PLANS.get_or_build(key, lambda: _plan(srcs, idx, dsts, block_l))
    if plan.launch is not None:
        if plan.idx_copy:  # small: a copy is fine
            idx = idx.reshape(-1, *idx.shape[-2:]).to(torch.int32).contiguous()
        # The second of a pair, or the first again (never launched then: the grid's third dim is 1).
        plan.launch(srcs[0], srcs[-1], idx, dsts[0], dsts[-1], direct=direct)
    return dst


def kv_pack_ref(src, idx: torch.Tensor, dst):
    """Plain PyTorch gather along the sequence dim, per tensor of the pair."""
    srcs, dsts = _pair(src), _pair(dst)
    _check(srcs, idx, dsts)
    L, D = idx.shape[-1], srcs[0].shape[-1]
    for s, d in zip(srcs, dsts):
        d[..., :L, :] = torch.gather(s, -2, idx.long()[..., None].expand(*idx.shape, D))
    return dst
