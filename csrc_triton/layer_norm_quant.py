"""LayerNorm fused with per-token int8 quantization: the input of q/k/v (wqkv) and fc1 in W8A8 ViTs.

Per row x (K,), all in fp32:  mu = mean(x);  var = mean((x - mu)^2);  rstd = 1 / sqrt(var + eps);
y = (x - mu) * rstd * w + b;  then y is quantized per token exactly as quant_per_token's kernel
(amax = max(max|y|, 1e-5), scale = amax / 127, q = round_half_even(y * 127 / amax), clamp +-127).
y never touches memory and is never rounded to fp16, so the int8 values equal the reference's except
where y * 127 / amax lies within float error of a .5 tie. x: (..., K) fp16/bf16/fp32; w, b: (K,) any
float dtype. Out: q (..., K) int8, scale (...,) fp32. Each program holds ROWS whole rows in registers
(a power-of-two head + a tail block, as quant_per_token). K is a compile-time constant.
"""

from __future__ import annotations

import torch

from ._common import launch_rows, per_row, quantize_rows_ref, rmax_abs, row_block, row_scales, rsum, store_q
from ._triton import tl, triton


@triton.jit
def _affine(xc, rstd, w_ptr, b_ptr, offs, K: tl.constexpr, ROWS: tl.constexpr):
    """(x - mu) * rstd * w + b of one column block (ROWS, BLOCK) at columns `offs` (rstd per row, per_row).
    w and b are loaded as (1, BLOCK) tiles, i.e. in a 2-D tile's layout like x: loaded 1-D and broadcast, the
    tail block's (128 columns at K = 1152) reached it through ~100 shuffles and selects (sm_90a)."""
    cols = offs[None, :]
    w = tl.load(w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    return xc * per_row(rstd, ROWS) * w + b


@triton.jit
def _layer_norm_quant_kernel(x_ptr, w_ptr, b_ptr, q_ptr, scale_ptr, M, stride_xm, stride_qm, eps,
                             K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    # Row = head block of BLOCK_K columns + tail block of BLOCK_T (quant_per_token's layout): every
    # statistic is the sum of the two blocks' partials, a scalar when ROWS == 1 (the GPU launch: see rsum).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    x, mask, offs = row_block(x_ptr, rows, stride_xm, M, K, 0, BLOCK_K)
    total = rsum(x, ROWS)
    if BLOCK_T > 0:
        xt, mask_t, offs_t = row_block(x_ptr, rows, stride_xm, M, K, BLOCK_K, BLOCK_T)
        total += rsum(xt, ROWS)
    mean = total / K
    xc = x - per_row(mean, ROWS)
    if BLOCK_K > K:  # one padded block (SPLIT=False): padding lanes must add 0 to the variance
        xc = tl.where(mask, xc, 0.0)
    var = rsum(xc * xc, ROWS)
    if BLOCK_T > 0:
        xct = tl.where(mask_t, xt - per_row(mean, ROWS), 0.0)
        var += rsum(xct * xct, ROWS)
    rstd = 1.0 / tl.sqrt(var / K + eps)
    y = _affine(xc, rstd, w_ptr, b_ptr, offs, K, ROWS)
    amax = rmax_abs(y, ROWS)
    if BLOCK_T > 0:
        yt = tl.where(mask_t, _affine(xct, rstd, w_ptr, b_ptr, offs_t, K, ROWS), 0.0)  # padding lanes 0 for the max
        amax = tl.maximum(amax, rmax_abs(yt, ROWS))
    inv, scale = row_scales(amax)
    store_q(y, mask, offs, rows, q_ptr, stride_qm, inv, ROWS)
    if BLOCK_T > 0:
        store_q(yt, mask_t, offs_t, rows, q_ptr, stride_qm, inv, ROWS)
    tl.store(scale_ptr + rows, scale, mask=rows < M)


def layer_norm_quant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     meta: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) -> (q (..., K) int8, scale (...,) fp32) of LayerNorm(x; weight, bias, eps).
    `meta` overrides the launch shape (ROWS, num_warps; _common.row_meta)."""
    K = x.shape[-1]
    if weight.shape != (K,) or bias.shape != (K,):
        raise ValueError(f"layer_norm_quant: weight and bias must be ({K},), got {tuple(weight.shape)}, {tuple(bias.shape)}")
    x2, q, scale, meta = launch_rows(x, "layer_norm_quant", meta)
    M = x2.shape[0]
    if M:
        _layer_norm_quant_kernel[(triton.cdiv(M, meta["ROWS"]),)](
            x2, weight.contiguous(), bias.contiguous(), q, scale, M, x2.stride(0), q.stride(0), float(eps), K=K, **meta)
    return q.view(x.shape), scale.view(x.shape[:-1])


def layer_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch reference (the CPU path): the kernel's fp32 math, then the shared quantizer."""
    xf = x.float()
    xc = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    return quantize_rows_ref(xc * rstd * weight.float() + bias.float())
