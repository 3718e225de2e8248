"""csrc_triton.silu_mul against PyTorch's F.silu(gate) * up.

On CUDA the kernel must equal PyTorch bit for bit (libdevice expf and IEEE division, then the two
roundings PyTorch makes). Under the interpreter numpy's exp may differ from PyTorch CPU's in the
last fp32 bit, so there a rare one-ulp difference is allowed; everywhere the error against fp64
follows the tolerance rule. Gates span silu's whole range (exp overflow at large negative inputs).
CPU: small widths; CUDA also Llama-3-8B's ffn 14336 at M=1 and M=300.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, ON_GPU

from csrc_triton.silu_mul import silu_mul, silu_mul_ref

SHAPES = [(1, 40), (5, 217), (64, 300)] + ([(1, 14336), (300, 14336), (3, 11008)] if ON_GPU else [])
DTYPES = [torch.float16, torch.bfloat16]


def make(M, Fdim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(M, Fdim, generator=g) * 4
    gate.view(-1)[:8] = torch.tensor([-60000.0, -200.0, -88.5, -20.0, 0.0, 20.0, 200.0, 60000.0])[:min(8, gate.numel())]
    up = torch.randn(M, Fdim, generator=g) * 2
    up.view(-1)[:8] = 0.5  # keeps silu(60000) * up finite in fp16
    return torch.cat([gate, up], dim=-1).to(DEVICE, dtype)  # (M, 2F) = [gate | up]


def ulps(a, b):
    """|a - b| in units of the dtype's last place at b."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.clamp(b.float().abs(), min=torch.finfo(a.dtype).tiny)
    return ((a.float() - b.float()).abs() / (scale * eps)).nan_to_num(0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,Fdim", SHAPES)
def test_matches_pytorch(M, Fdim, dtype):
    gu = make(M, Fdim, dtype, seed=M + Fdim)
    y = silu_mul(gu)
    y_ref = silu_mul_ref(gu)
    assert y.shape == (M, Fdim) and y.dtype == dtype
    if ON_GPU:
        assert torch.equal(y, y_ref), f"{(y != y_ref).sum().item()} outputs differ from PyTorch's"
    else:
        bad = y != y_ref
        assert bad.sum().item() <= max(2, 1e-3 * y.numel()), f"{bad.sum().item()} outputs differ"
        assert (ulps(y, y_ref)[bad] <= 1.0).all()
    g64, u64 = gu.double().chunk(2, dim=-1)
    exact = F.silu(g64) * u64
    err, err_torch = (y.double() - exact).abs().max().item(), (y_ref.double() - exact).abs().max().item()
    assert y.isfinite().all() and err <= 2 * err_torch + 1e-6


def test_leading_dims_and_strided_rows():
    gu = make(2 * 5, 48, torch.float16, seed=3).view(2, 5, 96)
    y = silu_mul(gu)
    assert y.shape == (2, 5, 48)
    torch.testing.assert_close(y, silu_mul_ref(gu), rtol=1e-3, atol=1e-3)
    # Rows of a wider buffer: gate/up halves of the first 96 columns of 128-wide rows.
    wide = torch.cat([gu, torch.full_like(gu[..., :32], float("nan"))], dim=-1)[..., :96]
    assert torch.equal(silu_mul(wide), y)


@pytest.mark.parametrize("block,num_warps", [(128, 4), (256, 1), (1024, 8)])
def test_launch_shapes_agree(block, num_warps):
    gu = make(3, 1000, torch.bfloat16, seed=7)
    assert torch.equal(silu_mul(gu, block=block, num_warps=num_warps), silu_mul(gu))


def test_bad_input():
    with pytest.raises(ValueError, match="even"):
        silu_mul(torch.ones(2, 7, dtype=torch.float16, device=DEVICE))
    with pytest.raises(TypeError, match="fp16 or bf16"):
        silu_mul(torch.ones(2, 8, dtype=torch.float32, device=DEVICE))
