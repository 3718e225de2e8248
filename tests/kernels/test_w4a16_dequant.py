"""csrc_triton.w4a16_dequant (packed W4 -> dense fp16/bf16) against `_ref` and tinyvila.quant.dequantize_w4.

On CPU the kernel runs under TRITON_INTERPRET=1 at small odd shapes (groups 32/64/128, fp16/bf16);
on CUDA also at Llama-3-8B layer shapes (the GEMM's long-prompt path dequantizes these once per call).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _w4_check import LLAMA3_8B, make  # noqa: E402

from csrc_triton.w4a16_dequant import w4a16_dequant, w4a16_dequant_ref  # noqa: E402
from tinyvila.quant import dequantize_w4  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def check(a: dict) -> None:
    N, K = a["qweight"].shape[0], a["qweight"].shape[1] * 8
    out = torch.full((N, K), float("nan"), dtype=a["scales"].dtype, device=DEVICE)
    w = w4a16_dequant(a["qweight"], a["scales"], a["zeros"], out=out)
    assert w.data_ptr() == out.data_ptr() and torch.isfinite(w).all()
    ref = w4a16_dequant_ref(a["qweight"], a["scales"], a["zeros"])
    torch.testing.assert_close(ref, dequantize_w4(a["qweight"], a["scales"], a["zeros"]), rtol=0, atol=0)
    # q * s + b may be fused into one fp32 FMA in the kernel: at most one rounding step of the output apart.
    eps = torch.finfo(w.dtype).eps
    torch.testing.assert_close(w.float(), ref.float(), rtol=eps, atol=eps * a["zeros"].abs().max().item())
    # Almost all bit-identical; the interpreter's fp32 -> bf16 cast does not round like torch's, so bf16
    # is held to that only on the GPU.
    if ON_GPU or w.dtype == torch.float16:
        assert (w == ref).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,K,G", [(123, 384, 32), (9, 576, 64), (40, 1152, 128)])
def test_small(N, K, G, dtype):
    check(make(1, N, K, G, dtype, seed=N + K + G, device=DEVICE))


@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("K,N", LLAMA3_8B)
def test_llama3_8b_shapes(K, N):
    check(make(1, N, K, 128, torch.float16, seed=K + N, device=DEVICE))


def test_bad_inputs_are_clear_errors():
    a = make(1, 16, 128, 128, torch.float16, seed=0, device=DEVICE)
    with pytest.raises(ValueError, match="qweight must be"):
        w4a16_dequant(a["qweight"].float(), a["scales"], a["zeros"])
    with pytest.raises(ValueError, match="out must be"):
        w4a16_dequant(a["qweight"], a["scales"], a["zeros"], out=torch.empty(16, 64, dtype=torch.float16))
