"""LayerNorm fused with per-token int8 quantization: the input of q/k/v (wqkv) and fc1 in W8A8 ViTs.

Per row x (K,), all in fp32:  mu = mean(x);  var = mean((x - mu)^2);  rstd = 1 / sqrt(var + eps);
y = (x - mu) * rstd * w + b;  then y is quantized per token exactly as quant_per_token's `_quant_rows`
(amax = max(max|y|, 1e-5), scale = amax / 127, q = round_half_even(y * 127 / amax), clamp +-127).
y never touches memory and is never rounded to fp16, so the int8 values equal the reference's except
where y * 127 / amax lies within float error of a .5 tie. x: (..., K) fp16/bf16/fp32; w, b: (K,) any
float dtype. Out: q (..., K) int8, scale (...,) fp32. Each program holds ROWS whole rows in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_per_token import _launch_rows, _quant_rows, quantize_rows_ref


@triton.jit
def _layer_norm_quant_kernel(x_ptr, w_ptr, b_ptr, q_ptr, scale_ptr, M, K, stride_xm, stride_qm, eps,
                             ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (offs[None, :] < K)  # (ROWS, BLOCK_K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / K
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / K
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    y = tl.where(mask, xc * rstd[:, None] * w[None, :] + b[None, :], 0.0)  # masked lanes 0 for the row max
    _quant_rows(y, mask, q_ptr + rows[:, None] * stride_qm + offs[None, :], scale_ptr + rows, rows < M)


def layer_norm_quant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     meta: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) -> (q (..., K) int8, scale (...,) fp32) of LayerNorm(x; weight, bias, eps).
    `meta` overrides the launch shape (ROWS, num_warps; quant_per_token._row_meta)."""
    K = x.shape[-1]
    if weight.shape != (K,) or bias.shape != (K,):
        raise ValueError(f"layer_norm_quant: weight and bias must be ({K},), got {tuple(weight.shape)}, {tuple(bias.shape)}")
    x2, q, scale, meta = _launch_rows(x, "layer_norm_quant", meta)
    M = x2.shape[0]
    if M:
        _layer_norm_quant_kernel[(triton.cdiv(M, meta["ROWS"]),)](
            x2, weight.contiguous(), bias.contiguous(), q, scale, M, K, x2.stride(0), q.stride(0), float(eps), **meta)
    return q.view(x.shape), scale.view(x.shape[:-1])


def layer_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch reference (the CPU path): the kernel's fp32 math, then the shared quantizer."""
    xf = x.float()
    xc = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    return quantize_rows_ref(xc * rstd * weight.float() + bias.float())
