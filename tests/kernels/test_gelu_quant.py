"""csrc_triton.gelu_quant against its reference for exact, tanh and quick GELU: int8 values equal
except at rounding ties. On CPU under TRITON_INTERPRET=1; on CUDA also the so400m MLP width 4304."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _quant_check import assert_int8_match  # noqa: E402
from csrc_triton.gelu_quant import gelu_quant, gelu_quant_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 96), (5, 123), (2 * 729, 40)] + ([(8 * 729, 4304), (257, 1536)] if DEVICE == "cuda" else [])
KINDS = ["gelu", "gelu_tanh", "quick_gelu"]


def gelu64(h, kind):
    if kind == "gelu":
        return torch.nn.functional.gelu(h)
    if kind == "gelu_tanh":
        return torch.nn.functional.gelu(h, approximate="tanh")
    return h * torch.sigmoid(1.702 * h)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,K", SHAPES)
def test_matches_reference(M, K, dtype, kind):
    g = torch.Generator().manual_seed(M + K)
    h = (torch.randn(M, K, generator=g) * 2.5).to(DEVICE, dtype)
    h[0, : min(K, 4)] = torch.tensor([-60.0, 30.0, -3.0, 0.0])[: min(K, 4)].to(dtype)  # saturating tails
    q, s = gelu_quant(h, kind)
    q_ref, s_ref = gelu_quant_ref(h, kind)
    assert_int8_match(q, s, q_ref, s_ref, gelu64(h.double(), kind))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # h * h = inf under the interpreter's numpy: intended
@pytest.mark.parametrize("kind", KINDS)
def test_overflowing_inputs(kind):
    """Huge |h| (bf16): the exp2 argument overflows to +-inf (no clamps in the kernel); GELU must give
    h or -0 there, never NaN. Values far from rounding ties, so the int8 values equal the reference's."""
    rows = [[1e38, -1e38, 1e30, -1e30, 100.0, -100.0, 1.0, 0.0], [-1e4, 5.0, -50.0, 2.0, -2.0, 0.5, -0.5, 0.0]]
    h = torch.tensor(rows).repeat(1, 5).to(DEVICE, torch.bfloat16)  # (2, 40)
    q, s = gelu_quant(h, kind)
    q_ref, s_ref = gelu_quant_ref(h, kind)
    assert torch.equal(q.cpu(), q_ref.cpu()) and q[0, 0] == 127 and q[1, 1] == 127
    torch.testing.assert_close(s.cpu(), s_ref.cpu(), rtol=2e-6, atol=0)


def test_kinds_differ():
    h = torch.randn(3, 64, device=DEVICE, dtype=torch.float16) * 2
    outs = [gelu_quant(h, k)[0] for k in KINDS]
    assert not torch.equal(outs[0], outs[2]) and not torch.equal(outs[1], outs[2])


def test_bad_kind():
    with pytest.raises(ValueError, match="unknown activation"):
        gelu_quant(torch.ones(2, 4, device=DEVICE), "relu")


@pytest.mark.parametrize("meta", [dict(ROWS=1, num_warps=1), dict(ROWS=2, num_warps=2), dict(SPLIT=False)])
def test_launch_shapes_agree(meta):
    """Launch shapes of the benchmark's sweep give the default's bits (elementwise math and a max)."""
    h = (torch.randn(37, 300, generator=torch.Generator().manual_seed(9)) * 2).to(DEVICE, torch.float16)
    q, s = gelu_quant(h, "gelu_tanh")
    q2, s2 = gelu_quant(h, "gelu_tanh", meta=meta)
    assert torch.equal(q, q2) and torch.equal(s, s2)
