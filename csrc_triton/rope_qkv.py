"""RoPE of q and k fused with the KV-cache write: the fused q/k/v projection's output in, rotated q out.

qkv (B, T, (H + 2 Hkv) D) holds per token [q heads | k heads | v heads], D each (the checkpoint's fused wqkv).
Rotate-half RoPE (HF Llama layout: dim d pairs with d + D/2) with cos, sin (T, D) in the activation dtype, computed
with ops.rope's roundings (rounding.py): bit for bit ops.rope's under the interpreter; on the GPU some elements come
out an ulp or two away (one product of each sum is fused into an FMA: see rope_halves); the tests bound it:
    out[:D/2] = x1*cos1 - x2*sin1        out[D/2:] = x2*cos2 + x1*sin2
Rotated k and raw v go to k_cache, v_cache (B, Hkv, S, D) at sequence slot slots[t] (T,) (any int dtype, read on
the device, so a captured decode graph can advance it without re-capture; the caller checks slots < S), and
optionally also into a second cache pair at its own slots (a SparseVILA turn's packed decode buffer). Returns
rotated q as (B, H, T, D), contiguous. One program per (token, group of heads of [q heads | k heads]); a k head also
copies its v head. One launch replaces split, three view/transposes, two ropes and two cache copies.
dtypes: fp16/bf16; D even, D <= 1024; cache last dim contiguous.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import pdl
from ._common import check_rope_qkv
from ._triton import tl, triton
from .launch import Launch, Plans, tensor_key
from .pdl import options as pdl_options
from .rounding import round_to


@triton.jit
def rope_halves(x1, x2, c1, c2, s1, s2, dtype: tl.constexpr):
    """Rotate-half RoPE of the pairs (x1, x2) = (dim d, dim d + D/2), all fp32 -> (o1, o2) fp32 holding dtype
    values: ops.rope's three PyTorch ops, each result rounded to the dtype (x*cos, rot(x)*sin, the sum); round(-a) =
    -round(a), so the first half's sum with the rounded (-x2*sin1) is the difference below. That is what runs under
    the interpreter. On the GPU LLVM narrows the fp32 ops on widened 16-bit values to 16-bit ops, and the backend
    contracts the first product of each sum into an FMA (sm_90a, triton 3.6): o1 = fma(x1, cos1, -rn(x2 sin1)),
    o2 = fma(x2, cos2, rn(x1 sin2)). The qkv GEMV's RoPE epilogue (EPI 3) writes that form out explicitly."""
    o1 = round_to(round_to(x1 * c1, dtype) - round_to(x2 * s1, dtype), dtype)
    o2 = round_to(round_to(x2 * c2, dtype) + round_to(x1 * s2, dtype), dtype)
    return o1, o2


@triton.jit
def _store_kv(k_ptr, v_ptr, slot_ptr, b, t, kh, offs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
              stride_vs, k_lo, k_hi, v_lo, v_hi, is_k, HALF: tl.constexpr):
    """Rotated k and raw v halves of (b, kh, token t) at sequence slot slot_ptr[t] of one cache pair."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    k_dst = k_ptr + b * stride_kb + kh * stride_kh + slot * stride_ks + offs[None, :]
    tl.store(k_dst, k_lo, mask=is_k)
    tl.store(k_dst + HALF, k_hi, mask=is_k)
    v_dst = v_ptr + b * stride_vb + kh * stride_vh + slot * stride_vs + offs[None, :]
    tl.store(v_dst, v_lo, mask=is_k)
    tl.store(v_dst + HALF, v_hi, mask=is_k)


@triton.jit
def _rope_qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, k2_ptr, v2_ptr, slot2_ptr, T,
                     stride_xb, stride_xt, stride_ct, stride_st,
                     stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                     stride_k2b, stride_k2h, stride_k2s, stride_v2b, stride_v2h, stride_v2s,
                     H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr,
                     SECOND: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # a decode-step kernel: may start early, reads nothing before the previous one is done
    bt = tl.program_id(0).to(tl.int64)  # token row b * T + t
    b, t = bt // T, bt % T
    # HEADS consecutive heads of [q heads | k heads]; a k head `kh` also copies v head `kh`.
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    offs = tl.arange(0, BLOCK)
    mask = (heads[:, None] < H + HKV) & (offs[None, :] < HALF)  # (HEADS, BLOCK)
    dtype = q_ptr.dtype.element_ty
    src = qkv_ptr + b * stride_xb + t * stride_xt + heads[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_st + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_st + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    o1, o2 = rope_halves(x1, x2, c1, c2, s1, s2, dtype)  # ops.rope: x*cos + cat(-x2, x1)*sin, its roundings
    o1, o2 = o1.to(dtype), o2.to(dtype)
    is_q = mask & (heads[:, None] < H)
    q_dst = q_ptr + ((b * H + heads[:, None]) * T + t) * (2 * HALF) + offs[None, :]  # (B, H, T, D) contiguous
    tl.store(q_dst, o1, mask=is_q)
    tl.store(q_dst + HALF, o2, mask=is_q)
    is_k = mask & (heads[:, None] >= H)
    kh = (heads[:, None] - H).to(tl.int64)  # negative on q heads, whose lanes are masked off
    v_src = src + HKV * (2 * HALF)  # v head kh sits Hkv heads after k head kh
    v_lo, v_hi = tl.load(v_src, mask=is_k), tl.load(v_src + HALF, mask=is_k)
    _store_kv(k_ptr, v_ptr, slot_ptr, b, t, kh, offs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
              stride_vs, o1, o2, v_lo, v_hi, is_k, HALF)
    if SECOND:  # the packed decode buffer of a SparseVILA turn also receives the new token
        _store_kv(k2_ptr, v2_ptr, slot2_ptr, b, t, kh, offs, stride_k2b, stride_k2h, stride_k2s, stride_v2b,
                  stride_v2h, stride_v2s, o1, o2, v_lo, v_hi, is_k, HALF)


def _heads_per_program(rows: int, n_heads: int, device: torch.device) -> int:
    """One head per program at decode (40 programs for Llama-3-8B: spread over the SMs, the latency
    is one head's); a few heads per program in prefill (fewer, fuller programs; cos/sin loaded once
    per head group). The interpreter pays per program: all heads of a token in one."""
    if device.type != "cuda":
        return triton.next_power_of_2(n_heads)
    return 1 if rows <= 8 else 4


class _Plan(NamedTuple):
    """What one distinct call launches (built by _plan): q's shape and the launch (None when B * T == 0)."""
    q_shape: tuple[int, int, int, int]
    launch: Launch | None


# Plans per distinct call (every tensor's shape, strides, dtype and device, the head counts, options, the
# pdl flag): a prefill makes the same call every layer, so it pays Triton's dispatch only once
# (csrc_triton/launch.py).
_PLANS = Plans()


def _plan(qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads, second, heads_per_program, num_warps,
          pdl) -> _Plan:
    D = check_rope_qkv(qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads)
    if second is not None:
        check_rope_qkv(qkv, cos, sin, *second, n_heads, n_kv_heads)
    k2, v2, _ = second if second is not None else (k_cache, v_cache, slots)
    B, T, _ = qkv.shape
    if not B * T:
        return _Plan((B, n_heads, T, D), None)
    stride_xb, stride_xt = (qkv if qkv.stride(-1) == 1 else qkv.contiguous()).stride()[:2]  # what the call passes
    n = n_heads + n_kv_heads
    hp = heads_per_program or _heads_per_program(B * T, n, qkv.device)
    block = triton.next_power_of_2(D // 2)
    launch = Launch(_rope_qkv_kernel, (B * T, triton.cdiv(n, hp)),
                    (T, stride_xb, stride_xt, cos.stride(0), sin.stride(0), *k_cache.stride()[:3],
                     *v_cache.stride()[:3], *k2.stride()[:3], *v2.stride()[:3]),
                    dict(H=n_heads, HKV=n_kv_heads, HALF=D // 2, HEADS=hp, SECOND=second is not None, BLOCK=block,
                         num_warps=num_warps or max(1, min(4, hp * block // 64)), **pdl_options(qkv.device, pdl)))
    return _Plan((B, n_heads, T, D), launch)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slots: torch.Tensor, n_heads: int, n_kv_heads: int,
             second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             heads_per_program: int | None = None, num_warps: int | None = None, *, pdl: bool = True,
             direct: bool = True) -> torch.Tensor:
    """qkv (B, T, (H + 2 Hkv) D), cos/sin (T, D), caches (B, Hkv, S, D), slots (T,) -> q (B, H, T, D).
    Writes rotated k and v into the caches at `slots`, and also into `second` = (k2, v2, slots2)
    when given (another cache pair (B, Hkv, S2, D), e.g. the packed decode buffer, at slots2 (T,)).
    `heads_per_program` (a power of 2) and `num_warps` override the launch (benchmarks). pdl: programmatic
    dependent launch where the device has it (csrc_triton/pdl.py); direct: after the first launch, skip
    Triton's dispatch (csrc_triton/launch.py)."""
    key = (tensor_key(qkv), tensor_key(cos), tensor_key(sin), tensor_key(k_cache), tensor_key(v_cache),
           tensor_key(slots), n_heads, n_kv_heads, None if second is None else tuple(map(tensor_key, second)),
           heads_per_program, num_warps, pdl)
    plan = _PLANS.get_or_build(key, lambda: _plan(qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads,
                                                  second, heads_per_program, num_warps, pdl))
    k2, v2, slots2 = second if second is not None else (k_cache, v_cache, slots)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(plan.q_shape, dtype=qkv.dtype, device=qkv.device)
    if plan.launch is not None:
        plan.launch(qkv, cos, sin, q, k_cache, v_cache, slots, k2, v2, slots2, direct=direct)
    return q


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ops.rope's expression: x (..., T, D) rotated with cos, sin (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_qkv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, n_heads: int, n_kv_heads: int,
                 second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Plain PyTorch (the CPU path), today's Attention sequence: split, view, transpose, rope, cache copy.
    Any float dtype. The returned q holds the kernel's values in the layout PyTorch's elementwise ops
    give a transposed input ((B, T, H, D) memory order), so CPU results stay those of the unfused model."""
    B, T, _ = qkv.shape
    H, Hkv = n_heads, n_kv_heads
    D = qkv.shape[-1] // (H + 2 * Hkv)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
    k = k.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
    v = v.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
    k = rope_ref(k, cos, sin)
    for kc, vc, sl in [(k_cache, v_cache, slots)] + ([second] if second is not None else []):
        sl = sl.to(device=kc.device, dtype=torch.long)
        kc.index_copy_(2, sl, k)
        vc.index_copy_(2, sl, v)
    return rope_ref(q, cos, sin)
