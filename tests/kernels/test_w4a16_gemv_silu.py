"""csrc_triton.w4a16_gemv_silu (SwiGLU in the gate/up W4 GEMV's epilogue) against the two launches it replaces,
w4a16_gemv then csrc_triton.silu_mul, and against w4a16_gemv_silu_ref.

On CPU under TRITON_INTERPRET=1 at small shapes ("mma" kernel, G = 128: split-K, two 16-row tiles per warp,
prenorm, M in {1, 3, 8}, fp16/bf16); on CUDA bit for bit, also at Llama-3-8B's gate/up shape with the
launcher's own config.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _w4_check import assert_nearly_equal, make  # noqa: E402

from csrc_triton.silu_mul import silu_mul  # noqa: E402
from csrc_triton.w4a16_gemv import INTERPRET_CONFIG, INTERPRET_MMA_CONFIG, gemv_config, w4a16_gemv  # noqa: E402
from csrc_triton.w4a16_gemv_silu import silu_ok, w4a16_gemv_silu, w4a16_gemv_silu_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float16, torch.bfloat16]
FMA, MMA = INTERPRET_CONFIG, INTERPRET_MMA_CONFIG  # small pinned tiles (the GPU compiles them once too)
# The interpreter turns tl.minimum of two scalars (a split's last K range) into a 1-element array that it
# then converts to an int: NumPy >= 1.25 warns about that conversion. Harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


SILU_CONFIGS = [("mma", MMA), ("mma split", {**MMA, "SPLIT_K": 2}), ("mma 2 tiles per warp", {**MMA, "BLOCK_N": 128})]


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("name,cfg", SILU_CONFIGS, ids=[c[0] for c in SILU_CONFIGS])
def test_silu_epilogue_equals_gemv_then_silu_mul(name, cfg, M, dtype, prenorm):
    """w4a16_gemv_silu = the silu_mul kernel on the plain GEMV's output (the same SwiGLU code, so the same
    exponentials also under the interpreter): bit for bit on the GPU. Under the interpreter tl.dot is numpy's
    matmul, whose fp32 sum for a row depends on the row's place in the tile on some hosts (OpenBLAS's AVX-512
    kernels), and the fused tile places the gate and up rows elsewhere than the plain GEMV's: there fp16 is held
    to _w4_check.assert_nearly_equal; bf16 (whose plain interpreter store truncates) to a looser bound."""
    a = make(M, 256, 256, 128, dtype, seed=M * 3 + 1, device=DEVICE)
    args = (a["x"], a["qweight"], a["scales"], a["zeros"])
    gen = torch.Generator(DEVICE).manual_seed(M)
    pn = (torch.rand(3, 8, device=DEVICE, generator=gen) * 300, 1e-5) if prenorm else None
    y = w4a16_gemv_silu(*args, config=cfg, prenorm=pn)
    ref = silu_mul(w4a16_gemv(*args, config=cfg, prenorm=pn))
    assert y.shape == (M, 128)
    if ON_GPU:
        assert torch.equal(y, ref)
    elif dtype == torch.float16:
        assert_nearly_equal(y, ref)
    else:
        torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6 * ref.abs().max().item())


def test_silu_ok_and_rejects():
    assert silu_ok(256, 256, 128, MMA) and not silu_ok(256, 256, 128, FMA)
    assert not silu_ok(2 * 80, 256, 128, MMA)  # F = 80 is not whole half-tiles of 32 rows
    a = make(1, 160, 256, 128, torch.float16, seed=9, device=DEVICE)
    with pytest.raises(ValueError, match="w4a16_gemv_silu needs"):
        w4a16_gemv_silu(a["x"], a["qweight"], a["scales"], a["zeros"], config=MMA)


@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 8])
def test_llama3_8b_gate_up_silu(M, dtype):
    """The launcher's gate/up config (28672 x 4096) ends in SwiGLU, bit for bit the two launches it replaces."""
    a = make(M, 28672, 4096, 128, dtype, seed=M + 77, device=DEVICE)
    args = (a["x"], a["qweight"], a["scales"], a["zeros"])
    assert silu_ok(28672, 4096, 128, gemv_config(M, 28672, 4096, 128))
    pn = (torch.rand(64, 8, device=DEVICE) * 50, 1e-5)
    assert torch.equal(w4a16_gemv_silu(*args, prenorm=pn), silu_mul(w4a16_gemv(*args, prenorm=pn)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_closely(dtype):
    """The kernel (no rounding of w) and w4a16_gemv_silu_ref (w rounded to the dtype) differ by the GEMV's
    rounding only, carried through SwiGLU."""
    a = make(3, 256, 256, 128, dtype, seed=21, device=DEVICE)
    args = (a["x"], a["qweight"], a["scales"], a["zeros"])
    pn = (torch.rand(3, 8, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2)) * 300, 1e-5)
    y, ref = w4a16_gemv_silu(*args, config=MMA, prenorm=pn), w4a16_gemv_silu_ref(*args, prenorm=pn)
    assert y.shape == ref.shape == (3, 128)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
