"""The single seam between the model code and the kernels.

Every attention, norm and activation of the models goes through a function here. On CUDA these
dispatch to `csrc_triton` kernels as they land (later issues); everywhere else, and until then, the
plain PyTorch references below run. Only this module may import `csrc_triton`.

Numerics follow the HuggingFace reference models the checkpoints were trained with: RMSNorm in fp32
with the weight applied after casting back, attention softmax by SDPA.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, (..., D) -> (..., D). Statistics in fp32 (or wider) like HF LlamaRMSNorm."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim, (..., D) -> (..., D)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The GELU variants of the supported encoders: "gelu" (erf), "gelu_tanh", "quick_gelu"."""
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unknown activation {kind!r}")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused gate/up projection: (..., 2F) -> (..., F) = silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF Llama layout: dim d pairs with d + D/2).

    x: (B, H, T, D); cos, sin: (T, D) or (B, 1, T, D), in x's dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              q_start: int = 0) -> torch.Tensor:
    """Softmax attention with GQA, (B, H, T, D) x (B, Hkv, S, D) -> (B, H, T, D).

    `causal`: query row t sits at absolute position q_start + t and sees keys 0..q_start + t
    (S = q_start + T when prefilling against a cache). Non-causal (vision) sees all S keys.
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:  # GQA: each KV head serves n_rep consecutive query heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    T, S = q.shape[2], k.shape[2]
    if not causal:
        return F.scaled_dot_product_attention(q, k, v)
    if q_start == 0 and T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    q_pos = torch.arange(q_start, q_start + T, device=q.device)
    mask = torch.arange(S, device=q.device)[None, :] <= q_pos[:, None]  # (T, S) True = attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
