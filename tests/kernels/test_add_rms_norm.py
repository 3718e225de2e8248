"""csrc_triton.add_rms_norm against its reference and an fp64 oracle.

The sum residual + x must equal PyTorch's bit for bit; the normed output follows the tolerance rule
(error vs fp64 at most 2x PyTorch's own fp16/bf16 error) and differs from the reference only rarely
(the fp32 sum of squares is added in another order). CPU: the interpreter at small widths; CUDA also
Llama-3-8B's dim 4096 at decode (M=1) and prefill (M=300).
"""

import pytest
import torch
from conftest import DEVICE, ON_GPU

from csrc_triton.add_rms_norm import add_rms_norm, add_rms_norm_ref

SHAPES = [(1, 40), (5, 217), (64, 96)] + ([(1, 4096), (300, 4096), (7, 5120)] if ON_GPU else [])
DTYPES = [torch.float16, torch.bfloat16]


def make(M, D, dtype, seed, residual=True):
    g = torch.Generator().manual_seed(seed)
    # Residual streams carry a few large channels; the added sublayer output is smaller.
    r = torch.randn(M, D, generator=g) * 2
    r[:, 3 % D] *= 30
    x = torch.randn(M, D, generator=g) * 0.5
    w = 1 + 0.3 * torch.randn(D, generator=g)
    return x.to(DEVICE, dtype), (r.to(DEVICE, dtype) if residual else None), w.to(DEVICE, dtype)


def oracle(s, w, eps):
    """fp64 RMSNorm of the (already rounded) stream s."""
    s64 = s.double()
    return w.double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)


def assert_normed_ok(y, y_ref, s, w, eps):
    o = oracle(s, w, eps)
    err, err_torch = (y.double() - o).abs().max().item(), (y_ref.double() - o).abs().max().item()
    assert err <= 2 * err_torch + 1e-6, f"kernel error {err} vs PyTorch's {err_torch}"
    differ = (y != y_ref).float().mean().item()
    assert differ <= 0.02, f"{differ:.3%} of outputs differ from the reference"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,D", SHAPES)
def test_matches_reference(M, D, dtype):
    x, r, w = make(M, D, dtype, seed=M * D)
    y, s = add_rms_norm(x, r, w, 1e-5)
    y_ref, s_ref = add_rms_norm_ref(x, r, w, 1e-5)
    assert s.dtype == y.dtype == dtype and s.shape == y.shape == (M, D)
    assert torch.equal(s, s_ref) and torch.equal(s_ref, r + x)  # PyTorch's fp16 add, bit for bit
    assert_normed_ok(y, y_ref, s_ref, w, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_residual_is_plain_rms_norm(dtype):
    x, _, w = make(9, 200 if not ON_GPU else 4096, dtype, seed=3, residual=False)
    y, s = add_rms_norm(x, None, w, 1e-6)
    assert s is x
    from tinyvila.ops import rms_norm

    assert torch.equal(add_rms_norm_ref(x, None, w, 1e-6)[0], rms_norm(x, w, 1e-6))
    assert_normed_ok(y, rms_norm(x, w, 1e-6), x, w, 1e-6)


def test_leading_dims_and_strided_rows():
    """(B, T, D) input, and the last-token slice (B, 1, D) the model norms when only logits of the
    last row are needed: rows `T * D` apart."""
    x, r, w = make(2 * 6, 64, torch.float16, seed=11)
    x, r = x.view(2, 6, 64), r.view(2, 6, 64)
    y, s = add_rms_norm(x, r, w, 1e-5)
    y_ref, s_ref = add_rms_norm_ref(x, r, w, 1e-5)
    assert y.shape == s.shape == (2, 6, 64) and torch.equal(s, s_ref)
    assert_normed_ok(y, y_ref, s_ref, w, 1e-5)
    y1, s1 = add_rms_norm(x[:, -1:], r[:, -1:], w, 1e-5)
    assert torch.equal(s1, s_ref[:, -1:]) and torch.equal(y1, y[:, -1:])


def test_eps_is_used():
    x, r, w = make(4, 32, torch.float16, seed=5)
    x, r = x * 1e-3, r * 1e-3  # mean square ~1e-4: eps=1e-2 shrinks the output ~10x
    small, big = add_rms_norm(x, r, w, 1e-6)[0], add_rms_norm(x, r, w, 1e-2)[0]
    assert (big.float().abs().amax(-1) < 0.3 * small.float().abs().amax(-1)).all()
    assert_normed_ok(big, add_rms_norm_ref(x, r, w, 1e-2)[0], r + x, w, 1e-2)


@pytest.mark.parametrize("num_warps", [1, 2, 4, 8])
def test_launch_shapes_agree(num_warps):
    """Every launch the benchmark sweeps gives the default's outputs."""
    x, r, w = make(3, 300, torch.bfloat16, seed=7)
    y, s = add_rms_norm(x, r, w, 1e-5)
    y2, s2 = add_rms_norm(x, r, w, 1e-5, num_warps=num_warps)
    assert torch.equal(s, s2)
    assert (y.float() - y2.float()).abs().max().item() <= 2 * (y.float().abs().max().item() * 2 ** -8)


def test_bad_input():
    x, r, w = make(2, 16, torch.float16, seed=0)
    with pytest.raises(TypeError, match="fp16 or bf16"):
        add_rms_norm(x.float(), r.float(), w.float(), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, r[:1], w, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, r, w[:8], 1e-5)


def test_model_fused_vs_unfused(monkeypatch):
    """A tiny fp16 TextModel through the fused path (residual norms + silu_mul kernels; on CPU the
    interpreter, switched on by hand) against the same model with the kernels off: error vs the
    fp32 model at most 2x the unfused fp16 error; same argmax."""
    from tinyvila import ops
    from tinyvila.config import TextConfig
    from tinyvila.text import KVCache, TextModel

    dim, layers, T = (256, 4, 24) if ON_GPU else (64, 2, 6)
    cfg = TextConfig(vocab_size=512, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=2 * dim,
                     rope_theta=10000.0, max_seq_len=64)
    g = torch.Generator().manual_seed(0)
    model = TextModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.ndim == 2 else 0.1) + (p.ndim == 1))
    model = model.to(DEVICE).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=g).to(DEVICE)

    def logits(m, dtype):
        with torch.no_grad():
            return m(m.embed(tokens), KVCache(cfg, batch=2, max_seq_len=64, dtype=dtype, device=DEVICE), 0)

    want = logits(model, torch.float32)  # fp32: the reference path everywhere
    half = model.half()
    monkeypatch.setattr(ops, "_fused_kernels", lambda x: x.dtype in (torch.float16, torch.bfloat16))
    fused = logits(half, torch.float16)
    monkeypatch.setattr(ops, "_fused_kernels", lambda x: False)
    unfused = logits(half, torch.float16)
    err, err_unfused = (fused - want).abs().max().item(), (unfused - want).abs().max().item()
    assert err <= 2 * err_unfused + 1e-3, f"fused error {err} vs unfused {err_unfused}"
    assert (fused.argmax(-1) == unfused.argmax(-1)).float().mean().item() >= 0.9
