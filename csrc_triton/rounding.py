"""Rounding fp32 values to fp16/bf16 precision exactly as PyTorch does, on the GPU and under the interpreter.

PyTorch's fp16/bf16 elementwise ops compute in fp32 and round each result once to nearest-even. The
fused decoder kernels (add_rms_norm, rope_qkv, silu_mul) reproduce PyTorch's sequence of ops bit for
bit by calling `round_to` wherever PyTorch stores an fp16/bf16 intermediate, and before each store
(the store's own cast is then exact). On the GPU a cast does it (cvt.rn). The interpreter's fp32 ->
bf16 cast does not round to nearest-even (triton 3.6), so there the rounding is done on the bits:
adding 0x7FFF plus the lowest kept bit, then clearing the low 16 bits, is round-half-to-even to
bf16's 8-bit significand (overflow to inf included; NaN payloads aside).
`round_fp32` applies `round_to` to a whole fp32 tensor (its test harness); `round_fp32_ref` is PyTorch's
cast there and back, the behaviour `round_to` must reproduce bit for bit.
"""

from __future__ import annotations

import torch

from ._common import INTERPRET_JIT
from ._triton import tl, triton


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """fp32 `v` rounded to `dtype` (tl.float16 / tl.bfloat16 / tl.float32), returned as fp32."""
    if INTERPRET_JIT and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, round_to(tl.load(x_ptr + offs, mask=mask), DTYPE), mask=mask)


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def round_fp32(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Contiguous fp32 x (any shape) -> fp32 values of x rounded to `dtype` (fp16, bf16 or fp32) by `round_to`."""
    if x.dtype != torch.float32 or dtype not in _TL:
        raise ValueError(f"round_fp32: x must be float32 and dtype one of {list(_TL)}, got {x.dtype}, {dtype}")
    x = x.contiguous()
    y = torch.empty_like(x)
    BLOCK = 1024
    _round_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), DTYPE=_TL[dtype], BLOCK=BLOCK)
    return y


def round_fp32_ref(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's rounding: fp32 -> dtype (round to nearest, ties to even) -> fp32."""
    return x.to(dtype).float()
