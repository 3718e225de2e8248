"""Per-token dynamic int8 quantization, (M, K) float -> (M, K) int8 + (M,) fp32 scales.

Per row (token), in fp32:  amax = max(max|x|, 1e-5);  scale = amax / 127;
q = clamp(round_half_even(x * (127 / amax)), -127, 127)   (127 / amax correctly rounded, like torch).
So q * scale ~= x with |error| <= scale / 2, and the row's largest |x| maps to +-127 (symmetric: -128 is never
produced). Rounding is half-to-even, i.e. torch.round; `row_scales` + `store_q` (_common.py) are the shared device
functions that the fused LayerNorm+quant and GELU+quant kernels end with too, so every producer of int8 activations
rounds identically. x: fp16/bf16/fp32, last dim contiguous. Used for the input of the attention output projection
(wo); each program holds whole rows in registers (K <= ROW_MAX_K = 16384), as a power-of-two head plus a tail block
(`row_block`). K is a compile-time constant (a few widths per model).
"""

from __future__ import annotations

import torch

from ._common import launch_rows, quantize_rows_ref, rmax_abs, row_block, row_scales, store_q
from ._triton import tl, triton


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, scale_ptr, M, stride_xm, stride_qm, K: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    # A row is a power-of-two head of BLOCK_K columns plus a tail block (BLOCK_T > 0) when K is not a power of two
    # (1152 = 1024 + 128): no lanes idle on padding (the row kernels are instruction-bound, docs/perf_notes.md).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    x, mask, offs = row_block(x_ptr, rows, stride_xm, M, K, 0, BLOCK_K)
    amax = rmax_abs(x, ROWS)  # (ROWS,), a scalar when ROWS == 1
    if BLOCK_T > 0:
        xt, mask_t, offs_t = row_block(x_ptr, rows, stride_xm, M, K, BLOCK_K, BLOCK_T)
        amax = tl.maximum(amax, rmax_abs(xt, ROWS))
    inv, scale = row_scales(amax)
    store_q(x, mask, offs, rows, q_ptr, stride_qm, inv, ROWS)
    if BLOCK_T > 0:
        store_q(xt, mask_t, offs_t, rows, q_ptr, stride_qm, inv, ROWS)
    tl.store(scale_ptr + rows, scale, mask=rows < M)


def quant_per_token(x: torch.Tensor, meta: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float -> (q (..., K) int8, scale (...,) fp32), one scale per row."""
    x2, q, scale, meta = launch_rows(x, "quant_per_token", meta)
    M = x2.shape[0]
    if M:
        _quant_per_token_kernel[(triton.cdiv(M, meta["ROWS"]),)](x2, q, scale, M, x2.stride(0), q.stride(0),
                                                                 K=x2.shape[1], **meta)
    return q.view(x.shape), scale.view(x.shape[:-1])


def quant_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch reference of `quant_per_token` (the CPU path)."""
    return quantize_rows_ref(x.float())
