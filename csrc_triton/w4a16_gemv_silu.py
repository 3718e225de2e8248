"""The W4 decode GEMV of the fused gate/up projection with SwiGLU in its epilogue: (M, K) -> (M, F).

    y = silu(x @ W_gate^T) * (x @ W_up^T),   qweight = [gate; up] (2F, K) (the checkpoint's w13)

bit for bit the plain GEMV (w4a16_gemv.py, same config) followed by silu_mul.py: each program computes gate rows j
and up rows F + j of the same j (mma_tile's row map), rounds both as the plain GEMV stores them, and applies
silu_mul_math before its one store, so the (M, 2F) intermediate never touches memory. x (M, K) fp16/bf16, M <= 8;
the packed W4 weight as in w4a16_gemv.py; no bias. Needs the "mma" kernel (G = 128) with F whole half-tiles of its
rows (silu_ok); w4a16_gemv's launch with epilogue EPI 2, no kernel entry of its own. PDL trigger: after the K loop
(w4a16_gemv.SILU_TRIGGER). Graph-capturable as w4a16_gemv.
"""

from __future__ import annotations

import torch

from ._common import check_w4_args
from .silu_mul import silu_mul_ref
from .w4a16_gemv import default_config, launch_gemv, mma_ok, w4a16_gemv_ref


def w4a16_gemv_silu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *,
                    config: dict | None = None, unpack: int | None = None,
                    prenorm: tuple[torch.Tensor, float] | None = None, kernel: str = "auto",
                    pdl: bool = True) -> torch.Tensor:
    """qweight [gate; up] (2F, K) -> (M, F) silu(x W_gate^T) * (x W_up^T) (module docstring; silu_ok says when).
    config, unpack, prenorm, kernel, pdl as in w4a16_gemv."""
    M, N, K, G = check_w4_args(x, qweight, scales, zeros, None)
    cfg = config if config is not None else default_config(x, M, N, K, G, kernel)
    if not silu_ok(N, K, G, cfg):
        raise ValueError(f"w4a16_gemv_silu needs the mma kernel (G=128) and F={N // 2} a multiple of half its "
                         f"BLOCK_N; got G={G}, config {cfg}")
    y, = launch_gemv(x, qweight, scales, zeros, None, torch.empty(M, N // 2, dtype=x.dtype, device=x.device), cfg,
                     unpack, prenorm, silu=True, pdl=pdl)
    return y


def silu_ok(N: int, K: int, G: int, config: dict) -> bool:
    """Whether the gate/up GEMV can end in SwiGLU (w4a16_gemv_silu) under `config`: the mma kernel, N even,
    and F = N / 2 whole half-tiles (so a program's gate and up rows pair up exactly)."""
    if config.get("kernel", "fma") != "mma" or not mma_ok(K, G) or N % 2:
        return False
    half = config.get("BLOCK_N", 16 * config["num_warps"]) // 2
    return (N // 2) % half == 0


def w4a16_gemv_silu_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        prenorm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Reference of w4a16_gemv_silu: w4a16_gemv_ref (rounded to x's dtype), then silu_mul_ref (F.silu, then the
    product, each rounded to the dtype)."""
    return silu_mul_ref(w4a16_gemv_ref(x, qweight, scales, zeros, None, prenorm))
