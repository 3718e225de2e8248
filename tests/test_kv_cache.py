"""KVCache storage and the layer-batched question packing: per-layer views of one (n_layers, ...)
tensor per K and V, and `Retrieval.pack` (one selection over stacked scores, one pack of all layers' K and V)
equal to selecting and gathering layer by layer; the packed buffer's sizing (`Retrieval.room`) and growth
(`Retrieval.ensure_room`)."""

import pytest
import torch

from tinyvila import ops
from tinyvila.config import TextConfig
from tinyvila.kv_cache import KVCache
from tinyvila.retrieval import PACKED_ROOM, Retrieval, decode_select, packed_slots

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


def score_question(ret, q_from, length, seed=1):
    """A scored question (Retrieval `ret`): random salience for every layer, as the prefill's kernels would
    leave."""
    n = ret.begin_scoring(q_from)
    g = torch.Generator().manual_seed(seed)
    ret.scoring.scores.copy_(torch.rand(ret.scoring.scores.shape, generator=g))
    ret.scoring.scored = [True] * ret.cache.n_layers
    return n


@pytest.mark.parametrize("window", [0, 3])
def test_batched_pack_equals_layer_by_layer(window):
    cache = filled_cache()
    cache.add_span("system", 0, 3)
    cache.add_span("visual", 3, 20)
    cache.add_span("question", 20, 24)
    cache.add_span("text", 24, 40, retrievable=True)  # a document: windowed selection
    cache.add_span("question", 40, 46)
    ret = Retrieval(cache)
    n = score_question(ret, 40, 46)
    assert n == 17 + 16
    sc = ret.scoring
    scores, slots, windowed = sc.scores.clone(), sc.idx.clone(), sc.windowed
    rows = ret.pack(0.25, 46, window=window)
    n_keep = round(0.25 * n)
    assert rows == 46 - n + n_keep and ret.packed.idx.shape == (3, 2, 2, rows)
    retrievable = set(slots.tolist())
    others = [s for s in range(46) if s not in retrievable]
    for layer in range(3):
        top = decode_select(scores[layer], n_keep, slots, window, windowed)  # (B, Hkv, n_keep)
        for b in range(2):
            for h in range(2):
                want = torch.tensor(sorted(others + slots[top[b, h]].tolist()))
                assert torch.equal(ret.packed.idx[layer, b, h].long(), want)
                pk, pv = ret.packed.layer(layer)
                assert torch.equal(pk[b, h, :rows], cache.k[layer][b, h, want])
                assert torch.equal(pv[b, h, :rows], cache.v[layer][b, h, want])
    assert ret.packed.rows == rows and ret.packed.dropped == 46 - rows


def test_pack_needs_every_layer_scored():
    cache = filled_cache(batch=1)
    cache.add_span("visual", 0, 10)
    ret = Retrieval(cache)
    score_question(ret, 10, 12)
    ret.scoring.scored[2] = False
    with pytest.raises(RuntimeError, match="scored question"):
        ret.pack(0.5, 12)


def test_packed_buffers_are_reused_across_turns():
    cache = filled_cache(batch=1)
    cache.add_span("visual", 0, 30)
    ret = Retrieval(cache)
    score_question(ret, 30, 34)
    ret.pack(0.5, 34)
    first = ret.packed.k_stack
    ret.unpack()
    assert ret.packed is None
    score_question(ret, 30, 36, seed=2)
    ret.pack(0.5, 36)  # needs no more capacity than the first turn: same storage
    assert ret.packed.k_stack is first and ret.packed.layer(0)[0].data_ptr() == first[0].data_ptr()


def test_retrieval_room_sizes_the_buffer_to_a_power_of_two_within_the_cache():
    cache = filled_cache(batch=1)  # max_seq_len: see filled_cache
    cache.add_span("visual", 0, 30)
    assert Retrieval(cache).room == PACKED_ROOM
    ret = Retrieval(cache, room=5)
    score_question(ret, 30, 34)
    rows = ret.pack(0.5, 34)
    assert rows == 19 and ret.packed.layer(0)[0].shape[2] == 32  # 19 rows + 5: the next power of two
    assert ret.packed.k_stack.shape[3] == ret.packed.capacity == 32
    ret = Retrieval(cache, room=10 * cache.max_seq_len)
    score_question(ret, 30, 34, seed=3)
    whole = cache.max_seq_len - 34 + rows  # room past the cache's own: capped there
    assert ret.pack(0.5, 34) == rows and ret.packed.layer(0)[0].shape[2] == ret.packed.capacity == whole


def test_ensure_room_grows_the_buffer_by_repacking_from_the_full_cache():
    """Decode steps that would run past the packed buffer grow it (a new, larger allocation: a new generation)
    holding the packed rows, then every slot the turn appended since, each from the full cache; the selection and
    its bookkeeping stay. Steps that still fit change nothing."""
    cache = KVCache(CFG, batch=1, max_seq_len=128, dtype=torch.float32)  # room to grow past a power of two
    g = torch.Generator().manual_seed(0)
    cache.k_stack.copy_(torch.randn(cache.k_stack.shape, generator=g))
    cache.v_stack.copy_(torch.randn(cache.v_stack.shape, generator=g))
    cache.add_span("visual", 0, 30)
    ret = Retrieval(cache, room=5)
    score_question(ret, 30, 34)
    rows = ret.pack(0.5, 34)
    old = ret.packed
    idx, gen = old.idx.clone(), old.generation
    assert (rows, old.capacity, old.dropped) == (19, 32, 15)
    ret.ensure_room(34, 32 - 19)  # exactly fills it
    assert ret.packed is old and ret.packed.capacity == 32
    ret.ensure_room(40, 32 - 25 + 1)  # six tokens decoded since, eight more: one row past the buffer
    p = ret.packed
    assert p is not old and p.generation > gen and p.capacity == packed_slots(40 - 15 + 8, 0) == 64
    assert (p.rows, p.dropped, p.kept) == (old.rows, old.dropped, old.kept) and torch.equal(p.idx, idx)
    for layer in range(cache.n_layers):
        pk, pv = p.layer(layer)
        for h in range(cache.n_kv_heads):  # per layer and KV head: its packed rows, then the turn's 6 tokens
            slots = torch.cat([idx[layer, 0, h].long(), torch.arange(34, 40)])
            assert torch.equal(pk[0, h, :25], cache.k[layer][0, h, slots])
            assert torch.equal(pv[0, h, :25], cache.v[layer][0, h, slots])
    ret.ensure_room(40, 64 - 25)  # fits the grown buffer: nothing changes
    assert ret.packed is p
    ret.ensure_room(40, 128 - 40)  # to the end of the cache: capped there (rows + the cache's room past the turn)
    assert ret.packed.capacity == 19 + 128 - 34 and torch.equal(ret.packed.layer(2)[1][:, :, :25], p.layer(2)[1][:, :, :25])
    ret.unpack()
    ret.ensure_room(40, 100)  # no packed buffer: nothing to grow
    assert ret.packed is None


# -- retrieval scoring: one run of slots is scored as a range (the kernel's contiguous-span form) -------------
@pytest.mark.parametrize("spans,q_from,want", [
    ([("system", 0, 3), ("visual", 3, 20)], 24, range(3, 20)),                    # one image
    ([("visual", 3, 10), ("visual", 10, 20)], 24, range(3, 20)),                  # two adjacent images: one run
    ([("visual", 3, 20), ("question", 20, 24), ("text", 24, 40)], 44, None),      # image + document: two runs
    ([("visual", 3, 20), ("visual", 22, 30)], 30, None),                          # two images apart
    ([("visual", 3, 20), ("question", 20, 24), ("visual", 24, 40)], 24, range(3, 20)),  # the second is not scored
    ([("text", 5, 30)], 18, range(5, 18)),                                        # cut at q_from
])
def test_scoring_takes_a_range_exactly_when_the_slots_are_one_run(spans, q_from, want):
    cache = filled_cache(batch=1)
    for kind, a, b in spans:
        cache.add_span(kind, a, b, retrievable=kind in ("visual", "text"))
    ret = Retrieval(cache)
    n = ret.begin_scoring(q_from)
    sc = ret.scoring
    assert sc.span == want
    assert sc.kernel_idx is (sc.idx if want is None else sc.span)
    if want is not None:  # the same slots in the same order as the slot tensor (which pack() still uses)
        assert n == len(want) and sc.idx.tolist() == list(want)


def scored(ret, q, lse, q_from, chunks, tensor=False):
    """Scores of every layer (Retrieval `ret`) for question rows q (B, H, T, D) from slot q_from, prefilled in
    `chunks` (row counts), through the range when the slots are one run (unless `tensor`) -> (scores, idx args)."""
    calls = []
    real = ops.retrieval_salience
    cache = ret.cache

    def spy(q, k, idx, lse, out=None, **kw):
        calls.append(idx)
        return real(q, k, idx, lse, out=out, **kw)

    n = ret.begin_scoring(q_from)
    if tensor:
        ret.scoring.span = None
    ops.retrieval_salience = spy
    try:
        start = q_from
        for T in chunks:
            rows = slice(start - q_from, start - q_from + T)
            for layer in range(cache.n_layers):
                ret.scoring.add(layer, start, q[:, :, rows], cache.k[layer][:, :, :start + T], lse[layer][:, :, rows])
            start += T
    finally:
        ops.retrieval_salience = real
    assert all(ret.scoring.scored) and n == ret.scoring.idx.numel()
    return ret.scoring.scores.clone(), calls


@pytest.mark.parametrize("two_spans", [False, True])
@pytest.mark.parametrize("chunks", [[6], [2, 4]])
def test_range_scores_and_selection_equal_the_slot_tensor_ones(two_spans, chunks):
    """A one-run cache scores through a range and gets the slot tensor's scores and selection bit for bit
    (also accumulated over question chunks); a two-run cache keeps the tensor. On CPU the scores come from
    the PyTorch reference (the kernels' range and gather forms: the GPU test below and
    tests/kernels/test_retrieval_salience.py::test_span)."""
    g = torch.Generator().manual_seed(3)
    q, lse = torch.randn(1, 4, 6, 16, generator=g), torch.randn(3, 1, 4, 6, generator=g).abs() + 3
    results = []
    for tensor in (False, True):
        cache = filled_cache(batch=1)
        cache.add_span("system", 0, 3)
        cache.add_span("visual", 3, 20)
        if two_spans:
            cache.add_span("question", 20, 24)
            cache.add_span("text", 24, 40, retrievable=True)
        q_from = 40 if two_spans else 20
        ret = Retrieval(cache)
        scores, calls = scored(ret, q, lse, q_from, chunks, tensor)
        assert len(calls) == 3 * len(chunks)
        assert all(isinstance(c, range) != (tensor or two_spans) for c in calls)
        ret.pack(0.3, q_from + 6, window=2)
        results.append((scores, ret.packed.idx.clone(), ret.packed.k_stack[:, :, :, :ret.packed.rows].clone()))
    (s0, i0, k0), (s1, i1, k1) = results
    assert s0.min() > 0 and torch.equal(s0, s1) and torch.equal(i0, i1) and torch.equal(k0, k1)


@pytest.mark.gpu
@pytest.mark.parametrize("T,chunks", [(16, [16]), (64, [64]), (96, [64, 32]), (80, [80]), (256, [256])])
def test_range_kernel_scores_equal_the_slot_tensor_ones_on_the_gpu(T, chunks):
    """The Triton kernel at Llama-3-8B's head geometry (32 query / 8 KV heads of 128, fp16), through the
    runtime's scoring call: the range form (keys read as one block) gives the gather form's scores and
    selection bit for bit, for the one-block kernel (n_rep * T <= 256 rows, also a question in two chunks)
    and the pipe kernel (T=80: 320 rows; T=256: 1024 rows, four launches)."""
    cfg = TextConfig(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, max_seq_len=4096)
    g = torch.Generator().manual_seed(0)
    q_from, n_vis = 1500, 1470
    q = (torch.randn(1, 32, T, 128, generator=g) * 0.5).half().cuda()
    results = []
    for tensor in (False, True):
        cache = KVCache(cfg, dtype=torch.float16, device="cuda")
        cache.k_stack.copy_(torch.randn(cache.k_stack.shape, generator=torch.Generator().manual_seed(1)).half())
        cache.add_span("system", 0, 30)
        cache.add_span("visual", 30, 30 + n_vis)
        # the rows' true log-sum-exp over the keys they attend (the prefill attention's), so masses are O(1)
        lse = []
        for layer in range(2):
            k = cache.k[layer][:, :, :q_from + T].repeat_interleave(4, dim=1).float()
            s = q.float() @ k.transpose(-1, -2) / 128 ** 0.5
            lse.append(torch.logsumexp(s, -1))
        ret = Retrieval(cache)
        scores, calls = scored(ret, q, lse, q_from, chunks, tensor)
        assert all(isinstance(c, range) != tensor for c in calls)
        ret.pack(0.25, q_from + T)
        results.append((scores, ret.packed.idx.clone()))
    (s0, i0), (s1, i1) = results
    assert s0.sum() > 0 and torch.equal(s0, s1) and torch.equal(i0, i1)


def test_packed_slots_is_the_next_power_of_two_that_holds_the_turn():
    assert packed_slots(4046, 50) == 4096  # exactly full: no doubling
    assert packed_slots(4047, 50) == 8192
    assert packed_slots(3277, 50) == 4096 and packed_slots(8192, 50) == 16384
    assert packed_slots(7, 0) == 8  # a turn appends at least the one token its first step writes
    assert packed_slots(1, 1) == 2


def test_retrievable_slots_of_many_spans_in_order():
    """The retrievable slots of every retrievable span (cut at `end`), in span order, as int32."""
    cfg = TextConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=50, max_seq_len=400)
    cache = KVCache(cfg)
    cache.add_span("system", 0, 3)
    want = []
    for a in range(3, 300, 9):  # 33 frames of 7 visual slots, each followed by 2 text slots
        cache.add_span("visual", a, a + 7)
        cache.add_span("text", a + 7, a + 9)
        want += range(a, a + 7)
    cache.add_span("text", 300, 320, retrievable=True)  # a document
    got = cache.retrievable_slots()
    assert got.dtype == torch.int32 and got.tolist() == want + list(range(300, 320))
    assert cache.retrievable_slots(end=310).tolist() == want + list(range(300, 310))
    assert cache.retrievable_slots(end=5).tolist() == [3, 4]
    assert cache.retrievable_slots(end=0).numel() == 0  # end 0 is "before slot 0", not "no end"
    assert KVCache(cfg).retrievable_slots().numel() == 0


@pytest.mark.parametrize("spans,q_from", [
    ([("system", 0, 3), ("visual", 3, 20), ("question", 20, 24)], 24),                    # one run
    ([("visual", 3, 10), ("visual", 10, 20), ("question", 20, 24)], 24),                  # two adjacent: one run
    ([("visual", 3, 20), ("question", 20, 24), ("text", 24, 40), ("question", 40, 44)], 44),  # two runs, a text one
    ([("visual", 22, 30), ("visual", 3, 20), ("question", 30, 34)], 34),                  # out of order
    ([("text", 5, 30)], 18),                                                              # cut at q_from
])
def test_scoring_state_matches_the_slot_list(spans, q_from):
    """begin_scoring's slots (device and host), window mask and span, and pack's rows, equal what the plain slot
    list gives: the retrievable slots before q_from in span order, the text ones marked, the rest in order."""
    cache = filled_cache(batch=1)
    for kind, a, b in spans:
        cache.add_span(kind, a, b, retrievable=kind in ("visual", "text"))
    want = [s for kind, a, b in spans if kind in ("visual", "text") for s in range(a, min(b, q_from)) if a < q_from]
    text = {s for kind, a, b in spans if kind == "text" for s in range(a, b)}
    ret = Retrieval(cache)
    n = score_question(ret, q_from, q_from + 4)
    sc = ret.scoring
    assert n == len(want) and sc.idx.dtype == sc.host_idx.dtype == torch.int32
    assert sc.idx.tolist() == sc.host_idx.tolist() == want == cache.retrievable_slots(q_from).tolist()
    assert (sc.windowed is None) == (not text & set(want))
    if sc.windowed is not None:
        assert sc.windowed.tolist() == [s in text for s in want]
    assert sc.span == (range(want[0], want[-1] + 1) if want == list(range(want[0], want[-1] + 1)) else None)
    rows = ret.pack(1.0, q_from + 4)  # everything kept: the packed slots are all of 0..length-1, in order
    assert rows == q_from + 4 and ret.packed.idx[0, 0, 0].tolist() == list(range(q_from + 4))
