"""GELU fused with per-token int8 quantization: the input of fc2 in W8A8 ViTs.

Per row h (K,), in fp32: g = GELU(h) with KIND "gelu" (exact: 0.5 h (1 + erf(h / sqrt 2))),
"gelu_tanh" (0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3)))) or "quick_gelu" (h * sigmoid(1.702 h));
then quantized per token as quant_per_token's kernel (scale = amax / 127, round half to even,
clamp +-127). tanh is computed as 1 - 2 / (exp(2u) + 1) (no libdevice, which the interpreter lacks):
within a few fp32 ulps of torch's tanh, so int8 values differ from the reference only at near-ties.
h: (..., K) fp16/bf16/fp32 (fc1's output). Out: q (..., K) int8, scale (...,) fp32. Whole rows per program
(head + tail blocks, as quant_per_token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .quant_per_token import _launch_rows, _row_block, _row_scales, _store_q, quantize_rows_ref

KINDS = {"gelu": 0, "gelu_tanh": 1, "quick_gelu": 2}


@triton.jit
def _gelu(h, KIND: tl.constexpr):
    """GELU_KIND of fp32 values (KINDS numbering)."""
    if KIND == 0:
        g = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
    elif KIND == 1:
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        # tanh(u) = 1 - 2 / (exp(2u) + 1); |u| <= 20 already gives tanh = +-1 in fp32, and the clamp
        # keeps exp finite.
        t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.maximum(u, -20.0), 20.0)) + 1.0)
        g = 0.5 * h * (1.0 + t)
    else:
        g = h / (1.0 + tl.exp(tl.minimum(-1.702 * h, 80.0)))  # exp(80) is finite in fp32
    return g


@triton.jit
def _gelu_quant_kernel(h_ptr, q_ptr, scale_ptr, M, stride_hm, stride_qm, K: tl.constexpr, KIND: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    # Row = head block + tail block, as quant_per_token; GELU(0) = 0, so padding lanes stay 0.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    h, mask, offs = _row_block(h_ptr, rows, stride_hm, M, K, 0, BLOCK_K)
    g = _gelu(h, KIND)
    amax = tl.max(tl.abs(g), axis=1)
    if BLOCK_T > 0:
        ht, mask_t, offs_t = _row_block(h_ptr, rows, stride_hm, M, K, BLOCK_K, BLOCK_T)
        gt = _gelu(ht, KIND)
        amax = tl.maximum(amax, tl.max(tl.abs(gt), axis=1))
    inv, scale = _row_scales(amax)
    _store_q(g, mask, offs, rows, q_ptr, stride_qm, inv)
    if BLOCK_T > 0:
        _store_q(gt, mask_t, offs_t, rows, q_ptr, stride_qm, inv)
    tl.store(scale_ptr + rows, scale, mask=rows < M)


def gelu_quant(h: torch.Tensor, kind: str, meta: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h (..., K) -> (q (..., K) int8, scale (...,) fp32) of GELU_kind(h).
    `meta` overrides the launch shape (ROWS, num_warps; quant_per_token._row_meta)."""
    if kind not in KINDS:
        raise ValueError(f"gelu_quant: unknown activation {kind!r}; known: {', '.join(KINDS)}")
    h2, q, scale, meta = _launch_rows(h, "gelu_quant", meta)
    M = h2.shape[0]
    if M:
        _gelu_quant_kernel[(triton.cdiv(M, meta["ROWS"]),)](h2, q, scale, M, h2.stride(0), q.stride(0),
                                                            K=h2.shape[1], KIND=KINDS[kind], **meta)
    return q.view(h.shape), scale.view(h.shape[:-1])


def gelu_ref(hf: torch.Tensor, kind: str) -> torch.Tensor:
    """GELU_kind in plain PyTorch at the input's precision (fp32 for the kernels' semantics); also the
    unfused activation of the fp16 encoders (tinyvila.ops.gelu)."""
    if kind == "gelu":
        return F.gelu(hf)
    if kind == "gelu_tanh":
        return F.gelu(hf, approximate="tanh")
    if kind == "quick_gelu":
        return hf * torch.sigmoid(1.702 * hf)
    raise ValueError(f"unknown activation {kind!r}; known: {', '.join(KINDS)}")


def gelu_quant_ref(h: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch reference (the CPU path): GELU in fp32, then the shared quantizer."""
    return quantize_rows_ref(gelu_ref(h.float(), kind))
