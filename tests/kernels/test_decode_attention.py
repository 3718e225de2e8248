"""csrc_triton.decode_attention against its reference: lengths 1..5000, GQA, split counts, fp16/bf16,
the fused split merge (last-arriving program, self-resetting counters) and the two-kernel merge, each
with 0, 2 and 4 K/V tiles prefetched into L2 (the interpreter runs the prefetch's addressing, not its
asm), and the prefetch rule of the launch config by buffer length.

On CPU the kernel runs under TRITON_INTERPRET=1 at small head counts; on CUDA the same cases run
plus Llama-3-8B shapes (32 query heads, 8 KV heads, D=128) and a CUDA-graph replay.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from csrc_triton.decode_attention import _COUNTERS, decode_attention, decode_attention_ref, default_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
PREFETCH = (0, 2, 4)  # K/V tiles of each split asked into L2 before the PDL wait (CONFIG_BY_LENGTH uses 0, 2)


def make(B, H, Hkv, L_max, D, dtype, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Hkv, L_max, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, L_max, D, generator=g).to(DEVICE, dtype)
    for b, n in enumerate(lengths):  # slots past the length must never be read
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return q, k, v, torch.tensor(lengths, dtype=torch.int32, device=DEVICE)


def check(q, k, v, lens, **kw):
    out = torch.full_like(q, float("nan"))  # poisoned: unwritten elements fail
    got = decode_attention(q, k, v, lens, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    exact = decode_attention_ref(q.double(), k.double(), v.double(), lens)
    torch_err = (decode_attention_ref(q, k, v, lens).double() - exact).abs().max().item()
    err = (got.double() - exact).abs().max().item()
    assert torch.isfinite(got).all()
    assert err <= 2 * torch_err + FLOOR[q.dtype], (err, torch_err)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths,n_splits", [
    ([1, 5], 1), ([1, 5], 4), ([123, 64], 3), ([217, 1], 8), ([3000, 1000], 16), ([5000, 4097], 7),
])
def test_lengths_and_splits(dtype, lengths, n_splits, prefetch):
    q, k, v, lens = make(2, 4, 1, max(lengths) + 9, 64, dtype, lengths)
    check(q, k, v, lens, n_splits=n_splits, prefetch=prefetch)


@pytest.mark.parametrize("prefetch", PREFETCH)
@pytest.mark.parametrize("lengths,n_splits,block_n", [
    ([217, 1], 8, 32), ([1000, 300], 5, 64), ([300, 129], 3, 128), ([2000, 77], 40, 16),
])
def test_prefetch_counts(prefetch, lengths, n_splits, block_n):
    """Each prefetch count on whole and partial tiles, splits shorter and longer than the prefetched
    tiles, empty splits, one key, and 40 splits (more than the merge takes in one round trip at D = 64:
    the stepped merge runs)."""
    q, k, v, lens = make(2, 8, 2, max(lengths) + 5, 64, torch.bfloat16, lengths, seed=11)
    check(q, k, v, lens, n_splits=n_splits, block_n=block_n, prefetch=prefetch)


@pytest.mark.parametrize("lengths,n_splits", [([217, 1], 8), ([1000, 300], 5)])
def test_two_kernel_merge(lengths, n_splits):
    q, k, v, lens = make(2, 8, 2, max(lengths) + 9, 64, torch.bfloat16, lengths, seed=7)
    check(q, k, v, lens, n_splits=n_splits, fused=False)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_fused_merge_leaves_its_counters_at_zero(prefetch):
    """Each call must reset what it counted, else the next call (or graph replay) never merges and
    leaves the poisoned output unwritten; 20 splits (2 merge steps at D=128, one of them empty)
    and 3 heads per group."""
    q, k, v, lens = make(1, 6, 2, 300, 128, torch.float16, [300], seed=5)
    for n_splits in (20, 3, 20):
        check(q, k, v, lens, n_splits=n_splits, block_n=16, prefetch=prefetch)
        assert not _COUNTERS[str(q.device)].any()


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("H,Hkv,D", [(4, 4, 32), (8, 2, 64), (7, 1, 16), (12, 3, 80)])
def test_gqa_ratios_and_head_dims(H, Hkv, D, prefetch):
    q, k, v, lens = make(1, H, Hkv, 300, D, torch.float16, [257])
    check(q, k, v, lens, n_splits=3, prefetch=prefetch)


@pytest.mark.parametrize("block_n,lengths", [(16, [77, 300]), (32, [300, 1]), (128, [129, 300])])
def test_tile_sizes(block_n, lengths):
    q, k, v, lens = make(2, 8, 2, 300, 64, torch.float16, lengths, seed=3)
    check(q, k, v, lens, n_splits=5, block_n=block_n)


def test_sampled_lengths_default_splits():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 5001, (3,), generator=g).tolist()
    q, k, v, lens = make(3, 2, 1, 5000, 32, torch.bfloat16, lengths, seed=2)
    check(q, k, v, lens)


@pytest.mark.parametrize("per_sm", [1, 2, 4])
@pytest.mark.parametrize("n_programs", [1, 3, 8, 9])
def test_default_splits_fit_one_wave(per_sm, n_programs):
    """The split count never launches more programs than the SMs hold at once (a second wave of a
    few programs would double the time of the ones in it)."""
    from csrc_triton.decode_attention import _sm_count, default_splits

    dev = torch.device(DEVICE)
    for max_len in (128, 1000, 8192, 1 << 17):
        splits = default_splits(max_len, n_programs, dev, per_sm)
        assert splits >= 1
        if splits > 1:
            assert splits * n_programs <= per_sm * _sm_count(dev)


@pytest.mark.parametrize("prefetch", PREFETCH)
def test_length_is_read_from_the_device_tensor(prefetch):
    q, k, v, lens = make(1, 4, 2, 200, 32, torch.float16, [200])
    a = decode_attention(q, k, v, lens, n_splits=4, prefetch=prefetch)
    lens.fill_(37)
    b = decode_attention(q, k, v, lens, n_splits=4, prefetch=prefetch)
    torch.testing.assert_close(b, decode_attention_ref(q.float(), k.float(), v.float(), lens).half(),
                               atol=2e-3, rtol=0)
    assert not torch.allclose(a, b)


def test_config_rule_by_buffer_length():
    """CONFIG_BY_LENGTH's rows (H200 sessions 7 and 11): 128-key tiles prefetching 2 below 2K slots, 64-key
    tiles without prefetch in [2K, 6K), 128-key tiles without prefetch in [6K, 16K) and with 2 up to 32K,
    64-key tiles with 4 stages beyond; the first row that covers a length applies."""
    picks = {n: default_config(n) for n in (1, 1024, 2047, 2048, 4096, 6143, 6144, 8192, 16383, 16384, 32768,
                                            32769, 131072)}
    small, mid, big = (128, 4, 3, 1, 2), (64, 4, 3, 1, 0), (128, 4, 3, 1, 0)
    assert picks == {1: small, 1024: small, 2047: small, 2048: mid, 4096: mid, 6143: mid, 6144: big, 8192: big,
                     16383: big, 16384: small, 32768: small, 32769: (64, 4, 4, 1, 2), 131072: (64, 4, 4, 1, 2)}


@pytest.mark.gpu  # real shapes and CUDA graphs
@pytest.mark.parametrize("prefetch", [None, 0, 2, 4])  # None: the launch config's count for the buffer
@pytest.mark.parametrize("L", [1, 1000, 3277, 8191, 32768])
def test_llama3_8b_shapes(L, prefetch):
    q, k, v, lens = make(1, 32, 8, L + 64, 128, torch.float16, [L])
    check(q, k, v, lens, prefetch=prefetch)


@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n_splits", [2, 16, 64, 200])
def test_fused_merge_under_many_arrival_orders(n_splits, prefetch):
    """On the GPU any program of a group can arrive last: back-to-back calls at many lengths."""
    q, k, v, lens = make(1, 32, 8, 20000, 128, torch.float16, [20000])
    for n in (20000, 8191, 4097, 129, 64, 1):
        lens.fill_(n)
        check(q, k, v, lens, n_splits=n_splits, prefetch=prefetch)
    assert not _COUNTERS[str(q.device)].any()


@pytest.mark.gpu  # CUDA graphs
@pytest.mark.parametrize("prefetch", [0, 2])
def test_cuda_graph_replay_follows_the_length(prefetch):
    q, k, v, lens = make(1, 32, 8, 4096, 128, torch.bfloat16, [4096])
    out = torch.empty_like(q)
    decode_attention(q, k, v, lens, out=out, prefetch=prefetch)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k, v, lens, out=out, prefetch=prefetch)
    for n in (4096, 1000, 17):
        lens.fill_(n)
        graph.replay()
        torch.testing.assert_close(out.float(), decode_attention_ref(q.float(), k.float(), v.float(), lens),
                                   atol=2e-2, rtol=0)
