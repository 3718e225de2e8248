"""csrc_triton.rounding.round_to (through round_fp32) against PyTorch's cast, bit for bit.

The fused decoder kernels rely on it to reproduce PyTorch's fp16/bf16 intermediates exactly; under the
interpreter its bf16 path rounds on the bits (the interpreter's own cast truncates), so ties, values
just either side of a tie, overflow to inf, subnormals and signed zeros are all checked.
"""

import pytest
import torch
from conftest import DEVICE

from csrc_triton.rounding import round_fp32, round_fp32_ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def hard_values(dtype: torch.dtype) -> torch.Tensor:
    """fp32 values on and next to the rounding ties of `dtype`, plus random ones and edge cases."""
    g = torch.Generator().manual_seed(0)
    grid = torch.randn(2000, generator=g).to(dtype).float()  # representable in dtype
    up = torch.nextafter(grid, torch.full_like(grid, float("inf")))
    step = torch.nextafter(grid.to(dtype), torch.full_like(grid, float("inf")).to(dtype)).float() - grid
    tie = grid + step / 2  # exactly halfway to the next representable value
    near = torch.cat([tie, torch.nextafter(tie, grid), torch.nextafter(tie, grid + step), up])
    rand = torch.randn(5000, generator=g) * torch.logspace(-8, 8, 5000)
    edge = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 6e-8, 65504.0, 65519.0, 65520.0, 1e30, -1e30, 3.3895e38])
    return torch.cat([grid, near, rand, edge])


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_matches_pytorch_bit_for_bit(dtype):
    x = hard_values(dtype).to(DEVICE)
    y = round_fp32(x, dtype)
    ref = round_fp32_ref(x, dtype)
    assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    if dtype != torch.float32:
        assert not torch.equal(ref, x)  # the inputs really needed rounding


def test_odd_length_and_bad_input():
    x = torch.randn(1031, device=DEVICE)  # not a multiple of the block: the masked tail
    assert torch.equal(round_fp32(x, torch.bfloat16), round_fp32_ref(x, torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        round_fp32(x.half(), torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        round_fp32(x, torch.int8)
