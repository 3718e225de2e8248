"""The W4 decode GEMV with the residual stream's add and the next RMSNorm's share fused into its epilogue.

    y = x @ W^T + bias (the plain GEMV's output, rounded to the dtype)
    h = residual + y                    (fp32 sum rounded once: PyTorch's add, bit for bit)
    xg = gamma * h                      (rounded once)
    part[p, m] = sum over row block p's columns of h[m]^2   (fp32)

-> (h, xg, part): what a following w4a16_gemv(xg, ..., prenorm=(part, eps)) takes in place of rms_norm(h) * gamma,
so the RMSNorm between two decode GEMVs costs no launch of its own (the consumer scales its product by
rsqrt(mean(h^2) + eps)). x (M, K) fp16/bf16, M <= 8, and the packed W4 weight as in w4a16_gemv.py; residual (M, N)
and gamma (N,) contiguous in x's dtype; part is (row blocks, 8) fp32, column m for row m. Either GEMV kernel: it is
w4a16_gemv's launch with epilogue EPI 1 (_w4a16_gemv_epilogue.py), no kernel entry of its own. Graph-capturable.
"""

from __future__ import annotations

import torch

from .w4a16_gemv import launch_gemv, w4a16_gemv_ref


def w4a16_gemv_norm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bias: torch.Tensor | None, residual: torch.Tensor, gamma: torch.Tensor, *,
                    config: dict | None = None, unpack: int | None = None,
                    prenorm: tuple[torch.Tensor, float] | None = None, kernel: str = "auto", pdl: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (h, xg, part) as in the module docstring. config, unpack, prenorm, kernel, pdl as in w4a16_gemv."""
    M, N = x.shape[0], qweight.shape[0]
    if residual.shape != (M, N) or residual.dtype != x.dtype or residual.stride() != (N, 1):
        raise ValueError(f"residual must be a contiguous ({M}, {N}) {x.dtype} tensor, got {tuple(residual.shape)} "
                         f"{residual.dtype} strides {residual.stride()}")
    if gamma.shape != (N,) or gamma.dtype != x.dtype or gamma.stride(0) != 1:
        raise ValueError(f"gamma must be a contiguous ({N},) {x.dtype} tensor, got {tuple(gamma.shape)} {gamma.dtype}")
    return launch_gemv(x, qweight, scales, zeros, bias, None, config, unpack, prenorm, residual, gamma, kernel=kernel,
                       pdl=pdl)


def w4a16_gemv_norm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        bias: torch.Tensor | None, residual: torch.Tensor, gamma: torch.Tensor,
                        prenorm: tuple[torch.Tensor, float] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of w4a16_gemv_norm: y = w4a16_gemv_ref(...), h = residual + y, xg = gamma * h (each rounded
    once to the dtype), part (1, 8) fp32 with the rows' sums of h^2 in columns 0..M-1 (one block)."""
    y = w4a16_gemv_ref(x, qweight, scales, zeros, bias, prenorm)
    h = (residual.float() + y.float()).to(x.dtype)
    xg = (gamma.float() * h.float()).to(x.dtype)
    part = torch.zeros(1, 8, dtype=torch.float32, device=x.device)
    part[0, : x.shape[0]] = h.float().pow(2).sum(-1)
    return h, xg, part
