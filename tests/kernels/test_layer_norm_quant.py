"""csrc_triton.layer_norm_quant against its reference: int8 values equal except at rounding ties.

On CPU under TRITON_INTERPRET=1 (M=1, odd widths, M=729*2); on CUDA also so400m / DINOv2 widths.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _quant_check import assert_int8_match  # noqa: E402
from csrc_triton.layer_norm_quant import layer_norm_quant, layer_norm_quant_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 48), (7, 217), (2 * 729, 64)] + ([(8 * 729, 1152), (257, 384)] if DEVICE == "cuda" else [])


def make(M, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 3 + torch.randn(M, 1, generator=g)).to(DEVICE, dtype)
    w = (1 + 0.3 * torch.randn(K, generator=g)).to(DEVICE, dtype)
    b = (0.2 * torch.randn(K, generator=g)).to(DEVICE, dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,K", SHAPES)
def test_matches_reference(M, K, dtype):
    x, w, b = make(M, K, dtype, seed=M + K)
    q, s = layer_norm_quant(x, w, b, 1e-6)
    q_ref, s_ref = layer_norm_quant_ref(x, w, b, 1e-6)
    y64 = torch.nn.functional.layer_norm(x.double(), (K,), w.double(), b.double(), 1e-6)
    assert_int8_match(q, s, q_ref, s_ref, y64)
    err = (q.double() * s.double()[:, None] - y64).abs()
    assert (err <= s.double()[:, None] * (0.5 + 1e-3)).all()


def test_eps_is_used():
    x, w, b = make(4, 32, torch.float32, seed=5)
    x = x * 1e-3  # variance ~1e-5: eps=1e-2 changes the normalised values, not only their scale
    _, s_small = layer_norm_quant(x, w, b, 1e-6)
    _, s_big = layer_norm_quant(x, w, b, 1e-2)
    assert (s_big < 0.5 * s_small).all()
    torch.testing.assert_close(s_big.cpu(), layer_norm_quant_ref(x, w, b, 1e-2)[1].cpu(), rtol=1e-5, atol=0)


def test_bad_input():
    x, w, b = make(2, 16, torch.float16, seed=0)
    with pytest.raises(ValueError, match="weight and bias"):
        layer_norm_quant(x, w[:8], b, 1e-6)


@pytest.mark.parametrize("meta", [dict(ROWS=1, num_warps=1), dict(ROWS=2, num_warps=2), dict(ROWS=4, num_warps=8),
                                  dict(SPLIT=False), dict(SPLIT=False, ROWS=2, num_warps=1)])
@pytest.mark.parametrize("K", [300, 256] + ([1152] if DEVICE == "cuda" else []))
def test_launch_shapes(meta, K):
    """Every launch shape the benchmark sweeps (rows per program, warps; one padded block instead of
    head + tail) matches the reference (sums may associate differently: ties may differ)."""
    x, w, b = make(37, K, torch.float16, seed=K)
    q, s = layer_norm_quant(x, w, b, 1e-6, meta=meta)
    q_ref, s_ref = layer_norm_quant_ref(x, w, b, 1e-6)
    assert_int8_match(q, s, q_ref, s_ref, torch.nn.functional.layer_norm(x.double(), (K,), w.double(), b.double(), 1e-6))
