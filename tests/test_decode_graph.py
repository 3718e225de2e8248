"""Decode steps from device state (tinyvila/generate.py): batched greedy decoding, chunked prefill,
and CUDA-graph replay equal to the same step run eagerly.

On CPU the device-state step runs eagerly (the same code the graph captures) and is checked against a
full forward and against one-token-at-a-time decoding; the replay tests need CUDA.
"""

import dataclasses

import pytest
import torch

from tinyvila.api import from_config
from tinyvila.config import QuantConfig, SparsityConfig, preset
from tinyvila.generate import Decoder, SamplingParams, generate
from tinyvila.retrieval import packed_slots


def tiny(dtype="float64", device="cpu", **quant):
    cfg = preset("tiny-siglip-llama", dtype=dtype)
    if quant:
        cfg = dataclasses.replace(cfg, quant=QuantConfig(**quant))
    return from_config(cfg, device=device, seed=0)


def prompt(vlm, n=23, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vlm.cfg.text.vocab_size, (1, n), generator=g).to(vlm.model.device)
    return vlm.model.text.embed(ids)  # (1, n, d)


def decode(vlm, n_new, batch, stop=frozenset(), **kw):
    dec = Decoder(vlm.model.text, **kw)
    logits = dec.prefill(prompt(vlm))
    out = list(generate(dec, logits, SamplingParams(max_new_tokens=n_new), stop, batch=batch))
    return out, dec


def test_greedy_batches_give_the_same_tokens_and_cache():
    vlm = tiny()
    ref, ref_dec = decode(vlm, 12, batch=1)
    for batch in (5, 16):
        out, dec = decode(vlm, 12, batch=batch)
        assert out == ref
        assert dec.length == ref_dec.length == 23 + 11
        for a, b in zip(dec.cache.k, ref_dec.cache.k):
            torch.testing.assert_close(a[:, :, :dec.length], b[:, :, :dec.length], rtol=0, atol=0)


def test_a_stop_inside_a_batch_rolls_the_cache_back():
    vlm = tiny()
    ref, _ = decode(vlm, 12, batch=1)
    stop = ref[4]
    first = ref.index(stop)  # the first occurrence ends generation
    out, dec = decode(vlm, 12, batch=16, stop=frozenset([stop]))
    assert out == ref[:first + 1]
    assert dec.length == 23 + first and dec.position == dec.length  # the stop token is not cached
    # The next turn continues exactly as a fresh prefill of everything up to and including the stop.
    nxt = dec.step(stop)
    fed = torch.cat([prompt(vlm), vlm.model.text.embed(torch.tensor([ref[:first + 1]]))], dim=1)
    torch.testing.assert_close(nxt, Decoder(vlm.model.text).prefill(fed), rtol=1e-9, atol=1e-9)


def test_closing_the_stream_early_leaves_a_consistent_cache():
    vlm = tiny()
    dec = Decoder(vlm.model.text)
    logits = dec.prefill(prompt(vlm))
    stream = generate(dec, logits, SamplingParams(max_new_tokens=30), batch=16)
    got = [next(stream) for _ in range(7)]
    stream.close()
    assert dec.length == 23 + 6  # everything before the last yielded token, nothing after
    ref, _ = decode(vlm, 7, batch=1)
    assert got == ref


def test_decode_steps_equal_a_full_forward():
    """Incremental decoding through the device-state step equals one causal forward of the whole
    sequence (float64: only the order of additions differs)."""
    vlm = tiny()
    out, dec = decode(vlm, 9, batch=4)
    text = vlm.model.text
    h = torch.cat([prompt(vlm), text.embed(torch.tensor([out[:-1]]))], dim=1)  # prompt + fed tokens
    full = Decoder(text, max_seq_len=64)
    with torch.inference_mode():
        logits = text(h, full.cache, 0)[0]  # (T, V) every row
    want = logits[22:].argmax(-1).tolist()  # the argmax after the last prompt token and each fed token
    assert want == out
    for a, b in zip(dec.cache.k, full.cache.k):
        torch.testing.assert_close(a[:, :, :h.shape[1]], b[:, :, :h.shape[1]], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("explicit", [False, True])
def test_chunked_prefill_equals_one_pass(explicit):
    vlm = tiny()
    h = prompt(vlm, n=41)
    pos = torch.arange(41) * 2 + 3 if explicit else None  # gaps, as kept visual tokens may have
    one, chunked = Decoder(vlm.model.text), Decoder(vlm.model.text, prefill_chunk=7)
    a, b = one.prefill(h, pos), chunked.prefill(h, pos)
    torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
    assert (one.length, one.position) == (chunked.length, chunked.position)
    for x, y in zip(one.cache.k, chunked.cache.k):
        torch.testing.assert_close(y[:, :, :41], x[:, :, :41], rtol=1e-10, atol=1e-10)
    assert one.step(5).argmax() == chunked.step(5).argmax()


def test_greedy_rejects_a_batch_past_the_context():
    vlm = tiny()
    dec = Decoder(vlm.model.text, max_seq_len=30)
    dec.prefill(prompt(vlm))
    with pytest.raises(ValueError, match="context"):
        dec.greedy(3, 8)
    assert dec.length == 23


@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize("explicit", [False, True])
def test_steps_reading_the_rope_table_equal_steps_computing_it(explicit, dtype, monkeypatch):
    """The steps read cos/sin from the decoder's table (StepIndex.rope): the same tokens, logits and cache bits
    as computing them every step. Explicit positions with gaps run past max_seq_len, so the table grows."""
    vlm = tiny(dtype)
    pos = torch.arange(23) * 5 + 5 if explicit else None  # the last prompt token sits at 115 > max_seq_len 64
    runs = []
    for table in (True, False):
        if not table:  # no table: TextModel.forward computes rope_cos_sin at the step's position
            monkeypatch.setattr(Decoder, "_cover_rope", lambda self, st, end: None)
        dec = Decoder(vlm.model.text, max_seq_len=64)
        logits = dec.prefill(prompt(vlm), pos)
        toks = list(generate(dec, logits, SamplingParams(max_new_tokens=20), batch=6))
        runs.append((toks, dec.step(7), dec.cache.k_stack.clone(), dec.cache.step_index().rope))
    (toks, logits, k, rope), (toks0, logits0, k0, rope0) = runs
    assert toks == toks0 and torch.equal(logits, logits0) and torch.equal(k, k0)
    assert rope0 is None and rope.shape[1] == (244 if explicit else 64)  # gaps: 122 rows, then twice that


@pytest.mark.parametrize("keep", [1.0, 0.5])
def test_step_index_after_a_run_of_steps(keep):
    """After n greedy steps every counter moved by n: slot, packed row, position, the attention lengths (the
    next step's: row + 1 over a packed buffer, slot + 1 else), the record count; the token is the last one."""
    vlm = tiny()
    dec = Decoder(vlm.model.text)
    cache = dec.cache
    if keep < 1:  # a scored question over 16 visual slots, then a packed buffer of half of them
        for kind, a, b in (("system", 0, 3), ("visual", 3, 19), ("question", 19, 23)):
            cache.add_span(kind, a, b)
        dec.retrieval.begin_scoring(19)
    dec.prefill(prompt(vlm))
    if keep < 1:
        dec.retrieval.pack(keep, dec.length)
    dropped = 8 if keep < 1 else 0
    out = dec.greedy(5, 9)
    st = cache.step_index()
    slot, row, pos = 23 + 9, 23 + 9 - dropped, 23 + 9
    assert (st.slot.tolist(), st.row.tolist(), st.pos.tolist()) == ([slot], [row], [pos])
    assert st.lengths.tolist() == [(row if keep < 1 else slot) + 1]
    assert dec._count.tolist() == [9] and dec._token.tolist() == [[out[-1]]] and dec.length == 23 + 9


def test_decode_steps_past_the_packed_buffers_room_grow_it():
    """A packed buffer sized for fewer tokens than the steps append (the decoder's packed_room): steps that exactly
    fill it keep it; the next step first grows it (Retrieval.ensure_room: a larger buffer, re-packed from the full
    cache, the packed rows then the turn's tokens), and the steps go on as over a buffer big enough from the start:
    the same step index, tokens and cache. (This replaces the ContextLimitError that a pack() given less room than
    the turn decodes used to raise.)"""
    vlm = tiny()
    runs = []
    for room in (4, 1000):
        dec = Decoder(vlm.model.text, packed_room=room)
        cache = dec.cache
        for kind, a, b in (("system", 0, 3), ("visual", 3, 19), ("question", 19, 23)):
            cache.add_span(kind, a, b)
        dec.retrieval.begin_scoring(19)
        dec.prefill(prompt(vlm))
        rows = dec.retrieval.pack(0.5, dec.length)  # 15 rows (+ 4 with room 4: a buffer of 32 rows)
        small = dec.retrieval.packed
        out = dec.greedy(5, 32 - rows)  # exactly fills the small one
        assert dec.retrieval.packed is small
        out += dec.greedy(out[-1], 3)
        st = cache.step_index()
        runs.append((rows, small, dec.retrieval.packed, out, dec.step(7), cache.k_stack.clone(),
                     (st.slot.tolist(), st.row.tolist(), st.pos.tolist(), st.lengths.tolist())))
    (rows, small, grown, out, logits, k, index), (rows0, big, same, out0, logits0, k0, index0) = runs
    assert rows == rows0 == 15 and small.capacity == 32
    assert big.capacity == rows + vlm.cfg.text.max_seq_len - 23  # room 1000: capped at the cache's room
    assert grown is not small and grown.generation == small.generation + 1 and grown.capacity == packed_slots(33, 0)
    assert same is big  # the big one never grew
    assert (grown.rows, grown.dropped, grown.kept) == (small.rows, small.dropped, small.kept)
    assert torch.equal(grown.idx, small.idx) and torch.equal(small.idx, big.idx)
    n = 32 + 3 + 1  # rows in the buffer after every step: the packed ones, then the turn's tokens
    assert torch.equal(grown.k_stack[:, :, :, :n], big.k_stack[:, :, :, :n])
    assert torch.equal(grown.v_stack[:, :, :, :n], big.v_stack[:, :, :, :n])
    assert out == out0 and torch.equal(logits, logits0) and torch.equal(k, k0) and index == index0


# -- CUDA graphs -----------------------------------------------------------------------------------
def graph_vs_eager(vlm, sparsity, rounds=2, n_new=24, room=None, max_seq_len=None):
    """The same two-turn chat with graph replay and with eager steps: identical tokens. `room`: the decoder's
    packed room (decode rows past the packed ones before the buffer grows), when not the default."""
    results = []
    for graph in (False, True):
        vlm.stop_ids = frozenset()
        chat = vlm.chat(sampling=SamplingParams(max_new_tokens=n_new), sparsity=sparsity, max_seq_len=max_seq_len)
        chat.decoder.cuda_graph = graph
        if room is not None:
            chat.decoder.retrieval.room = room
        chat.decoder.pad_prefill = True  # the eager side runs the prefills (first and later turns) as the graphs do
        chat.add_image(torch.randint(0, 256, (64, 64, 3), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(0)).numpy())
        toks = []
        for r in range(rounds):
            "".join(chat.ask(f"question number {r}"))
            toks.append(list(chat.turns[-1][2]))
        results.append((toks, chat))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [{}, {"llm": "w4a16", "group_size": 32}])
@pytest.mark.parametrize("keep", [1.0, 0.3])
def test_graph_replay_equals_eager_steps(quant, keep):
    vlm = tiny("float16", "cuda", **quant)
    (eager, _), (graph, chat) = graph_vs_eager(vlm, SparsityConfig(decode_keep=keep))
    assert graph == eager
    assert any(key[0] == "step" for key in chat.decoder.graphs.entries)  # really replayed
    assert chat.stats.decode_tokens == 24


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [{}, {"llm": "w4a16", "group_size": 32}])
def test_graph_replay_over_a_growing_packed_buffer_equals_eager_steps(quant):
    """A packed room of one row: each turn's buffer grows (a new allocation, Retrieval.ensure_room) as it decodes,
    and the step graphs are captured anew over each buffer (keyed by its generation and capacity), never replayed
    over a freed one: the same tokens as eager steps. 244 packed rows: the first batch grows the buffer to 512
    rows before any capture, and the turn grows it again past 512 after graphs were captured over it."""
    vlm = tiny("float16", "cuda", **quant)
    (eager, _), (graph, chat) = graph_vs_eager(vlm, SparsityConfig(decode_keep=0.3), rounds=1, n_new=300, room=1,
                                               max_seq_len=2048)
    assert graph == eager
    buffers = {key[2] for key in chat.decoder.graphs.entries if key[0] == "step"}
    assert len(buffers) >= 2 and None not in buffers  # graphs over two packed buffers at least
    assert chat.decoder.retrieval._storage.generation >= 3 and chat.stats.decode_tokens == 300


@pytest.mark.gpu
def test_graph_step_logits_match_eager():
    vlm = tiny("float16", "cuda")
    h = prompt(vlm)
    decs = [Decoder(vlm.model.text, cuda_graph=g) for g in (False, True)]
    decs[0].pad_prefill = True  # the same (padded) first prefill on both sides: only the steps differ
    logits = [d.prefill(h) for d in decs]
    for t in (5, 9, 11, 2):
        logits = [d.step(t) for d in decs]
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-3, atol=1e-3)
    assert decs[1].length == decs[0].length == 27


@pytest.mark.gpu
def test_graph_replay_with_gapped_positions_equals_eager():
    """Explicit positions past max_seq_len: the step graphs read a RoPE table that grows between batches
    (and are captured again then); tokens and the next step's logits equal eager steps'."""
    vlm = tiny("float16", "cuda", llm="w4a16", group_size=32)
    pos = torch.arange(23, device="cuda") * 5 + 5
    runs = []
    for graph in (False, True):
        dec = Decoder(vlm.model.text, max_seq_len=64, cuda_graph=graph)
        dec.pad_prefill = True  # the same (padded) first prefill on both sides
        logits = dec.prefill(prompt(vlm), pos)
        toks = list(generate(dec, logits, SamplingParams(max_new_tokens=30), batch=8))
        runs.append((toks, dec.step(7), dec))
    (eager, le, _), (replayed, lg, dec) = runs
    assert replayed == eager and any(key[0] == "step" for key in dec.graphs.entries)
    assert dec.cache.step_index().rope.shape[1] == 2 * (116 + 8)
    torch.testing.assert_close(lg, le, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_the_first_pdl_step_capture_of_a_process_is_done_twice_and_decodes_the_same(monkeypatch):
    """The first decode-step graph a process captures with PDL is captured once more and the first dropped (it
    replays slower: Decoder._capture); later decoders capture once; tokens equal the eager steps' either way."""
    from tinyvila import generate as gen

    vlm = tiny("float16", "cuda", llm="w4a16", group_size=32)
    calls = []
    real = gen.capture
    monkeypatch.setattr(gen, "capture", lambda fn, pool, **kw: calls.append(1) or real(fn, pool, **kw))
    monkeypatch.setattr(gen, "_STEP_CAPTURED", set())
    counts, outs = [], []
    for graph in (False, True, True):
        calls.clear()
        dec = Decoder(vlm.model.text, cuda_graph=graph)
        dec.pad_prefill = True  # the eager side runs the first prefill as the graph does
        outs.append(list(generate(dec, dec.prefill(prompt(vlm)), SamplingParams(max_new_tokens=8), batch=4)))
        counts.append((len(calls), sum(key[0] == "step" for key in dec.graphs.entries)))
    assert outs[1] == outs[2] == outs[0]
    # one prefill capture each; two step captures the first time, one after; one step graph kept each time
    assert counts == [(0, 0), (3, 1), (2, 1)]
