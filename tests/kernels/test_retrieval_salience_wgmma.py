"""csrc_triton.retrieval_salience_wgmma (Gluon, sm_90 only) against the reference, and the dispatch to it.

Gluon kernels have no interpreter form, so the kernel tests run on a Hopper GPU only (skipped elsewhere: the
Triton kernels, tested everywhere in test_retrieval_salience.py, are what runs there). The dispatch rules and the
row-flattening check are plain Python and run everywhere.
"""

import os

import pytest
import torch
import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from csrc_triton import retrieval_salience as rs  # noqa: E402
from test_retrieval_salience import check, make  # noqa: E402

ON_HOPPER = (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
             and triton.__version__.startswith("3.6."))
hopper = pytest.mark.skipif(not ON_HOPPER, reason="Gluon wgmma kernel: needs an sm_90 GPU and Triton 3.6")
FORMS = ["pingpong", "halves"]


def run(q, k, span, lse, form, out=None, **kw):
    """The Gluon kernel in `form` through retrieval_salience's impl "wgmma" (which checks the call first)."""
    from csrc_triton import retrieval_salience_wgmma as rw

    saved, rw.FORM = rw.FORM, form
    try:
        return rs.retrieval_salience(q, k, span, lse, out=out, impl="wgmma", **kw)
    finally:
        rw.FORM = saved


@hopper
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_rep", [1, 4, 7])
@pytest.mark.parametrize("S,T,span", [(40, 1, range(0, 37)), (300, 7, range(5, 128)), (1300, 37, range(3, 1204))])
def test_against_reference(form, dtype, n_rep, S, T, span):
    """Odd spans (partial last tiles), GQA 1/4/7 (7 x 37 = 259 rows: two launches, the second adds), writing and
    adding into `out`."""
    q, k, _, lse = make(1, 2 * n_rep, 2, S, T, 128, dtype, 1)
    idx = torch.arange(span.start, span.stop, device="cuda")
    check(run(q, k, span, lse, form), q, k, idx, lse)
    prev = torch.rand(1, 2, len(span), device="cuda") + 1  # random: an unwritten column fails
    check(run(q, k, span, lse, form, out=prev.clone()) - prev, q, k, idx, lse)


@hopper
@pytest.mark.parametrize("form", FORMS)
def test_head_dim_64_batches_and_cache_views(form):
    """D = 64; two batches; the keys a slice of a longer cache (its rows flatten with the longer stride); a span
    that ends at the cache's last slot (the last tile reads past the descriptor: zeros)."""
    q, k, _, lse = make(2, 8, 2, 700, 5, 64, torch.float16, 1, seed=3)
    big = torch.randn(2, 2, 1000, 64, device="cuda", dtype=torch.float16)
    big[:, :, :700] = k
    view = big[:, :, :700]
    for span in (range(0, 695), range(600, 700), range(17, 18)):
        idx = torch.arange(span.start, span.stop, device="cuda")
        check(run(q, view, span, lse, form), q, k, idx, lse)
        check(run(q, k, span, lse, form), q, k, idx, lse)


@hopper
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T", [16, 64, 256])
def test_llama3_8b_shapes(form, T):
    """32 query heads, 8 KV heads, D = 128 over a 32K cache (T = 256: four 64-token launches), every tile count
    of the default tiling and a few of its own."""
    q, k, _, lse = make(1, 32, 8, 32768 + T, T, 128, torch.float16, 1)
    span = range(0, 32768)
    idx = torch.arange(32768, device="cuda")
    check(run(q, k, span, lse, form), q, k, idx, lse)
    if T == 64:
        for tiles in (1, 3, 7):
            check(run(q, k, span, lse, form, tiles=tiles), q, k, idx, lse)
        span = range(1000, 31000)
        prev = torch.rand(1, 8, len(span), device="cuda") + 1
        check(run(q, k, span, lse, form, out=prev.clone()) - prev, q, k, torch.arange(1000, 31000, device="cuda"), lse)


@hopper
def test_default_dispatch():
    """A span call with no impl or tile runs the Gluon kernel (the same bits as impl "wgmma"); slot tensors, fp32
    caches, tile knobs and USE_WGMMA off run the Triton kernels."""
    q, k, _, lse = make(1, 8, 2, 500, 6, 128, torch.float16, 1)
    span = range(4, 480)
    assert rs._wgmma_ok(q, k, span, None)
    assert torch.equal(rs.retrieval_salience(q, k, span, lse), run(q, k, span, lse, "pingpong"))
    assert not rs._wgmma_ok(q, k, torch.arange(4, 480, device="cuda"), None)
    assert not rs._wgmma_ok(q.float(), k.float(), span, None)
    with rs_triton_only():
        assert not rs._wgmma_ok(q, k, span, None)


class rs_triton_only:
    def __enter__(self):
        self.saved, rs.USE_WGMMA = rs.USE_WGMMA, False

    def __exit__(self, *exc):
        rs.USE_WGMMA = self.saved


def test_off_the_gpu():
    """Under the interpreter or off an sm_90 GPU no call dispatches to the Gluon kernel, and asking for it is a
    clear error."""
    if ON_HOPPER:
        pytest.skip("checks the dispatch where the Gluon kernel cannot run")
    q, k, _, lse = make(1, 4, 1, 50, 2, 64, torch.float16, 1)
    assert not rs._wgmma_ok(q, k, range(0, 40), None)
    with pytest.raises(ValueError, match="wgmma"):
        rs.retrieval_salience(q, k, range(0, 40), lse, impl="wgmma")


def test_flat_rows():
    """Rows flatten to (b * Hkv + g) * slots + slot for a contiguous cache and for slices of one along S; not for
    a transposed or head-interleaved layout."""
    from csrc_triton.retrieval_salience_wgmma import _flat_rows

    cache = torch.empty(2, 8, 1000, 128)
    assert _flat_rows(cache) == 1000
    assert _flat_rows(cache[:, :, 10:700]) == 1000
    assert _flat_rows(cache[:1, :1, :300]) == 300
    assert _flat_rows(torch.empty(3, 1, 50, 64)) == 50
    assert _flat_rows(torch.empty(2, 1000, 8, 128).transpose(1, 2)) is None  # (B, S, Hkv, D) storage
    assert _flat_rows(cache[:, ::2]) == 2000  # every other head: still one stride between (b, g) neighbours
    assert _flat_rows(cache[:, :4]) is None  # 4 of 8 heads: a batch is 8 groups on, not 4
