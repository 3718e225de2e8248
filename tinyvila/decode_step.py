"""The fused W4 decode chain: a decoder layer at decode row counts with its RMSNorms, SwiGLU, RoPE and the
KV-cache write inside the W4 GEMVs' launches. It must equal the plain path (text.Block.forward_residual);
read the two side by side:

    plain (text.Block.forward_residual)          fused (block_fused)
    h, r = attn_norm.add_norm(x, r)              rows = NormedRows: previous w2 launch left r and attn_norm's
                                                 weight * r and the row sums of r^2 (the first layer's norm
                                                 runs on its own)
    q = rope_qkv(wqkv(h)) + cache write          qkv GEMV scales its product by rsqrt(mean(r^2) + eps), ends
                                                 in RoPE and the cache write (ops.w4a16_linear_rope)
    o = attention                                the same attention (text.Attention.attend)
    h, r = mlp_norm.add_norm(wo(o), r)           wo GEMV adds into r and prepares mlp_norm (w4a16_linear_norm)
    a = silu_mul(w13(h))                         w13 GEMV applies the norm and ends in SwiGLU (w4a16_linear_silu)
    x = w2(a)                                    w2 GEMV adds into r and prepares the next layer's attn_norm

The residual stream's values are PyTorch's adds bit for bit; the normalised input is rounded once (weight * h)
instead of twice (norm(h), then * weight), so decode logits differ from the plain path by a few ulps
(Options.fused_norm_gemv = "off" restores the plain path; "on" runs this chain's PyTorch form on CPU, which
the tests compare). Which epilogues are fused is Options.fused_rope_gemv / fused_silu; each is bit-identical
to its separate launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from . import ops

if TYPE_CHECKING:
    from .text import Block, Pass, RMSNorm, TextModel


class NormedRows(NamedTuple):
    """The residual stream h (..., D) at an RMSNorm whose work is fused into the W4 GEMVs around it.

    part None: xg is the norm's output itself (norm(h) * weight), a plain input. Otherwise xg = weight * h
    (rounded once) and part (NP, 8) fp32 holds, in column m, row m's sum of h^2 over NP blocks of columns:
    the producing GEMV wrote them in its epilogue, and the consuming GEMV scales its product by
    rsqrt(mean(h^2) + eps)."""

    h: torch.Tensor
    xg: torch.Tensor
    part: torch.Tensor | None
    eps: float

    def norm(self) -> tuple[torch.Tensor, float] | None:
        """ops.w4a16_linear's norm= argument for xg."""
        return None if self.part is None else (self.part, self.eps)


def use_fused(model: TextModel, h: torch.Tensor) -> bool:
    """Whether this call takes the fused chain: decode row counts (Options.fused_norm_gemv: "auto" on CUDA
    fp16/bf16, "on" everywhere, "off" never), W4 linears throughout, norm weights in h's dtype."""
    mode = model.options.fused_norm_gemv
    rows = h.numel() // h.shape[-1] if h.dim() else 0
    if mode == "off" or not 0 < rows <= ops.GEMV_MAX_M:
        return False
    if mode == "auto" and not (h.is_cuda and h.dtype in (torch.float16, torch.bfloat16)):
        return False
    return all(_w4(b) and b.attn_norm.weight.dtype == h.dtype and b.mlp_norm.weight.dtype == h.dtype
               for b in model.layers)


def _w4(block: Block) -> bool:
    return all(hasattr(lin, "qweight") for lin in (block.attn.wqkv, block.attn.wo, block.mlp.w13, block.mlp.w2))


def layers_fused(model: TextModel, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: Pass
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer of `model` in the fused form -> (last MLP output, stream before it), as the plain loop
    returns them (the final norm then adds them)."""
    x: torch.Tensor | NormedRows = h
    for i, block in enumerate(model.layers):
        nxt = model.layers[i + 1].attn_norm if i + 1 < len(model.layers) else None
        x = block_fused(block, x, cos, sin, p, nxt)
    return x


def block_fused(block: Block, x: torch.Tensor | NormedRows, cos: torch.Tensor, sin: torch.Tensor, p: Pass,
                next_norm: RMSNorm | None) -> NormedRows | tuple[torch.Tensor, torch.Tensor]:
    """One layer: x is the stream from the previous layer's w2 (NormedRows) or a plain stream (the first
    layer: its norm runs on its own) -> NormedRows for the next layer, or (MLP output, stream) when
    next_norm is None."""
    attn, mlp, opts = block.attn, block.mlp, block.attn.options
    if not isinstance(x, NormedRows):
        xn, h = block.attn_norm.add_norm(x, None)
        x = NormedRows(h, xn, None, block.attn_norm.eps)
    o = attn.attend(_qkv_rope(attn, x, cos, sin, p), p)                              # (B, T, H * D)
    rows = _linear_norm_out(attn.wo, o, x.h, block.mlp_norm, opts)                  # stream + wo(o), normed
    act = ops.w4a16_linear_silu(rows.xg, *_w(mlp.w13), norm=rows.norm(), opts=opts)  # silu(gate) * up
    if next_norm is None:
        return ops.w4a16_linear(act, *_w(mlp.w2), opts=opts), rows.h
    return _linear_norm_out(mlp.w2, act, rows.h, next_norm, opts)


def _w(lin) -> tuple[torch.Tensor, ...]:
    """A W4A16Linear's packed weight, scales, zeros and bias, as the ops take them."""
    return lin.qweight, lin.scales, lin.zeros, lin.bias


def _qkv_rope(attn, rows: NormedRows, cos: torch.Tensor, sin: torch.Tensor, p: Pass) -> torch.Tensor:
    """wqkv applied to the normed rows, RoPE on q and k, k and v written to their targets -> q (B, H, T, D)."""
    k, v, slots, second = attn.write_targets(p, rows.xg.shape[1])
    return ops.w4a16_linear_rope(rows.xg, *_w(attn.wqkv), cos, sin, k, v, slots, attn.n_heads, attn.n_kv_heads,
                                 second=second, norm=rows.norm(), opts=attn.options)


def _linear_norm_out(lin, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, opts) -> NormedRows:
    """residual + lin(x), with `norm` prepared in the same launch (ops.w4a16_linear_norm)."""
    h, xg, part = ops.w4a16_linear_norm(x, *_w(lin), residual, norm.weight, norm.eps, opts=opts)
    return NormedRows(h, xg, part, float(norm.eps))
