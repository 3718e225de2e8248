"""SwiGLU on the fused gate/up projection: (..., 2F) -> (..., F) = silu(gate) * up, one launch.

gate_up holds [gate | up] per row (the checkpoint's fused w13, gate rows first). PyTorch's rounding, bit for bit on
the GPU:  a = (g / (1 + exp(-g))).to(dtype)  (F.silu: fp32 math, correctly rounded division, CUDA's expf),
out = (a * up).to(dtype)  (an fp16 x fp16 product is exact in fp32: rounded once, as torch's mul). On the GPU the
kernel uses libdevice's expf and div_rn, the functions PyTorch's CUDA silu compiles to (tl.exp and `/` would be the
approximate ex2/div.full). Under the interpreter exp is numpy's, which may differ from PyTorch CPU's in the last
fp32 bit, so there an output can rarely be one ulp off. gate_up: (..., 2F) fp16/bf16, last dim contiguous.
Grid: (rows, column blocks); blocks shrink at decode (M = 1) so F = 14336 still spreads over ~100 programs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import pdl
from ._common import INTERPRET_JIT
from ._triton import libdevice, tl, triton
from .launch import Launch, Plans, tensor_key
from .pdl import options as pdl_options
from .rounding import round_to


@triton.jit
def silu_mul_math(g, up, dtype: tl.constexpr):
    """silu(g) * up with PyTorch's roundings (module docstring): fp32 g, up (values of `dtype`) -> fp32 values
    of `dtype`. Also the epilogue of the W4 GEMV's fused gate/up (csrc_triton/w4a16_gemv_silu.py, EPI 2)."""
    if INTERPRET_JIT:  # libdevice has no interpreter implementation
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)
    a = round_to(tl.math.div_rn(g, 1.0 + e), dtype)
    return round_to(a * up, dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, Fdim, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # a decode-step kernel: may start early, reads nothing before the previous one is done
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < Fdim
    dtype = y_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + Fdim + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, silu_mul_math(g, up, dtype).to(dtype), mask=mask)


def _block(M: int, Fdim: int, device: torch.device) -> int:
    """Column block: large for prefill (fewer, fuller programs), small enough at decode that the
    row spreads over ~100 programs (an H200 has 132 SMs)."""
    if device.type != "cuda":
        return min(4096, triton.next_power_of_2(Fdim))  # the interpreter's cost is per program
    return max(128, min(2048, triton.next_power_of_2(triton.cdiv(M * Fdim, 256)), triton.next_power_of_2(Fdim)))


def _rows(gate_up: torch.Tensor) -> torch.Tensor:
    x2 = gate_up.reshape(-1, gate_up.shape[-1])  # (M, 2F)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _Plan(NamedTuple):
    """What one distinct call launches (built by _plan): F and the launch, None when there are no rows."""
    F: int
    rows: bool  # gate_up needs _rows (not contiguous): otherwise it is passed itself, its (M, 2F) view's memory
    launch: Launch | None


# Plans per distinct call (shape, strides, dtype, device, options, the pdl flag): a prefill makes the
# same call every layer, so it pays Triton's dispatch only once (csrc_triton/launch.py).
_PLANS = Plans()


def _plan(gate_up, block, num_warps, pdl) -> _Plan:
    if gate_up.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"silu_mul: gate_up must be fp16 or bf16, got {gate_up.dtype}")
    W = gate_up.shape[-1]
    if W % 2 or W == 0:
        raise ValueError(f"silu_mul: last dim {W} must be even (gate and up halves)")
    Fdim = W // 2
    x2 = _rows(gate_up)  # the same strides on every call of this plan
    M = x2.shape[0]
    if not M:
        return _Plan(Fdim, False, None)
    block = block or _block(M, Fdim, gate_up.device)
    launch = Launch(_silu_mul_kernel, (M, triton.cdiv(Fdim, block)), (Fdim, x2.stride(0), Fdim),
                    dict(BLOCK=block, num_warps=num_warps, **pdl_options(gate_up.device, pdl)))
    return _Plan(Fdim, not gate_up.is_contiguous(), launch)


def silu_mul(gate_up: torch.Tensor, block: int | None = None, num_warps: int = 4, *, pdl: bool = True,
             direct: bool = True) -> torch.Tensor:
    """gate_up (..., 2F) -> silu(gate) * up (..., F). `block`, `num_warps` override the launch (benchmarks).
    pdl: programmatic dependent launch where the device has it (csrc_triton/pdl.py); direct: after the first
    launch, skip Triton's dispatch (csrc_triton/launch.py)."""
    key = (tensor_key(gate_up), block, num_warps, pdl)
    plan = _PLANS.get_or_build(key, lambda: _plan(gate_up, block, num_warps, pdl))
    x2 = _rows(gate_up) if plan.rows else gate_up
    # (..., F) contiguous: the memory of an (M, F) tensor, without a view per call.
    y = torch.empty((*gate_up.shape[:-1], plan.F), dtype=gate_up.dtype, device=gate_up.device)
    if plan.launch is not None:
        plan.launch(x2, y, direct=direct)
    return y


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch (the CPU path): F.silu in the dtype, then the product in the dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
