"""csrc_triton.w4a16_gemm (prefill) against the exact quantized product and PyTorch's error.

On CPU the kernel runs under TRITON_INTERPRET=1 at small odd shapes (M in {17, 128} beside the decode
sizes 1 and 8, groups 32/64/128, fp16/bf16); on CUDA the same cases run autotuned, plus Llama-3-8B
layer shapes at M = 128 and 2048 through both paths (fused kernel; dequantize + cuBLAS, the default
from DEQUANT_MIN_M rows) and every config of the autotune space.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _w4_check import LLAMA3_8B, assert_w4_close, make, poisoned  # noqa: E402

from csrc_triton.w4a16_gemm import CONFIGS, INTERPRET_CONFIG, w4a16_gemm, w4a16_gemm_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float16, torch.bfloat16]
# Small cases pin one tile (on the GPU too: autotuning every small key would compile hundreds of
# variants); the autotuned path runs at the real shapes, and every tuned tile runs in test_every_config.
FIXED = INTERPRET_CONFIG


def run(a: dict, **kw) -> torch.Tensor:
    out = poisoned(a["x"].shape[0], a["qweight"].shape[0], a["x"].dtype, DEVICE)
    y = w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"], out=out, **kw)
    assert y.data_ptr() == out.data_ptr()
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("M", [17, 128])
def test_small(M, G, dtype):
    a = make(M, 123, 384, G, dtype, seed=M * 1000 + G, device=DEVICE)
    assert_w4_close(run(a, config=FIXED), a)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,G", [(1, 217, 576, 64), (8, 40, 256, 32), (45, 9, 128, 128)])
def test_odd_shapes_with_bias(M, N, K, G, dtype):
    """Decode sizes through the GEMM too; N = 9 below one tile; M = 45 partial row tiles; Qwen2 bias."""
    a = make(M, N, K, G, dtype, seed=N + K, bias=True, device=DEVICE)
    assert_w4_close(run(a, config=FIXED), a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_path(dtype):
    """The long-prompt path (dequantize to a workspace, then a dense matmul), forced at a small shape."""
    a = make(37, 75, 256, 64, dtype, seed=11, bias=True, device=DEVICE)
    assert_w4_close(run(a, path="dequant"), a)
    a["bias"] = None
    assert_w4_close(run(a, path="dequant"), a)


def test_matches_reference():
    """Both round w to x's dtype and accumulate in fp32: equal up to summation order."""
    a = make(33, 64, 256, 64, torch.float16, seed=7, bias=True, device=DEVICE)
    y, ref = run(a, config=FIXED), w4a16_gemm_ref(**a)
    torch.testing.assert_close(y, ref, rtol=2e-3, atol=1e-3 * ref.abs().max().item())


@pytest.mark.skipif(not ON_GPU, reason="real shapes need a GPU (the interpreter is too slow)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [128, 2048])
@pytest.mark.parametrize("K,N", LLAMA3_8B)
@pytest.mark.parametrize("path", ["fused", "dequant"])
def test_llama3_8b_shapes(K, N, M, dtype, path):
    a = make(M, N, K, 128, dtype, seed=K + N + M, device=DEVICE)
    assert_w4_close(run(a, path=path), a)


@pytest.mark.skipif(not ON_GPU, reason="compiles every autotune config: GPU only")
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "m{BLOCK_M}n{BLOCK_N}k{BLOCK_K}".format(**c.kwargs)
                         + f"x{c.num_warps}s{c.num_stages}")
def test_every_config(cfg):
    a = make(300, 520, 1536, 128, torch.float16, seed=3, bias=True, device=DEVICE)
    config = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    assert_w4_close(run(a, config=config), a)


def test_bad_inputs_are_clear_errors():
    a = make(4, 16, 128, 128, torch.float16, seed=0, device=DEVICE)
    with pytest.raises(ValueError, match="x must be a 2-D float16/bfloat16"):
        w4a16_gemm(a["x"].float(), a["qweight"], a["scales"], a["zeros"])
    with pytest.raises(ValueError, match="bias must be"):
        w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"], torch.zeros(15, dtype=torch.float16))
    with pytest.raises(ValueError, match="unit stride"):
        w4a16_gemm(a["x"].repeat(1, 2)[:, ::2], a["qweight"], a["scales"], a["zeros"])
