"""Causal GQA attention of new rows over a KV cache (tinyvila.ops.attention / attention_lse): the CUDA paths
against the fp32 reference (`ops._attention_lse_ref`), on CPU the reference path against an independent
materialised softmax.

On CUDA, rows over a cache prefix take one call of PyTorch's flash kernel with its causal mask aligned
bottom-right and the KV heads as they are (ops._attention_lse_flash); a square first turn of at least
ops.SDPA_SQUARE_MIN_T rows takes SDPA with K/V expanded. The cases below are views of a larger cache, as
text.Attention passes them, with GQA groups of 1, 4 and 7, fp16 and bf16.
"""

import pytest
import torch

from tinyvila import ops

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # output atol vs fp32 (unit-variance V)


def _cache(H, Hkv, T, q_start, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    cap = q_start + T + 37  # slots past the used ones exist and must not be read
    kc = torch.randn(1, Hkv, cap, D, generator=g).to(device, dtype)
    vc = torch.randn(1, Hkv, cap, D, generator=g).to(device, dtype)
    q = (2 * torch.randn(1, H, T, D, generator=g)).to(device, dtype)
    kc[:, :, q_start + T:] = float("nan")  # poison: a read past the last row shows in the output
    vc[:, :, q_start + T:] = float("nan")
    return q, kc[:, :, :q_start + T], vc[:, :, :q_start + T]


def _materialised(q, k, v, q_start):
    """Softmax attention written out in fp64: row t sees keys 0..q_start + t."""
    n_rep = q.shape[1] // k.shape[1]
    kd, vd = (x.double().repeat_interleave(n_rep, 1) for x in (k, v))
    s = q.double() @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    T, S = q.shape[2], k.shape[2]
    s = s.masked_fill(torch.arange(S)[None, :] > torch.arange(q_start, q_start + T)[:, None], float("-inf"))
    return torch.softmax(s, -1) @ vd, torch.logsumexp(s, -1)


@pytest.mark.parametrize("T,q_start", [(1, 0), (5, 0), (3, 11), (9, 40)])
def test_cpu_reference_paths(T, q_start):
    q, k, v = _cache(8, 2, T, q_start, 16, torch.float32, "cpu")
    o_ref, lse_ref = _materialised(q, k, v, q_start)
    o, lse = ops.attention_lse(q, k, v, q_start)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.attention(q, k, v, causal=True, q_start=q_start).double(), o_ref,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.gpu  # PyTorch's flash kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv", [(32, 8), (14, 2), (8, 8)])
@pytest.mark.parametrize("T,q_start", [(1, 0), (1, 700), (17, 0), (17, 1000), (46, 515), (64, 8192), (130, 4000),
                                       (450, 0), (1100, 0), (1024, 3000)])
def test_cuda_matches_reference(dtype, H, Hkv, T, q_start):
    q, k, v = _cache(H, Hkv, T, q_start, 128, dtype, "cuda")
    o_ref, lse_ref = ops._attention_lse_ref(q.float(), k.float(), v.float(), q_start)
    o, lse = ops.attention_lse(q, k, v, q_start)
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), o_ref, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-5)
    o_plain = ops.attention(q, k, v, causal=True, q_start=q_start)  # SDPA for the long square case
    torch.testing.assert_close(o_plain.float(), o_ref, atol=TOL[dtype], rtol=0)
    if q_start > 0 or T < ops.SDPA_SQUARE_MIN_T:  # the same flash call: the same bits
        assert torch.equal(o_plain, o)


@pytest.mark.gpu  # PyTorch's flash kernel
def test_cuda_flash_refuses_a_misaligned_cache():
    q, k, v = _cache(8, 2, 4, 10, 64, torch.float16, "cuda")
    with pytest.raises(ValueError, match="attention over a cache"):
        ops._attention_lse_flash(q, k[:, :, :-1], v[:, :, :-1], 10)
