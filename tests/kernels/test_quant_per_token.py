"""csrc_triton.quant_per_token against its reference: int8 values equal except at rounding ties.

On CPU under TRITON_INTERPRET=1 (M=1, odd widths, M=729*2); on CUDA also so400m widths and 8 images.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _quant_check import assert_int8_match  # noqa: E402
from csrc_triton.quant_per_token import quant_per_token, quant_per_token_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 40), (5, 217), (2 * 729, 48)] + ([(8 * 729, 1152), (729, 4304)] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,K", SHAPES)
def test_matches_reference(M, K, dtype):
    g = torch.Generator().manual_seed(M * K)
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4).to(DEVICE, dtype)
    x[:, 3 % K] *= 20  # an outlier channel, as real activations have
    q, s = quant_per_token(x)
    q_ref, s_ref = quant_per_token_ref(x)
    assert_int8_match(q, s, q_ref, s_ref, x.double())
    # Dequantized error is at most half a step (the tolerance of any symmetric int8 quantizer).
    err = (q.double() * s.double()[:, None] - x.double()).abs()
    assert (err <= s.double()[:, None] * 0.5 * (1 + 1e-5)).all()


def test_leading_dims_and_zero_row():
    x = torch.randn(2, 3, 24, device=DEVICE, dtype=torch.float16)
    x[1, 2] = 0
    q, s = quant_per_token(x)
    assert q.shape == (2, 3, 24) and s.shape == (2, 3)
    assert (q[1, 2] == 0).all() and s[1, 2].item() == pytest.approx(1e-5 / 127)
    torch.testing.assert_close(q.cpu(), quant_per_token_ref(x)[0].cpu(), rtol=0, atol=1)


def test_bad_input():
    with pytest.raises(TypeError, match="fp16"):
        quant_per_token(torch.ones(2, 4, dtype=torch.int32, device=DEVICE))


# Launch shapes of the benchmark's sweep (rows per program, warps; SPLIT=False: one padded block).
METAS = [dict(ROWS=1, num_warps=1), dict(ROWS=2, num_warps=2), dict(ROWS=4, num_warps=8), dict(ROWS=4, num_warps=16),
         dict(SPLIT=False), dict(SPLIT=False, ROWS=2, num_warps=1)]


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize("K", [300, 256] + ([1152] if DEVICE == "cuda" else []))
def test_launch_shapes_agree(meta, K):
    """Every launch shape the benchmark sweeps gives the default's bits (a max and elementwise
    math: no reduction order to differ); K=300 has a tail block, 256 none."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(37, K, generator=g) * 3).to(DEVICE, torch.float16)
    q, s = quant_per_token(x)
    q2, s2 = quant_per_token(x, meta=meta)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    assert q.abs().max().item() == 127
