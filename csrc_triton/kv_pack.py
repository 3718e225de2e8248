"""KV packing: gather the kept cache slots of every KV head into one contiguous decode buffer.

    dst[b, g, i, :] = src[b, g, idx[b, g, i], :]   for i < idx.shape[2]

src (B, Hkv, S, D) a layer's full K or V cache; idx (B, Hkv, L) int32 slots, per head in increasing
order ([non-retrievable prefix | selected retrievable | the rest] is simply the kept slots in order);
dst (B, Hkv, L_cap, D) with L_cap >= L, same dtype; only rows 0..L-1 are written. Keys were rotated
at their logical positions when cached, so packing copies bits and never re-rotates. One program
copies BLOCK_L rows of one head; any dtype, D <= 256, unit stride along D.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_pack_kernel(src_ptr, idx_ptr, dst_ptr, ssb, ssh, ssl, sib, sih, sdb, sdh, sdl, L, HKV,
                    D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    bg = tl.program_id(0)
    b = bg // HKV
    g = bg % HKV
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    l_ok = offs_l < L
    ok = l_ok[:, None] & (offs_d[None, :] < D)
    slot = tl.load(idx_ptr + b * sib + g * sih + offs_l, mask=l_ok, other=0).to(tl.int64)
    rows = tl.load(src_ptr + b * ssb + g * ssh + slot[:, None] * ssl + offs_d[None, :], mask=ok)
    tl.store(dst_ptr + b * sdb + g * sdh + offs_l[:, None].to(tl.int64) * sdl + offs_d[None, :], rows, mask=ok)


def _check(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dim() != 4 or dst.dim() != 4 or src.shape[:2] != dst.shape[:2] or src.shape[3] != dst.shape[3]:
        raise ValueError(f"kv_pack: src {tuple(src.shape)} and dst {tuple(dst.shape)} must be (B, Hkv, *, D)")
    if idx.dim() != 3 or idx.shape[:2] != src.shape[:2] or idx.shape[2] > dst.shape[2]:
        raise ValueError(f"kv_pack: idx {tuple(idx.shape)} must be (B, Hkv, L) with L <= dst's {dst.shape[2]} rows")
    if src.dtype != dst.dtype or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_pack: src/dst dtypes {src.dtype}/{dst.dtype} differ or idx is not int32/int64")


def kv_pack(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, block_l: int = 32) -> torch.Tensor:
    """Write src's rows idx (B, Hkv, L) into dst[:, :, :L]; returns dst."""
    _check(src, idx, dst)
    B, Hkv, L = idx.shape
    D = src.shape[3]
    if src.stride(-1) != 1 or dst.stride(-1) != 1 or D > 256:
        raise ValueError("kv_pack: the last dim must be contiguous and at most 256")
    idx = idx.to(torch.int32)
    if L:
        _kv_pack_kernel[(B * Hkv, triton.cdiv(L, block_l))](
            src, idx, dst, src.stride(0), src.stride(1), src.stride(2), idx.stride(0), idx.stride(1),
            dst.stride(0), dst.stride(1), dst.stride(2), L, Hkv,
            D=D, BLOCK_L=block_l, BLOCK_D=triton.next_power_of_2(D), num_warps=4,
        )
    return dst


def kv_pack_ref(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch gather along the sequence dim."""
    _check(src, idx, dst)
    L, D = idx.shape[2], src.shape[3]
    dst[:, :, :L] = torch.gather(src, 2, idx.long()[..., None].expand(-1, -1, -1, D))
    return dst
