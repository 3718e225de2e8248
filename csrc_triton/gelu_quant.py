"""GELU fused with per-token int8 quantization: the input of fc2 in W8A8 ViTs.

Per row h (K,), in fp32: g = GELU(h) with KIND "gelu" (exact: 0.5 h (1 + erf(h / sqrt 2))), "gelu_tanh"
(0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3)))) or "quick_gelu" (h * sigmoid(1.702 h)); then quantized per token
as quant_per_token's kernel (scale = amax / 127, round half to even, clamp +-127). The tanh and quick forms are
computed as h / (1 + 2**t) (0.5 (1 + tanh u) = sigmoid(2u)), with MUFU ex2 and rcp on the GPU (~2 and ~1 ulp; no
libdevice, which the interpreter lacks): within a few fp32 ulps of torch's GELU, so int8 values differ from the
reference only at near-ties. The kernels are instruction-bound, so the per-element work is kept minimal.
h: (..., K) fp16/bf16/fp32 (fc1's output). Out: q (..., K) int8, scale (...,) fp32. Whole rows per program (head +
tail blocks, as quant_per_token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import INTERPRET_JIT, launch_rows, quantize_rows_ref, rmax_abs, row_block, row_scales, store_q
from ._triton import tl, triton

KINDS = {"gelu": 0, "gelu_tanh": 1, "quick_gelu": 2}
_LOG2E = 1.4426950408889634
# exp2 arguments: -2 log2(e) sqrt(2/pi) (h + 0.044715 h^3) = h (_TANH_T1 + _TANH_T3 h^2); -1.702 log2(e) h.
_TANH_T1 = tl.constexpr(-2.0 * _LOG2E * 0.7978845608028654)
_TANH_T3 = tl.constexpr(-2.0 * _LOG2E * 0.7978845608028654 * 0.044715)
_QUICK_T = tl.constexpr(-1.702 * _LOG2E)


@triton.jit
def _ex2(x):
    """2**x of fp32 x: MUFU ex2 (ex2.approx.ftz, ~2 ulp) on the GPU; tl.exp2 lowers to the same MUFU
    wrapped in denormal handling (3 more instructions) that these callers do not need. The interpreter
    clamps x at 127 only to keep numpy's overflow warnings quiet (2**127 + 1 or inf: g rounds to int8 0 alike)."""
    if INTERPRET_JIT:
        return tl.exp2(tl.minimum(x, 127.0))
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _rcp(x):
    """1 / x of fp32 x >= 1: MUFU rcp (rcp.approx.ftz, ~1 ulp) on the GPU; `/` (div.full.f32) wraps the
    same MUFU in a range check and operand scaling (3 more instructions). rcp(inf) = 0; x > 2**126 gives 0
    (ftz), where g = h / x would round to int8 0 anyway."""
    if INTERPRET_JIT:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _gelu(h, KIND: tl.constexpr):
    """GELU_KIND of fp32 values (KINDS numbering)."""
    if KIND == 0:
        g = h * (0.5 + 0.5 * tl.math.erf(h * 0.7071067811865476))  # == 0.5 h (1 + erf): scaling by 2 is exact
    else:
        # 0.5 h (1 + tanh(u)) = h sigmoid(2u) = h / (1 + 2**t), t = -2 log2(e) u: one exp2 and one
        # reciprocal, no cancellation in 1 + tanh. For quick_gelu t = -1.702 log2(e) h. No clamps: a
        # large t gives 2**t = inf, rcp(inf) = 0 and g = h * 0 = -0 (h finite); 2**t underflowing to 0
        # gives g = h exactly.
        if KIND == 1:
            t = h * (_TANH_T1 + _TANH_T3 * (h * h))  # t = h (T1 + T3 h^2), an FMUL, FFMA, FMUL
        else:
            t = h * _QUICK_T
        g = h * _rcp(1.0 + _ex2(t))
    return g


@triton.jit
def _gelu_quant_kernel(h_ptr, q_ptr, scale_ptr, M, stride_hm, stride_qm, K: tl.constexpr, KIND: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    # Row = head block + tail block, as quant_per_token; GELU(0) = 0, so padding lanes stay 0.
    # ROWS == 1 (the GPU launch) reduces to scalars: per-row maxima carry the two blocks' different layouts, and
    # to combine them Triton moved the head's whole tile into the tail's layout, computing its GELU twice.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    h, mask, offs = row_block(h_ptr, rows, stride_hm, M, K, 0, BLOCK_K)
    g = _gelu(h, KIND)
    amax = rmax_abs(g, ROWS)
    if BLOCK_T > 0:
        ht, mask_t, offs_t = row_block(h_ptr, rows, stride_hm, M, K, BLOCK_K, BLOCK_T)
        gt = _gelu(ht, KIND)
        amax = tl.maximum(amax, rmax_abs(gt, ROWS))
    inv, scale = row_scales(amax)
    store_q(g, mask, offs, rows, q_ptr, stride_qm, inv, ROWS)
    if BLOCK_T > 0:
        store_q(gt, mask_t, offs_t, rows, q_ptr, stride_qm, inv, ROWS)
    tl.store(scale_ptr + rows, scale, mask=rows < M)


def gelu_quant(h: torch.Tensor, kind: str, meta: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h (..., K) -> (q (..., K) int8, scale (...,) fp32) of GELU_kind(h).
    `meta` overrides the launch shape (ROWS, num_warps; _common.row_meta)."""
    if kind not in KINDS:
        raise ValueError(f"gelu_quant: unknown activation {kind!r}; known: {', '.join(KINDS)}")
    h2, q, scale, meta = launch_rows(h, "gelu_quant", meta)
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
