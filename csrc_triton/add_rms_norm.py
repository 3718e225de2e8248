"""Residual add fused with RMSNorm (HF LlamaRMSNorm numerics): one read of x and residual per layer.

Per row (D,), with every rounding where PyTorch's fp16/bf16 ops round (csrc_triton/rounding.py):
    s      = residual + x                                  (fp32 sum, rounded to the dtype: torch's add)
    y      = (s * rsqrt(mean(s^2) + eps)).to(dtype)        (statistics in fp32)
    normed = weight * y                                    (fp16 x fp16 is exact in fp32: rounded once)
-> (normed, s). The cast to the dtype comes BEFORE the weight, as in HF and ops.rms_norm. `s` equals PyTorch's
`residual + x` bit for bit; `normed` differs from ops.rms_norm only through the order of the fp32 sum of squares
and rsqrt's last bits (rarely one ulp of y). residual=None: plain RMSNorm of x (s is x itself, nothing stored).
In the decoder, layer i's MLP residual add is fused with layer i+1's attention norm (tinyvila/text.py).
x, residual: (..., D) fp16/bf16, same shape and dtype, last dim contiguous; weight (D,) same dtype; D <= 32768 (a
row lives in registers). One program per row; graph-capturable (no host sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import pdl
from ._triton import tl, triton
from .launch import Launch, Plans, tensor_key
from .pdl import options as pdl_options
from .rounding import round_to

MAX_D = 32768


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, D, stride_x, stride_r, stride_y, stride_s, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # a decode-step kernel: may start early, reads nothing before the previous one is done
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    dtype = y_ptr.dtype.element_ty
    s = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = round_to(s + r, dtype)
        tl.store(s_ptr + row * stride_s + offs, s.to(dtype), mask=mask)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / D + eps)  # masked lanes hold 0 and add nothing
    y = round_to(s * inv, dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, round_to(w * y, dtype).to(dtype), mask=mask)


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"add_rms_norm: x must be fp16 or bf16, got {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    D = x.shape[-1]
    if weight.shape != (D,) or weight.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: weight must be ({D},) {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if not 0 < D <= MAX_D:
        raise ValueError(f"add_rms_norm: last dim {D} must be in 1..{MAX_D}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])  # (M, D); a view for the usual contiguous activations
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _Plan(NamedTuple):
    """What one distinct call launches (built by _plan): the launch, None when there are no rows."""
    new_sum: bool  # a residual was given: the sum goes to a new (M, D) tensor
    rows_x: bool  # x needs _rows (not contiguous): otherwise x itself is passed, the same memory as its (M, D) view
    rows_r: bool  # the same for the residual
    launch: Launch | None


# Plans per distinct call (shapes, strides, dtypes, device, eps, options, the pdl flag): dispatch paid once (launch.py).
_PLANS = Plans()


def _plan(x, residual, weight, eps, num_warps, pdl) -> _Plan:
    _check(x, residual, weight)
    D = x.shape[-1]
    x2 = _rows(x)  # the same strides on every call of this plan (reshape is deterministic in shape/strides)
    r2 = x2 if residual is None else _rows(residual)
    M = x2.shape[0]
    if not M:
        return _Plan(residual is not None, False, False, None)
    block = triton.next_power_of_2(D)
    # One row per program: at decode M = 1, so the row's latency chain (load, reduce, store) is
    # the whole cost; 8 warps keep 16 fp16 per thread at D = 4096.
    warps = num_warps or (8 if block >= 4096 else 4)
    stride_s = x2.stride(0) if residual is None else D  # s is x2 itself, or a new (M, D) tensor
    launch = Launch(_add_rms_norm_kernel, (M,), (D, x2.stride(0), r2.stride(0), D, stride_s, float(eps)),
                    dict(HAS_RESIDUAL=residual is not None, BLOCK_D=block, num_warps=warps, **pdl_options(x.device, pdl)))
    return _Plan(residual is not None, not x.is_contiguous(), residual is not None and not residual.is_contiguous(),
                 launch)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 num_warps: int | None = None, *, pdl: bool = True, direct: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual (..., D) -> (normed (..., D), residual + x (..., D)); residual None -> (rms_norm(x), x).
    `num_warps` overrides the launch (benchmarks). pdl: programmatic dependent launch where the device has it
    (csrc_triton/pdl.py); direct: after the first launch, skip Triton's dispatch (csrc_triton/launch.py)."""
    key = (tensor_key(x), tensor_key(residual), tensor_key(weight), eps, num_warps, pdl)
    plan = _PLANS.get_or_build(key, lambda: _plan(x, residual, weight, eps, num_warps, pdl))
    x2 = _rows(x) if plan.rows_x else x
    # Outputs in x's shape, contiguous: the memory of an (M, D) tensor, without a view per call.
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if plan.new_sum else x2
    if plan.launch is not None:
        plan.launch(x2, x2 if residual is None else _rows(residual) if plan.rows_r else residual, weight, y, s,
                    direct=direct)
    return y, (x if residual is None else s)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch (the CPU path): exactly `residual + x` then ops.rms_norm's expressions, any dtype."""
    s = x if residual is None else residual + x
    sf = s.to(torch.promote_types(s.dtype, torch.float32))
    sf = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * sf.to(s.dtype), s
