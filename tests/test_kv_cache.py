"""KVCache storage and the layer-batched question packing: per-layer views of one (n_layers, ...)
tensor per K and V, and `pack` (one selection over stacked scores, one pack of all layers' K and V)
equal to selecting and gathering layer by layer."""

import pytest
import torch

from tinyvila.config import TextConfig
from tinyvila.kv_cache import KVCache
from tinyvila.sparsity import decode_select

CFG = TextConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64)


def filled_cache(batch=2, seed=0) -> KVCache:
    cache = KVCache(CFG, batch=batch, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    cache.k_stack.copy_(torch.randn(cache.k_stack.shape, generator=g))
    cache.v_stack.copy_(torch.randn(cache.v_stack.shape, generator=g))
    return cache


def test_layers_are_views_of_one_tensor():
    cache = filled_cache()
    assert cache.k_stack.shape == (3, 2, 2, 64, 16) and len(cache.k) == len(cache.v) == 3
    k, v = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    cache.write(1, 7, k, v)
    assert torch.equal(cache.k_stack[1, :, :, 7:12], k) and torch.equal(cache.v_stack[1, :, :, 7:12], v)
    assert cache.k[2].data_ptr() == cache.k_stack[2].data_ptr()


def score_question(cache, q_from, length, seed=1):
    """A scored question: random salience for every layer, as the prefill's kernels would leave."""
    n = cache.begin_scoring(q_from)
    g = torch.Generator().manual_seed(seed)
    cache.scoring.scores.copy_(torch.rand(cache.scoring.scores.shape, generator=g))
    cache.scoring.scored = [True] * cache.n_layers
    return n


@pytest.mark.parametrize("window", [0, 3])
def test_batched_pack_equals_layer_by_layer(window):
    cache = filled_cache()
    cache.add_span("system", 0, 3)
    cache.add_span("visual", 3, 20)
    cache.add_span("question", 20, 24)
    cache.add_span("text", 24, 40, retrievable=True)  # a document: windowed selection
    cache.add_span("question", 40, 46)
    n = score_question(cache, 40, 46)
    assert n == 17 + 16
    sc = cache.scoring
    scores, slots, windowed = sc.scores.clone(), sc.idx.clone(), sc.windowed
    rows = cache.pack(0.25, 46, window=window)
    n_keep = round(0.25 * n)
    assert rows == 46 - n + n_keep and cache.packed.idx.shape == (3, 2, 2, rows)
    retrievable = set(slots.tolist())
    others = [s for s in range(46) if s not in retrievable]
    for layer in range(3):
        top = decode_select(scores[layer], n_keep, slots, window, windowed)  # (B, Hkv, n_keep)
        for b in range(2):
            for h in range(2):
                want = torch.tensor(sorted(others + slots[top[b, h]].tolist()))
                assert torch.equal(cache.packed.idx[layer, b, h].long(), want)
                assert torch.equal(cache.packed.k[layer][b, h, :rows], cache.k[layer][b, h, want])
                assert torch.equal(cache.packed.v[layer][b, h, :rows], cache.v[layer][b, h, want])
    assert cache.packed.rows == rows and cache.packed.dropped == 46 - rows


def test_pack_needs_every_layer_scored():
    cache = filled_cache(batch=1)
    cache.add_span("visual", 0, 10)
    score_question(cache, 10, 12)
    cache.scoring.scored[2] = False
    with pytest.raises(RuntimeError, match="scored question"):
        cache.pack(0.5, 12)


def test_packed_buffers_are_reused_across_turns():
    cache = filled_cache(batch=1)
    cache.add_span("visual", 0, 30)
    score_question(cache, 30, 34)
    cache.pack(0.5, 34)
    first = cache.packed.k_stack
    cache.unpack()
    score_question(cache, 30, 36, seed=2)
    cache.pack(0.5, 36)  # needs no more capacity than the first turn: same storage
    assert cache.packed.k_stack is first and cache.packed.k[0].data_ptr() == first[0].data_ptr()
