"""csrc_triton.w4a16_gemv (decode, M <= 8) against the exact quantized product and PyTorch's error.

On CPU the kernel runs under TRITON_INTERPRET=1 at small odd shapes (M in {1, 3, 8}, groups 32/64/128,
fp16/bf16, a K that leaves a partial tile); on CUDA the same cases run with the autotuned kernel, plus
Llama-3-8B layer shapes and every config of the autotune space; the small cases run with both nibble
unpackings there (plain shifts, and the PTX block that is the GPU default).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _w4_check import LLAMA3_8B, assert_w4_close, make, poisoned  # noqa: E402

from csrc_triton.w4a16_gemv import CONFIGS, INTERPRET_CONFIG, w4a16_gemv, w4a16_gemv_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float16, torch.bfloat16]
# Small cases pin one tile (on the GPU too: autotuning every small key would compile hundreds of
# variants); the autotuned path runs at the real shapes, and every tuned tile runs in test_every_config.
FIXED = INTERPRET_CONFIG
# Nibble unpacking: 0 = plain shifts (the interpreter's), 1 = the PTX block (the GPU default); both on the GPU.
UNPACKS = [0, 1] if ON_GPU else [0]


def run(a: dict, **kw) -> torch.Tensor:
    out = poisoned(a["x"].shape[0], a["qweight"].shape[0], a["x"].dtype, DEVICE)
    y = w4a16_gemv(a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"], out=out, **kw)
    assert y.data_ptr() == out.data_ptr()
    return y


@pytest.mark.parametrize("unpack", UNPACKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_small(M, G, dtype, unpack):
    a = make(M, 123, 384, G, dtype, seed=M * 1000 + G, device=DEVICE)
    assert_w4_close(run(a, config=FIXED, unpack=unpack), a)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,G", [(1, 217, 576, 64), (5, 40, 1152, 128), (2, 9, 32, 32)])
@pytest.mark.parametrize("unpack", UNPACKS)
def test_odd_shapes_with_bias(M, N, K, G, dtype, unpack):
    """K = 576 (SmolLM2) is 72 words: a partial last tile; N = 9 is below one row block; Qwen2-style bias."""
    a = make(M, N, K, G, dtype, seed=N + K, bias=True, device=DEVICE)
    assert_w4_close(run(a, config=FIXED, unpack=unpack), a)


def test_matches_reference_closely():
    """The kernel (no rounding of w) and `_ref` (w rounded to fp16) differ by rounding only."""
    a = make(4, 64, 256, 64, torch.float16, seed=7, bias=True, device=DEVICE)
    y, ref = run(a, config=FIXED), w4a16_gemv_ref(**a)
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=2e-3 * ref.abs().max().item())


@pytest.mark.skipif(not ON_GPU, reason="real shapes need a GPU (the interpreter is too slow)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("K,N", LLAMA3_8B)
def test_llama3_8b_shapes(K, N, M, dtype):
    a = make(M, N, K, 128, dtype, seed=K + N + M, device=DEVICE)
    assert_w4_close(run(a), a)


@pytest.mark.skipif(not ON_GPU, reason="compiles every autotune config: GPU only")
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "n{BLOCK_N}w{BLOCK_W}s{STAGES}".format(**c.kwargs) + f"x{c.num_warps}")
def test_every_config(cfg, M):
    a = make(M, 300, 1536, 128, torch.float16, seed=M, bias=True, device=DEVICE)
    config = {**cfg.kwargs, "num_warps": cfg.num_warps}
    assert_w4_close(run(a, config=config), a)


def test_bad_inputs_are_clear_errors():
    a = make(9, 16, 128, 128, torch.float16, seed=0, device=DEVICE)
    with pytest.raises(ValueError, match="at most 8 rows"):
        w4a16_gemv(a["x"], a["qweight"], a["scales"], a["zeros"])
    x = a["x"][:1]
    with pytest.raises(ValueError, match="zeros must be float32"):
        w4a16_gemv(x, a["qweight"], a["scales"], a["zeros"].half())
    with pytest.raises(ValueError, match="scales dtype"):
        w4a16_gemv(x, a["qweight"], a["scales"].bfloat16(), a["zeros"])
    with pytest.raises(ValueError, match="group size 16"):
        w4a16_gemv(x, a["qweight"], a["scales"].repeat(1, 8), a["zeros"].repeat(1, 8))
    with pytest.raises(ValueError, match="qweight must be int32"):
        w4a16_gemv(x, a["qweight"].view(torch.float32), a["scales"], a["zeros"])
