"""The salience layer's attention hands its LSE to the prefill-salience kernel (one QK^T pass saved).

On CUDA: the flash attention's LSE is the natural-log row normaliser and the fused salience equals
the reference. Everywhere: `prune` passes the salience layer's LSE through to `ops.prefill_salience`.
"""

import pytest
import torch

import tinyvila
from tinyvila import ops
from tinyvila.config import SparsityConfig
from tinyvila.loader import build_synthetic


def _qkv(B, H, T, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(3)]


def test_cpu_attention_is_the_plain_path_and_gives_no_lse():
    q, k, v = _qkv(2, 3, 17, 8, torch.float32, "cpu")
    o, lse = ops.attention_with_lse(q, k, v)
    assert lse is None
    assert torch.equal(o, ops.attention(q, k, v, causal=False))


@pytest.mark.gpu  # the flash kernel that returns the LSE is CUDA only
@pytest.mark.parametrize("shape", [(2, 16, 729, 72), (1, 4, 577, 64), (1, 16, 4096, 80)])
def test_flash_lse_feeds_the_kernel(shape):
    q, k, v = _qkv(*shape, torch.float16, "cuda", seed=shape[2])
    o, lse = ops.attention_with_lse(q, k, v)
    s = q.float() @ k.float().transpose(-1, -2) * shape[3] ** -0.5  # (B, H, T, T)
    torch.testing.assert_close(lse, s.logsumexp(-1), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(o.float(), torch.softmax(s, -1) @ v.float(), rtol=2e-2, atol=2e-3)
    ref = torch.softmax(s.double(), -1).mean(dim=(1, 2))
    fused = ops.prefill_salience(q, k, lse=lse)
    torch.testing.assert_close(fused.double(), ref, rtol=2e-3, atol=1e-6 * ref.max().item())


@pytest.mark.parametrize("preset", ["tiny-siglip-llama", "tiny-clip-qwen2"])
def test_prune_hands_the_attention_lse_to_the_kernel(preset, tmp_path, monkeypatch):
    """The LSE the salience layer's attention returns is what the salience kernel receives (CLIP: the
    CLS row's), and the kept set does not change for it."""
    model = tinyvila.load(build_synthetic(tmp_path / "m", preset, seed=0), dtype=torch.float32).model
    s = model.cfg.vision.image_size
    px = torch.randn(2, 3, s, s, generator=torch.Generator().manual_seed(0))
    sp = SparsityConfig(prefill_keep=0.5)
    with torch.inference_mode():
        _, want = model.encode_images(px, sp, with_index=True)
    seen, plain = [], ops.attention_with_lse

    def with_lse(q, k, v):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, T, T)
        lse = s.logsumexp(-1)
        seen.append(lse)
        return plain(q, k, v)[0], lse

    passed, salience = [], ops.prefill_salience

    def spy(q, k, *, n_query=None, lse=None):
        passed.append((n_query, lse))
        return salience(q, k, n_query=n_query, lse=lse)

    monkeypatch.setattr(ops, "attention_with_lse", with_lse)
    monkeypatch.setattr(ops, "prefill_salience", spy)
    with torch.inference_mode():
        _, idx = model.encode_images(px, sp, with_index=True)
    assert len(seen) == 1 and len(passed) == 1
    n_query, lse = passed[0]
    cls = model.cfg.vision.cls_token
    assert n_query == (1 if cls else None)
    assert torch.equal(lse, seen[0][:, :, :1] if cls else seen[0])
    assert torch.equal(idx, want)
