"""csrc_triton.retrieval_salience against its reference: odd lengths, GQA 1/4/7, chunked questions,
both kernels (impl "gather" and "pipe") and both forms of idx (slot tensor, range of consecutive slots).

On CPU the kernel runs under TRITON_INTERPRET=1 at small shapes; on CUDA also at Llama-3-8B shapes
(32 query heads, 8 KV heads, D=128, a 64-token question over a 32K cache).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from csrc_triton.retrieval_salience import retrieval_salience, retrieval_salience_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(B, H, Hkv, S, T, D, dtype, n_retr, seed=0):
    """A question of T rows at the end of an S-slot cache, its LSE (right-aligned causal), and
    n_retr retrievable slots drawn from before the question."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(DEVICE, dtype)
    k = (torch.randn(B, Hkv, S, D, generator=g) * 1.5).to(DEVICE, dtype)
    idx = torch.randperm(S - T, generator=g)[:n_retr].sort().values.to(DEVICE, torch.int32)
    logits = torch.einsum("bhtd,bhsd->bhts", q.double(), k.double().repeat_interleave(H // Hkv, 1)) / D**0.5
    visible = torch.arange(S, device=DEVICE)[None, :] <= (S - T + torch.arange(T, device=DEVICE))[:, None]
    lse = logits.masked_fill(~visible, float("-inf")).logsumexp(-1).float()  # (B, H, T)
    return q, k, idx, lse


def check(got, q, k, idx, lse):
    exact = retrieval_salience_ref(q.double(), k.double(), idx, lse)
    torch_err = (retrieval_salience_ref(q, k, idx, lse).double() - exact).abs().max().item()
    err = (got.double() - exact).abs().max().item()
    assert torch.isfinite(got).all()
    assert err <= 2 * torch_err + 1e-5 * exact.abs().max().item() + 1e-6, (err, torch_err)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_rep", [1, 4, 7])
@pytest.mark.parametrize("S,T,n_retr", [(40, 1, 5), (300, 7, 123), (1200, 37, 1001)])
def test_against_reference(dtype, n_rep, S, T, n_retr):
    Hkv = 2
    q, k, idx, lse = make(1, Hkv * n_rep, Hkv, S, T, 32, dtype, n_retr)
    # The kernel accumulates into `out`: start from random values so an unwritten column fails.
    prev = torch.rand(1, Hkv, n_retr, device=DEVICE) + 1
    got = retrieval_salience(q, k, idx, lse, out=prev.clone()) - prev
    check(got, q, k, idx, lse)
    if n_rep == 4 and dtype != torch.float32:  # the older S = Q K^T orientation too
        check(retrieval_salience(q, k, idx, lse, key_rows=False), q, k, idx, lse)
    # The two-half kernel, writing and adding (7 x 37 = 259 rows: two launches, the second adds).
    check(retrieval_salience(q, k, idx, lse, impl="pipe"), q, k, idx, lse)
    check(retrieval_salience(q, k, idx, lse, out=prev.clone(), impl="pipe") - prev, q, k, idx, lse)


@pytest.mark.parametrize("impl", ["gather", "pipe"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_rep,T,start,n_retr", [(4, 7, 0, 123), (7, 37, 55, 1001), (1, 1, 3, 5)])
def test_span(impl, dtype, n_rep, T, start, n_retr):
    """idx as a range: the keys are read as one contiguous block from slot `start` on, no slot loaded."""
    q, k, _, lse = make(1, 2 * n_rep, 2, 1200, T, 32, dtype, 1, seed=7)
    span = range(start, start + n_retr)
    idx = torch.arange(start, start + n_retr, device=DEVICE, dtype=torch.int32)
    got = retrieval_salience(q, k, span, lse, impl=impl)
    check(got, q, k, idx, lse)
    torch.testing.assert_close(got, retrieval_salience(q, k, idx, lse, impl=impl), rtol=0, atol=0)
    prev = torch.rand(1, 2, n_retr, device=DEVICE) + 1
    check(retrieval_salience(q, k, span, lse, out=prev.clone(), impl=impl, block_n=16, tiles=3) - prev,
          q, k, idx, lse)
    torch.testing.assert_close(retrieval_salience_ref(q.double(), k.double(), span, lse),
                               retrieval_salience_ref(q.double(), k.double(), idx, lse), rtol=0, atol=0)


def test_bad_span():
    q, k, _, lse = make(1, 2, 1, 40, 1, 16, torch.float16, 1)
    for bad in (range(0, 10, 2), range(30, 41)):  # not step 1; past the cache's 40 slots
        with pytest.raises(ValueError):
            retrieval_salience(q, k, bad, lse)


@pytest.mark.parametrize("key_rows", [True, False])
@pytest.mark.parametrize("block_m,block_n,tiles", [(16, 32, 3), (32, 16, 1), (None, 32, 4), (None, 16, 100)])
def test_tile_configs(block_m, block_n, tiles, key_rows):
    """Row blocks looped (rows > block_m) or loaded once; several key tiles per program, with a
    partial last chunk (tiles past N must not be written); both dot orientations (S^T = K Q^T, S = Q K^T)."""
    q, k, idx, lse = make(1, 6, 2, 400, 9, 32, torch.float16, 301, seed=6)
    kw = dict(block_m=block_m, block_n=block_n, tiles=tiles, key_rows=key_rows)
    got = retrieval_salience(q, k, idx, lse, **kw)
    check(got, q, k, idx, lse)
    prev = torch.rand(1, 2, 301, device=DEVICE) + 1  # accumulating: an unwritten column keeps prev
    torch.testing.assert_close(retrieval_salience(q, k, idx, lse, out=prev.clone(), **kw) - prev, got,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["gather", "pipe"])
def test_chunked_question_accumulates_to_the_whole(impl):
    q, k, idx, lse = make(2, 8, 2, 500, 21, 64, torch.float16, 217, seed=3)
    whole = retrieval_salience(q, k, idx, lse, impl=impl)
    acc = retrieval_salience(q[:, :, :8], k, idx, lse[:, :, :8], impl=impl)
    retrieval_salience(q[:, :, 8:], k, idx, lse[:, :, 8:], out=acc, impl=impl)
    torch.testing.assert_close(acc, whole, rtol=1e-5, atol=1e-6)
    check(acc, q, k, idx, lse)


@pytest.mark.parametrize("block_m,block_n,tiles,per_sm", [(16, 32, 3, None), (64, 16, 1, None), (None, 32, None, 1),
                                                         (None, 16, 100, None), (32, 64, None, 3)])
def test_pipe_configs(block_m, block_n, tiles, per_sm):
    """The two-half kernel's knobs: rows per half (a 3 x 23 = 69-row question: 16 -> three launches of
    at most 2 x 16 rows, 32 -> two, 64 and the default 128 -> one), keys per tile, tiles per program (a
    partial last chunk; 100: one chunk), programs per SM; tiling never changes a result (bit for bit)."""
    q, k, idx, lse = make(1, 6, 2, 400, 23, 32, torch.float16, 301, seed=6)
    kw = dict(impl="pipe", block_m=block_m, block_n=block_n, tiles=tiles, per_sm=per_sm)
    got = retrieval_salience(q, k, idx, lse, **kw)
    check(got, q, k, idx, lse)
    prev = torch.rand(1, 2, 301, device=DEVICE) + 1  # adding: an unwritten column keeps prev
    torch.testing.assert_close(retrieval_salience(q, k, idx, lse, out=prev.clone(), **kw) - prev, got,
                               rtol=1e-5, atol=1e-6)
    if block_m is None:
        torch.testing.assert_close(got, retrieval_salience(q, k, idx, lse, impl="pipe", block_n=block_n, tiles=100),
                                   rtol=0, atol=0)


def test_salience_mass():
    """With every pre-question key retrievable, the mass is each row's attention outside the question."""
    S, T = 129, 5
    q, k, _, lse = make(1, 4, 1, S, T, 16, torch.float16, 1, seed=4)
    # Make every key before the question retrievable: each row's mass on them is 1 - mass on the question.
    idx = torch.arange(S - T, device=DEVICE, dtype=torch.int32)
    got = retrieval_salience(q, k, idx, lse)
    assert got.shape == (1, 1, S - T) and (got > 0).all()
    check(got, q, k, idx, lse)
    assert got.sum().item() < 4 * T


@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("kw", [{}, dict(block_m=128, block_n=64, tiles=4, num_warps=4),
                                dict(block_n=32, tiles=8, key_rows=False), dict(block_n=128, tiles=1, num_stages=3),
                                dict(block_n=128, key_rows=True), dict(block_n=64, key_rows=False)])
def test_llama3_8b_shapes(kw):
    q, k, idx, lse = make(1, 32, 8, 32768 + 64, 64, 128, torch.float16, 30000)
    check(retrieval_salience(q, k, idx, lse, **kw), q, k, idx, lse)


@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("T", [16, 64, 256])
@pytest.mark.parametrize("impl", ["gather", "pipe"])
def test_llama3_8b_shapes_pipe_and_span(impl, T):
    """Both kernels at Llama-3-8B shapes, slot tensor and range, writing and adding (T=256: the pipe
    kernel's four 64-token launches)."""
    q, k, idx, lse = make(1, 32, 8, 32768 + 64, T, 128, torch.float16, 30000)
    check(retrieval_salience(q, k, idx, lse, impl=impl), q, k, idx, lse)
    span = range(1000, 31000)
    prev = torch.rand(1, 8, len(span), device=DEVICE) + 1
    got = retrieval_salience(q, k, span, lse, out=prev.clone(), impl=impl) - prev
    check(got, q, k, torch.arange(1000, 31000, device=DEVICE), lse)
