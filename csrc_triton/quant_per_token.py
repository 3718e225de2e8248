"""Per-token dynamic int8 quantization, (M, K) float -> (M, K) int8 + (M,) fp32 scales.

Per row (token), in fp32:  amax = max(max|x|, 1e-5);  scale = amax / 127;
q = clamp(round_half_even(x * (127 / amax)), -127, 127)   (127 / amax correctly rounded, like torch).
So q * scale ~= x with |error| <= scale / 2, and the row's largest |x| maps to +-127 (symmetric:
-128 is never produced). Rounding is half-to-even, i.e. torch.round; `_quant_rows` is the shared
device function that the fused LayerNorm+quant and GELU+quant kernels end with, so every producer of
int8 activations rounds identically. x: fp16/bf16/fp32, last dim contiguous. Used for the input of
the attention output projection (wo); each program holds whole rows in registers (K <= 16384).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 16384  # a row lives in registers; far above any ViT width (so400m MLP: 4304)


@triton.jit
def _round_half_even(v):
    """Exact round-half-to-even of fp32 values (|v| < 2**22) without libdevice: v - floor(v) is
    exact, and a tie goes to the even neighbour."""
    f = tl.floor(v)
    d = v - f
    odd = f - 2.0 * tl.floor(f * 0.5)  # 1.0 if f is odd, else 0.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))


@triton.jit
def _quant_rows(y, mask, q_ptrs, scale_ptrs, row_mask):
    """Quantizes fp32 rows `y` (ROWS, BLOCK_K) (masked lanes must hold 0) to int8 at `q_ptrs`
    (same shape) and stores each row's scale at `scale_ptrs` (ROWS,)."""
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-5)  # (ROWS,)
    inv = tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), amax)  # IEEE division, as torch does
    q = tl.minimum(tl.maximum(_round_half_even(y * inv[:, None]), -127.0), 127.0)
    tl.store(q_ptrs, q.to(tl.int8), mask=mask)
    tl.store(scale_ptrs, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), mask=row_mask)


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, scale_ptr, M, K, stride_xm, stride_qm,
                            ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (offs[None, :] < K)  # (ROWS, BLOCK_K)
    y = tl.load(x_ptr + rows[:, None] * stride_xm + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    _quant_rows(y, mask, q_ptr + rows[:, None] * stride_qm + offs[None, :], scale_ptr + rows, rows < M)


def _row_meta(K: int, device: torch.device) -> dict:
    """ROWS per program, BLOCK_K, num_warps of the row kernels."""
    block = triton.next_power_of_2(K)
    if device.type == "cuda":
        # One row per program and 4 warps: many small programs per SM hide the load -> reduce ->
        # store latency chain. Best of the H200 sweep for all three row kernels at 64 images, within
        # 12% of the best at 8 (docs/perf_notes.md); the old 4-row/16-warp programs were 1.1-1.8x slower.
        return dict(ROWS=1, BLOCK_K=block, num_warps=4 if block <= 8192 else 8)
    # The interpreter's cost is per program: ~8K elements a program keeps CPU tests fast.
    rows = max(1, min(64, 8192 // block))
    return dict(ROWS=rows, BLOCK_K=block, num_warps=min(16, max(1, rows * block // 512)))


def _launch_rows(x: torch.Tensor, name: str, meta: dict | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Shared checks/allocation of the row-wise quantizing launchers: x (..., K) -> x2 (M, K),
    q (M, K) int8, scale (M,) fp32, launch kwargs (`meta` overrides ROWS / num_warps; benchmarks)."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: x must be fp16, bf16 or fp32, got {x.dtype}")
    K = x.shape[-1]
    if not 0 < K <= MAX_K:
        raise ValueError(f"{name}: last dim {K} must be in 1..{MAX_K}")
    x2 = x.reshape(-1, K)  # (M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    return x2, q, scale, {**_row_meta(K, x.device), **(meta or {})}


def quant_per_token(x: torch.Tensor, meta: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float -> (q (..., K) int8, scale (...,) fp32), one scale per row."""
    x2, q, scale, meta = _launch_rows(x, "quant_per_token", meta)
    M = x2.shape[0]
    if M:
        _quant_per_token_kernel[(triton.cdiv(M, meta["ROWS"]),)](x2, q, scale, M, x2.shape[1], x2.stride(0),
                                                                 q.stride(0), **meta)
    return q.view(x.shape), scale.view(x.shape[:-1])


def quantize_rows_ref(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared per-row quantizer in plain PyTorch (fp32 in): the semantics of `_quant_rows`."""
    amax = y.abs().amax(-1).clamp(min=1e-5)  # (...,)
    inv = 127.0 / amax
    q = torch.round(y * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def quant_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch reference of `quant_per_token` (the CPU path)."""
    return quantize_rows_ref(x.float())
