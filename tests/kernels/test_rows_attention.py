"""csrc_triton.rows_attention (a later turn's rows over the cache, split over the keys, the key count on the
device) against its fp32 reference and PyTorch's SDPA: GQA with power-of-two and other group sizes, rows that see
no key of a split (more splits than tiles, long turns over short caches), padded row blocks, the LSE, and one call
replayed at other cache lengths.

On CPU the kernels run under TRITON_INTERPRET=1 at small shapes; on CUDA the same cases run plus Llama-3-8B's heads
over a long cache and a CUDA-graph replay.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from csrc_triton.rows_attention import rows_attention, rows_attention_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make(H, Hkv, S, D, dtype, n, seed=0):
    """q of T rows, a cache of S slots whose first n hold keys (the rest poisoned: never read)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, Hkv, S, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(1, Hkv, S, D, generator=g).to(DEVICE, dtype)
    k[:, :, n:] = float("nan")
    v[:, :, n:] = float("nan")
    return k, v


def check(q, k, v, n, splits=None, lse=True):
    keys = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    o, got_lse = rows_attention(q, k, v, keys, lse=lse, splits=splits)
    want, want_lse = rows_attention_ref(q, k, v, keys)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o.float(), want.float(), atol=TOL[q.dtype], rtol=0)
    if lse:
        torch.testing.assert_close(got_lse, want_lse, atol=1e-3, rtol=1e-4)
    else:
        assert got_lse is None
    return o


@pytest.mark.parametrize("H,Hkv", [(4, 1), (6, 2), (7, 1), (2, 2)])
@pytest.mark.parametrize("T,n,splits", [(5, 40, 1), (5, 40, 3), (20, 150, 4), (33, 34, 8), (1, 70, 2), (70, 300, 3)])
def test_rows_attention_matches_the_reference(H, Hkv, T, n, splits):
    """Splits past a row block's keys write nothing (the workspaces start as garbage) and the merge stops before
    them; (70, 300): row blocks whose splits hold different key counts."""
    k, v = make(H, Hkv, 320, 32, torch.float16, n)
    q = torch.randn(1, H, T, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    check(q, k, v, n, splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rows_attention_reads_strided_rows_and_agrees_with_sdpa(dtype):
    """q as a (T, H, D) layout seen through a transpose (what the model passes), against SDPA with the same
    bottom-right causal mask; no LSE asked."""
    H, Hkv, T, n, D = 8, 2, 12, 100, 64
    k, v = make(H, Hkv, 128, D, dtype, n, seed=2)
    q = torch.randn(T, H, D, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype).transpose(0, 1)[None]
    o = check(q, k, v, n, splits=3, lse=False)
    mask = torch.arange(n, device=DEVICE)[None, :] <= (n - T + torch.arange(T, device=DEVICE))[:, None]
    kr, vr = (t[:, :, :n].float().repeat_interleave(H // Hkv, 1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kr, vr, attn_mask=mask)
    torch.testing.assert_close(o.float(), ref, atol=TOL[dtype], rtol=0)


def test_one_call_serves_every_cache_length():
    """The key count is read on the device: the same tensors give the right rows at 3 cache lengths."""
    H, Hkv, T, D = 4, 2, 6, 32
    k, v = make(H, Hkv, 300, D, torch.float16, 300, seed=4)
    q = torch.randn(1, H, T, D, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    for n in (6, 130, 300):
        check(q, k, v, n, splits=5)


def test_rows_attention_rejects_shapes_it_does_not_take():
    k, v = make(4, 2, 64, 48, torch.float16, 64)
    with pytest.raises(ValueError, match="not a shape it takes"):
        rows_attention(torch.zeros(1, 4, 3, 48, dtype=torch.float16, device=DEVICE), k, v,
                       torch.tensor([64], dtype=torch.int32, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [600, 51_000])
def test_llama3_heads_over_a_long_cache_and_a_graph_replay(n):
    H, Hkv, T, D = 32, 8, 64, 128
    k, v = make(H, Hkv, 52_000, D, torch.float16, 52_000, seed=6)
    q = torch.randn(1, H, T, D, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.float16)
    check(q, k, v, n)
    keys = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    rows_attention(q, k, v, keys, lse=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = rows_attention(q, k, v, keys, lse=True)
    keys.fill_(n // 2)
    graph.replay()
    want, want_lse = rows_attention_ref(q, k, v, keys)
    torch.testing.assert_close(o.float(), want.float(), atol=TOL[torch.float16], rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)
    assert math.isfinite(lse.sum().item())
