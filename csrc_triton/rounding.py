"""Rounding fp32 values to fp16/bf16 precision exactly as PyTorch does, on the GPU and under the interpreter.

PyTorch's fp16/bf16 elementwise ops compute in fp32 and round each result once to nearest-even. The
fused decoder kernels (add_rms_norm, rope_qkv, silu_mul) reproduce PyTorch's sequence of ops bit for
bit by calling `round_to` wherever PyTorch stores an fp16/bf16 intermediate, and before each store
(the store's own cast is then exact). On the GPU a cast does it (cvt.rn). The interpreter's fp32 ->
bf16 cast does not round to nearest-even (triton 3.6), so there the rounding is done on the bits:
adding 0x7FFF plus the lowest kept bit, then clearing the low 16 bits, is round-half-to-even to
bf16's 8-bit significand (overflow to inf included; NaN payloads aside).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """fp32 `v` rounded to `dtype` (tl.float16 / tl.bfloat16 / tl.float32), returned as fp32."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)
