"""Shared inputs and tolerance checks of the W4A16 kernel tests (test_w4a16_gemv*.py, test_w4a16_gemm.py,
test_w4a16_dequant.py, test_pdl.py).

Oracle: the exact product with the exact quantized weight, w = q * s + b in float64. The kernel's error
against it must be at most 2x that of PyTorch at the kernel's precision (F.linear on the weight
dequantized to x's dtype, what a dense fp16/bf16 checkpoint would compute) plus a floor of ~1 ulp of max|y|.
"""

import torch
import torch.nn.functional as F

from tinyvila.quant import dequantize_w4, quantize_w4, unpack_int4

FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3}  # relative to max|y|
# Llama-3-8B layer shapes (K, N): fused qkv, o, fused gate/up, down.
LLAMA3_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def make(M: int, N: int, K: int, G: int, dtype: torch.dtype, seed: int, bias: bool = False,
         device: str = "cpu") -> dict:
    """Fresh random x (M, K) and a W4 weight quantized from a random dense (N, K); optional bias."""
    g = torch.Generator(device).manual_seed(seed)  # drawn where they are used: real shapes stay fast
    w = torch.randn(N, K, generator=g, device=device) * 0.05 + torch.rand(N, 1, generator=g, device=device) * 0.02
    packed = quantize_w4(w, G, dtype=dtype)  # uneven row offsets above: zero points vary
    return {"x": torch.randn(M, K, generator=g, device=device).to(dtype), **packed,
            "bias": torch.randn(N, generator=g, device=device).to(dtype) if bias else None}


def exact(a: dict) -> torch.Tensor:
    """x @ (q * s + b)^T (+ bias) in float64: the value the quantized layer stands for."""
    q = unpack_int4(a["qweight"]).double()
    G = q.shape[1] // a["scales"].shape[1]
    w = q * a["scales"].double().repeat_interleave(G, 1) + a["zeros"].double().repeat_interleave(G, 1)
    y = a["x"].double() @ w.T
    return y if a["bias"] is None else y + a["bias"].double()


def assert_w4_close(y: torch.Tensor, a: dict) -> None:
    x = a["x"]
    assert y.shape == (x.shape[0], a["qweight"].shape[0]) and y.dtype == x.dtype
    assert torch.isfinite(y).all(), "non-finite output (unwritten poisoned elements?)"
    y64 = exact(a)
    lowp = F.linear(x, dequantize_w4(a["qweight"], a["scales"], a["zeros"], x.dtype), a["bias"])
    err = (y.double() - y64).abs().max().item()
    err_torch = (lowp.double() - y64).abs().max().item()
    bound = 2 * err_torch + FLOOR[x.dtype] * y64.abs().max().item()
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g} (torch at {x.dtype}: {err_torch:.3g})"


def poisoned(M: int, N: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full((M, N), float("nan"), dtype=dtype, device=device)


def assert_nearly_equal(x: torch.Tensor, ref: torch.Tensor, max_moved: float = 0.1) -> None:
    """Interpreter stand-in for torch.equal between two kernels that run the same code on differently laid out
    tiles: numpy's matmul (the interpreter's tl.dot) may sum a row in an order that depends on its place in the
    tile (OpenBLAS's AVX-512 kernels do), so a few fp32 sums move by an ulp, which can move a rounded output by
    more after cancellation (up to 3.4% of the outputs on one such host). At most `max_moved` of the outputs
    may differ (a wrong row map or epilogue moves nearly all), each by at most 2^-9 of the largest."""
    moved = (x != ref).float().mean().item()
    assert moved <= max_moved, f"{moved:.1%} of outputs differ (the same code on another tile layout)"
    torch.testing.assert_close(x.float(), ref.float(), rtol=0, atol=2 ** -9 * ref.float().abs().max().item())
