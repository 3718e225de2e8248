"""The W4 decode GEMV of the fused qkv projection with RoPE and the KV-cache write in its epilogue.

    qkv = x @ W^T + bias,  W = [q heads | k heads | v heads] ((H + 2 Hkv) D, K)
    q (B, H, T, D) = rope(q heads);  k_cache[b, :, slots[t]] = rope(k heads);  v_cache[b, :, slots[t]] = v heads

bit for bit rope_qkv.rope_qkv(w4a16_gemv(x, ...).view(B, T, N), ...) with the same config, in one launch:
x (B T, K) fp16/bf16 (token m = b T + t, B T <= 8); bias (N,) (Qwen2) added before the rounding; cos, sin (T, D) in
x's dtype; k_cache, v_cache (B, Hkv, S, D), last dim contiguous; slots (T,) integers on the device (a captured
decode graph advances them in place), and a second cache pair at its own slots when given (a SparseVILA turn's
packed decode buffer). Each program's rows pair dim d with d + D/2 of one head (mma_tile's row map); the epilogue
rounds them as the plain GEMV stores them, then rotates them with rope_qkv's arithmetic in the FMA form the
rope_qkv kernel compiles to on the GPU (_w4a16_gemv_epilogue.py, EPI 3). Needs the "mma" kernel (G = 128) with
one 16-row tile per warp and half its rows dividing D/2 (rope_ok). `_w4a16_gemv_rope_kernel` is the mma kernel's
entry with the RoPE arguments, so the plain kernel's signature (and compiled code) stays as it is.
"""

from __future__ import annotations

import torch

from . import pdl
from ._common import check_rope_qkv, check_w4_args
from ._triton import tl, triton
from .rope_qkv import rope_qkv_ref
from .w4a16_gemv import default_config, launch_gemv, mma_ok, mma_tile, w4a16_gemv_ref


@triton.jit
def _w4a16_gemv_rope_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, q_ptr, ws_ptr, lock_ptr, res_ptr, g_ptr,
                            xg_ptr, pout_ptr, pin_ptr, NP_IN, norm_d, eps, M, N, stride_xm, stride_ym, K8, NG,
                            W_SPLIT, SPLIT_K, cos_ptr, sin_ptr, T, stride_ct, stride_st, H, HKV,
                            k_ptr, v_ptr, slot_ptr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                            k2_ptr, v2_ptr, slot2_ptr, stride_k2b, stride_k2h, stride_k2s, stride_v2b, stride_v2h,
                            stride_v2s, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, UNPACK: tl.constexpr,
                            S_PAIRS: tl.constexpr, FENCE: tl.constexpr, UPCAST_DOT: tl.constexpr,
                            BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, GPS: tl.constexpr,
                            EPI: tl.constexpr, PRENORM: tl.constexpr, NPB: tl.constexpr, WRAP: tl.constexpr,
                            TRIGGER: tl.constexpr, PDL: tl.constexpr, ROPE_D: tl.constexpr, SECOND: tl.constexpr):
    # The mma kernel with the RoPE epilogue (EPI 3; module docstring). q_ptr takes y's place.
    pdl.wait(PDL)
    if TRIGGER == 0:
        pdl.launch_dependents(PDL)
    rope = ((cos_ptr, sin_ptr, T, stride_ct, stride_st, H, HKV),
            (k_ptr, v_ptr, slot_ptr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs),
            (k2_ptr, v2_ptr, slot2_ptr, stride_k2b, stride_k2h, stride_k2s, stride_v2b, stride_v2h, stride_v2s))
    mma_tile(tl.program_id(0), tl.program_id(1), x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, q_ptr, ws_ptr, lock_ptr,
             res_ptr, g_ptr, xg_ptr, pout_ptr, pin_ptr, NP_IN, norm_d, eps,
             M, N, stride_xm, stride_ym, K8, NG, W_SPLIT, SPLIT_K, BLOCK_M, HAS_BIAS, UNPACK, S_PAIRS, FENCE,
             UPCAST_DOT, BLOCK_N, SPLIT, STAGES, GPS, EPI, PRENORM, NPB, WRAP, TRIGGER, PDL, rope, ROPE_D, SECOND)
    if TRIGGER == 2:
        pdl.launch_dependents(PDL)


def w4a16_gemv_rope(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slots: torch.Tensor, n_heads: int, n_kv_heads: int, *,
                    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    prenorm: tuple[torch.Tensor, float] | None = None, config: dict | None = None,
                    unpack: int | None = None, kernel: str = "auto", pdl: bool = True) -> torch.Tensor:
    """-> rotated q (B, H, T, D) contiguous; rotated k and raw v go to k_cache, v_cache at slots and to
    second = (k2, v2, slots2) when given (module docstring). prenorm, config, unpack, kernel, pdl as in w4a16_gemv."""
    M, N, K, G = check_w4_args(x, qweight, scales, zeros, bias)
    T = cos.shape[0] if cos.dim() == 2 else 0
    if T == 0 or M % T:
        raise ValueError(f"w4a16_gemv_rope: x's {M} rows are not B x T tokens with T = {T} rows of cos")
    qkv = x.new_empty(1).expand(M // T, T, N)  # shape, dtype and device of the GEMV's output for rope_qkv's checks
    D = check_rope_qkv(qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads)
    if second is not None:
        check_rope_qkv(qkv, cos, sin, *second, n_heads, n_kv_heads)
    cfg = config if config is not None else default_config(x, M, N, K, G, kernel)
    if not rope_ok(N, K, G, cfg, D):
        raise ValueError(f"w4a16_gemv_rope needs the mma kernel (G=128) and half its BLOCK_N dividing D/2={D // 2}; "
                         f"got G={G}, config {cfg}")
    q = torch.empty(M // T, n_heads, T, D, dtype=x.dtype, device=x.device)
    # The entry's arguments after the plain kernel's: tables, then both cache pairs (the first again for none).
    caches = [a for k, v, sl in ((k_cache, v_cache, slots), second or (k_cache, v_cache, slots))
              for a in (k, v, sl, *k.stride()[:3], *v.stride()[:3])]
    rope_args = (cos, sin, T, cos.stride(0), sin.stride(0), n_heads, n_kv_heads, *caches)
    launch_gemv(x, qweight, scales, zeros, bias, q, cfg, unpack, prenorm, pdl=pdl,
                rope=(_w4a16_gemv_rope_kernel, rope_args, dict(ROPE_D=D, SECOND=second is not None)))
    return q


def rope_ok(N: int, K: int, G: int, config: dict, head_dim: int) -> bool:
    """Whether the qkv GEMV can end in RoPE and the cache write under `config`: the mma kernel with one 16-row tile
    per warp (BLOCK_N = 16 num_warps) and BLOCK_N / 2 dividing D / 2, so a program's rows pair d with d + D / 2. Two
    tiles per warp are refused: the halves reach RoPE through different layout conversions, and a few q values came
    out 1 ulp away from GEMV + rope_qkv even with RoPE's FMAs spelled out."""
    if config.get("kernel", "fma") != "mma" or not mma_ok(K, G) or head_dim % 2 or N % head_dim:
        return False
    block_n = config.get("BLOCK_N", 16 * config["num_warps"])
    return block_n == 16 * config["num_warps"] and (head_dim // 2) % (block_n // 2) == 0


def w4a16_gemv_rope_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: torch.Tensor, n_heads: int, n_kv_heads: int, *,
                        second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        prenorm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Reference of w4a16_gemv_rope: w4a16_gemv_ref (rounded to x's dtype) as qkv (B, T, N), then rope_qkv_ref
    (its q's values are w4a16_gemv_rope's)."""
    T = cos.shape[0]
    qkv = w4a16_gemv_ref(x, qweight, scales, zeros, bias, prenorm).view(x.shape[0] // T, T, -1)
    return rope_qkv_ref(qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads, second=second)
