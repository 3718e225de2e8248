"""text.rope_table, the RoPE rows a decode step reads at its position (StepIndex.rope): row p equals
rope_cos_sin(cfg, [p]) bit for bit (elementwise ops over all positions at once), for default and llama3
RoPE, every activation dtype, on the CPU and (where present) the GPU."""

import pytest
import torch

from tinyvila.config import RopeScaling, TextConfig
from tinyvila.text import rope_cos_sin, rope_table

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
CONFIGS = {
    "default": TextConfig(vocab_size=8, dim=512, n_layers=1, n_heads=4, n_kv_heads=1, ffn_dim=8, rope_theta=10000.0),
    "head_dim16": TextConfig(vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=1, ffn_dim=8),  # the tiny presets'
    "llama3": TextConfig(vocab_size=8, dim=512, n_layers=1, n_heads=4, n_kv_heads=1, ffn_dim=8, rope_theta=500000.0,
                         rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position=8192)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rows_equal_per_position_tables(name, dtype, device):
    cfg, n = CONFIGS[name], 9000  # past llama3's original context; large enough for multi-threaded CPU kernels
    table = rope_table(cfg, n, dtype, device)
    assert table.shape == (2, n, cfg.head_dim) and table.dtype == dtype
    for p in [*range(0, 70), *range(71, n, 97), n - 1]:
        cos, sin = rope_cos_sin(cfg, torch.tensor([p], device=device), dtype)
        # Bitwise: the bits, not the values (an equal-valued -0.0 / 0.0 swap would be a different table).
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[table.element_size()]
        assert torch.equal(table[0, p:p + 1].view(bits), cos.view(bits)), p
        assert torch.equal(table[1, p:p + 1].view(bits), sin.view(bits)), p
