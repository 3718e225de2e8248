"""SparseVILA decode sparsity in sessions: retrieval, packed decode, chat and evaluation modes.

A tiny synthetic checkpoint in float64, so "the same computation" is exact to ~1e-15 and the
comparisons are about bookkeeping (which slots, which positions, which buffers), not rounding.
"""

from pathlib import Path

import pytest
import torch

import tinyvila
from tinyvila import ops, text
from tinyvila.config import SparsityConfig
from tinyvila.generate import Decoder, SamplingParams, generate
from tinyvila.kv_cache import KVCache
from tinyvila.loader import build_synthetic
from tinyvila.retrieval import PACKED_ROOM, packed_slots
from tinyvila.tokenizer import conversation_ids

DEMO_IMAGE = Path(tinyvila.__file__).parent / "assets" / "demo.png"
QUESTIONS = ["What is in the picture?", "Which colour dominates?", "Is there a roof?", "Count the windows."]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    build_synthetic(path, "tiny-siglip-llama", seed=0)
    return tinyvila.load(path, dtype=torch.float64)


def ask(chat, question, image=False):
    if image:
        chat.add_image(DEMO_IMAGE)
    "".join(chat.ask(question))
    return list(chat.turns[-1][2])


def greedy(n=6):
    return SamplingParams(max_new_tokens=n)


def test_keep_one_is_the_dense_path_bit_for_bit(vlm):
    dense = vlm.chat(sampling=greedy(8))
    keep1 = vlm.chat(sampling=greedy(8), sparsity=SparsityConfig(decode_keep=1.0))
    for k, q in enumerate(QUESTIONS[:2]):
        assert ask(keep1, q, image=k == 0) == ask(dense, q, image=k == 0)
        assert torch.equal(keep1.last_logits, dense.last_logits)
        assert keep1.stats.decode_rows == 0 and keep1.decoder.retrieval.packed is None


def test_packing_everything_matches_dense_decoding(vlm):
    """A keep that rounds to all retrievable tokens goes through scoring, packing and the decode
    kernel path, and must still give the dense tokens and logits."""
    dense = vlm.chat(sampling=greedy(8))
    packed = vlm.chat(sampling=greedy(8), sparsity=SparsityConfig(decode_keep=0.999))
    assert ask(packed, QUESTIONS[0], image=True) == ask(dense, QUESTIONS[0], image=True)
    assert packed.stats.decode_rows == packed.stats.prefill_tokens  # nothing dropped
    assert ask(packed, QUESTIONS[1]) == ask(dense, QUESTIONS[1])


def masked_attend(keep_idx, dropped_after):
    """text.Attention.attend for a dense decode that hides, per layer and KV head, every slot the sparse run did
    not pack (decode steps over the full cache; prefill rows attend as usual)."""
    plain = text.Attention.attend

    def attend(self, q, p):
        if not p.step:
            return plain(self, q, p)
        start = int(p.start.slot)  # a decode step: its slot as a host int (this decoder is eager)
        k_all, v_all = p.cache.view(self.layer, start + 1)
        S, (B, Hkv) = start + 1, k_all.shape[:2]
        visible = torch.zeros(B, Hkv, S, dtype=torch.bool)
        visible.scatter_(2, keep_idx[self.layer].long(), True)
        visible[:, :, dropped_after:] = True  # tokens generated this turn
        n_rep = q.shape[1] // Hkv
        mask = visible.repeat_interleave(n_rep, dim=1)[:, :, None]  # (B, H, 1, S)
        kr, vr = (t.repeat_interleave(n_rep, dim=1) for t in (k_all, v_all))
        o = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)  # (B, H, 1, D)
        return o.transpose(1, 2).reshape(B, 1, self.n_heads * self.head_dim)

    return attend


def test_sparse_decode_equals_dense_attention_over_the_selected_slots(vlm, monkeypatch):
    """Logical RoPE positions, both buffers written, the per-head selection: decoding over the packed
    buffer equals dense decoding that masks exactly the unselected retrievable slots."""
    chat = vlm.chat(sampling=greedy(6), sparsity=SparsityConfig(decode_keep=0.25))
    chat.add_image(DEMO_IMAGE)
    ids_images = torch.cat(chat.images)
    tokens = ask(chat, QUESTIONS[0])
    cache = chat.decoder.cache
    n_visual = sum(s.end - s.start for s in cache.spans if s.kind == "visual")
    assert n_visual == vlm.cfg.image_tokens
    prompt = chat.stats.prefill_tokens
    assert chat.stats.decode_rows == prompt - n_visual + round(0.25 * n_visual)
    keep_idx = chat.decoder.retrieval._storage.idx
    assert all((i >= 0).all() and (i < prompt).all() for i in keep_idx)
    # Heads may select differently: the selection is per layer and KV head.
    dec = Decoder(vlm.model.text)
    ref_cache = dec.cache
    assert ref_cache.dtype == torch.float64
    ids = conversation_ids(vlm.tokenizer, vlm.template, [(QUESTIONS[0], 1, None)])
    monkeypatch.setattr(text.Attention, "attend", masked_attend(keep_idx, prompt))
    logits = dec.prefill(vlm.model.embed(ids, ids_images))
    ref_tokens = []
    for _ in range(6):
        ref_tokens.append(int(logits[:vlm.tokenizer.vocab_size].argmax()))  # as generate() does
        logits = dec.step(ref_tokens[-1])
    monkeypatch.undo()
    assert tokens == ref_tokens
    # The full cache got the answer's K/V at its logical slots too.
    assert chat.decoder.length == prompt + 5 and chat.decoder.retrieval.packed is None
    torch.testing.assert_close(cache.k[1][:, :, :prompt + 5], ref_cache.k[1][:, :, :prompt + 5], rtol=0, atol=1e-12)


def fresh_tokens(vlm, question, sparsity, n=6):
    chat = vlm.chat(sampling=greedy(n), sparsity=sparsity)
    return ask(chat, question, image=True)


@pytest.mark.parametrize("keep", [1.0, 0.3])
def test_eval_mode_rounds_equal_fresh_sessions(vlm, keep):
    sp = SparsityConfig(decode_keep=keep)
    chat = vlm.chat(sampling=greedy(6), sparsity=sp, mode="eval")
    chat.add_image(DEMO_IMAGE)
    for q in QUESTIONS[:3]:
        assert ask(chat, q) == fresh_tokens(vlm, q, sp), q


def test_chat_mode_keeps_history_and_the_visual_cache(vlm):
    chat = vlm.chat(sampling=greedy(4), sparsity=SparsityConfig(decode_keep=0.5))
    ask(chat, QUESTIONS[0], image=True)
    first_len = chat.decoder.length
    ask(chat, QUESTIONS[1])
    kinds = [s.kind for s in chat.decoder.cache.spans]
    assert kinds.count("answer") == 2 and kinds.count("visual") == 1
    assert chat.decoder.length > first_len + 4
    assert chat.decoder.cache.retrievable_slots().numel() == vlm.cfg.image_tokens


def test_a_turns_packed_buffer_holds_its_rows_plus_the_packed_room(vlm):
    """The buffer is the decoder's packed room (PACKED_ROOM) rows past the packed ones, rounded up to a power of
    two, not the whole remaining context (the decoding attention picks its tiles by it)."""
    chat = vlm.chat(sampling=greedy(5), sparsity=SparsityConfig(decode_keep=0.5), max_seq_len=2048)
    assert chat.decoder.retrieval.room == PACKED_ROOM
    seen = []
    ret = chat.decoder.retrieval
    pack = ret.pack

    def spy(*args, **kwargs):
        rows = pack(*args, **kwargs)
        seen.append((rows, ret.packed.layer(0)[0].shape[2], chat.decoder.max_len - chat.decoder.length))
        return rows

    ret.pack = spy
    ask(chat, QUESTIONS[0], image=True)
    ((rows, cap, left),) = seen
    assert cap == min(rows + left, 1 << (rows + PACKED_ROOM - 1).bit_length()) and cap < rows + left
    assert len(chat.turns[-1][2]) == 5  # the whole budget decoded inside it
    assert ret._storage.capacity == cap  # without growing


def test_a_turn_decoding_past_the_packed_room_grows_the_buffer_with_the_same_tokens(vlm):
    """A packed buffer with room for one decode row (rounded up) grows (Retrieval.ensure_room: a re-pack from the
    full cache) as the turn decodes past it, twice, through greedy batches and single steps: the same tokens and
    logits (bit for bit) as a buffer big enough from the start, over the same selection. (Replaces the old
    ContextLimitError when pack() was given less room than the turn decodes.)"""
    ids = vlm.tokenizer.encode("one two three four five six seven eight nine ten eleven twelve thirteen "
                               "fourteen fifteen sixteen seventeen eighteen nineteen twenty what comes next")
    h, q_from = vlm.model.embed(ids), len(ids) - 4
    runs = []
    for room in (1, 4096):
        dec = Decoder(vlm.model.text, packed_room=room)
        dec.cache.add_span("system", 0, 2)
        dec.cache.add_span("text", 2, q_from, retrievable=True)
        dec.cache.add_span("question", q_from, len(ids))
        assert dec.retrieval.begin_scoring(q_from) == q_from - 2
        logits = dec.prefill(h)
        rows = dec.retrieval.pack(0.3, dec.length)
        first = dec.retrieval.packed.capacity
        toks = list(generate(dec, logits, SamplingParams(max_new_tokens=90), batch=16))
        steps = [dec.step(t) for t in (5, 9, 11)]
        p = dec.retrieval.packed
        runs.append((toks, steps, rows, first, p.capacity, p.generation, p.idx.clone()))
    (toks1, steps1, rows1, first1, cap1, gen1, idx1), (toks, steps, rows, first, cap, gen, idx) = runs
    assert rows1 == rows and first1 == packed_slots(rows, 1) < rows + 89 + 3  # room for one row, rounded up
    assert gen1 >= 3 and cap1 >= rows + 89 + 3  # grown at least twice, to hold every row the turn decoded
    assert first == cap == rows + vlm.cfg.text.max_seq_len - len(ids)  # the big room: capped at the cache
    assert gen == 1  # and never grown
    assert toks1 == toks and torch.equal(idx1, idx)
    assert all(torch.equal(a, b) for a, b in zip(steps1, steps))


@pytest.mark.parametrize("mode", ["chat", "eval"])
def test_later_questions_after_a_grown_packed_buffer_answer_as_with_a_big_one(vlm, mode):
    """A packed room of one row: the first answer grows the buffer (ensure_room), and later questions pack into the
    grown buffer it keeps: every answer as with the default room (PACKED_ROOM, never grown here)."""
    runs = []
    for room in (PACKED_ROOM, 1):
        chat = vlm.chat(sampling=greedy(24), sparsity=SparsityConfig(decode_keep=0.3), mode=mode)
        chat.decoder.retrieval.room = room
        runs.append([ask(chat, q, image=k == 0) for k, q in enumerate(QUESTIONS[:3])])
        assert (chat.decoder.retrieval._storage.generation > 1) == (room == 1)
    assert runs[0] == runs[1]


def test_fifty_eval_rounds_leave_no_stale_state(vlm):
    chat = vlm.chat(sampling=greedy(3), sparsity=SparsityConfig(decode_keep=0.4), mode="eval")
    chat.add_image(DEMO_IMAGE)
    ask(chat, "warm up")
    anchor = chat._anchor[0]
    n_spans = None
    for r in range(50):
        q = QUESTIONS[r % len(QUESTIONS)] + " " * (r % 3)
        ask(chat, q)
        cache = chat.decoder.cache
        assert chat.decoder.retrieval.packed is None and chat.decoder.retrieval.scoring is None
        assert len(chat.turns) == 1 and chat.turns[0][0] == q
        # anchor + this question's prefill + its answer, nothing of earlier rounds
        assert chat.decoder.length == anchor + chat.stats.prefill_tokens + chat.stats.decode_tokens - 1
        assert all(s.start < chat.decoder.length for s in cache.spans)
        n_spans = n_spans or len(cache.spans)
        assert len(cache.spans) == n_spans
        chat.decoder.truncate(anchor)  # what the next round does first
        assert chat.decoder.length == anchor and max(s.end for s in cache.spans) == anchor
    assert ask(chat, QUESTIONS[2]) == fresh_tokens(vlm, QUESTIONS[2], SparsityConfig(decode_keep=0.4), n=3)


def test_document_span_is_retrievable_and_found_by_token_diff(vlm):
    chat = vlm.chat(sampling=greedy(3), sparsity=SparsityConfig(decode_keep=0.2))
    doc = "The secret code word is banana. " * 6
    chat.add_document(doc)
    ask(chat, "What is the code word?")
    spans = [s for s in chat.decoder.cache.spans if s.retrievable]
    assert len(spans) == 1 and spans[0].kind == "text"
    n = spans[0].end - spans[0].start
    assert n >= len(vlm.tokenizer.encode(doc, add_special_tokens=False)) - 2
    assert chat.stats.decode_rows == chat.stats.prefill_tokens - n + round(0.2 * n)


def test_bad_mode_and_late_media_in_eval_mode_are_clear_errors(vlm):
    with pytest.raises(ValueError, match="mode"):
        vlm.chat(mode="exam")
    chat = vlm.chat(sampling=greedy(2), mode="eval")
    ask(chat, "hi", image=True)
    with pytest.raises(ValueError, match="clear"):  # refused when added, not on every later ask
        chat.add_image(DEMO_IMAGE)


def test_cli_flags_reach_the_session(vlm, capsys):
    from tinyvila import chat as cli

    rc = cli.main(["--model", str(vlm.folder), "--image", str(DEMO_IMAGE), "-p", "hi", "--decode-keep", "0.3",
                   "--eval-multiturn", "--max-new-tokens", "3", "--dtype", "float32"])
    assert rc == 0
    assert "decode over" in capsys.readouterr().err


def test_decode_select_window_brings_the_tokens_after_an_anchor():
    from tinyvila.retrieval import decode_select

    slots = torch.tensor([3, 4, 5, 6, 7, 8, 20, 21, 22, 23])  # two spans: 3..8 and 20..23
    scores = torch.rand(1, 2, 10) * 0.1
    scores[0, 0, 1] = 5.0  # anchor at slot 4 (head 0)
    scores[0, 1, 5] = 5.0  # anchor at slot 8, the last of its span (head 1)
    scores[0, 1, 2] = 1.0  # a second anchor at slot 5 (head 1)
    windowed = torch.ones(10, dtype=torch.bool)
    plain = decode_select(scores, 3, slots)
    assert torch.equal(plain, scores.topk(3, dim=-1).indices)  # window 0: the paper's token-level top-k
    assert torch.equal(decode_select(scores, 3, slots, 2, windowed=None), plain)
    got = decode_select(scores, 3, slots, window=2, windowed=windowed)
    assert sorted(slots[got[0, 0]].tolist()) == [4, 5, 6]  # the anchor and the two slots after it
    # The window never crosses into another span (slot 20 does not follow slot 8), and the slot
    # nearest an anchor wins the tie at the budget (6 before 7 after the anchor at 5).
    assert sorted(slots[got[0, 1]].tolist()) == [5, 6, 8]
    # Only windowed (text) tokens inherit; visual ones keep their own score.
    assert torch.equal(decode_select(scores, 3, slots, 2, torch.zeros(10, dtype=torch.bool)), plain)


def test_document_window_selects_runs_and_visual_spans_stay_token_level(vlm):
    """With a window, the packed text rows come in runs after the anchors; images are unaffected."""
    doc = "The secret code word is banana, and the colour of the door is green. " * 3
    rows = {}
    for w in (0, 6):
        chat = vlm.chat(sampling=greedy(2), sparsity=SparsityConfig(decode_keep=0.25, decode_window=w))
        chat.add_document(doc)
        ask(chat, "What is the code word?")
        span = next(s for s in chat.decoder.cache.spans if s.retrievable)
        idx = chat.decoder.retrieval._storage.idx[-1][0, 0]
        picked = idx[(idx >= span.start) & (idx < span.end)]
        rows[w] = int((picked.diff() == 1).sum())  # adjacent pairs among the selected slots
        assert picked.numel() == round(0.25 * (span.end - span.start))
    assert rows[6] > rows[0]
    image = [vlm.chat(sampling=greedy(3), sparsity=SparsityConfig(decode_keep=0.3, decode_window=w))
             for w in (0, 8)]
    assert ask(image[0], QUESTIONS[0], image=True) == ask(image[1], QUESTIONS[0], image=True)
    assert all(torch.equal(a, b) for a, b in zip(image[0].decoder.retrieval._storage.idx,
                                                 image[1].decoder.retrieval._storage.idx))


def test_fastv_one_pass_prunes_after_layer_k_minus_one(vlm):
    """FastV.begin: scores the last row at layer K-1 in the same prefill, then hides the unkept
    retrievable slots from layers >= K; equal to scoring first and prefilling again with the mask."""
    from tinyvila.retrieval import FASTV_LAYER, fastv_keep_mask

    ids = vlm.tokenizer.encode("one two three four five six seven eight nine ten eleven twelve what")
    h = vlm.model.embed(ids)
    one = Decoder(vlm.model.text)
    one.cache.add_span("text", 2, 11, retrievable=True)
    assert one.fastv.begin(len(ids) - 1, 0.3) == 9
    assert one.fastv.deciding
    logits = one.prefill(h)
    assert not one.fastv.deciding and one.fastv.scoring is None  # decided at layer K-1
    K, mask = one.fastv.key_mask
    assert K == FASTV_LAYER and int(mask[2:11].sum()) == round(0.3 * 9) and bool(mask[:2].all() and mask[11:].all())
    two = Decoder(vlm.model.text)
    two.cache.add_span("text", 2, 11, retrievable=True)
    two.retrieval.begin_scoring(len(ids) - 1)
    two.prefill(h)
    expect = fastv_keep_mask(two.retrieval.scoring.scores, two.retrieval.scoring.idx, two.max_len, 0.3)
    assert torch.equal(expect[1], mask)
    two.truncate(0)
    assert two.fastv.key_mask is None and two.retrieval.scoring is None  # truncate(0) resets both
    two.fastv.key_mask = expect
    torch.testing.assert_close(logits, two.prefill(h), rtol=0, atol=1e-10)


def test_decode_window_is_validated():
    with pytest.raises(ValueError, match="decode_window"):
        SparsityConfig(decode_window=-1)


def spy_salience(monkeypatch):
    """Record the idx argument of every retrieval-salience call (a range: the contiguous-span form)."""
    calls, real = [], ops.retrieval_salience

    def salience(q, k, idx, lse, out=None, **kw):
        calls.append(idx)
        return real(q, k, idx, lse, out=out, **kw)

    monkeypatch.setattr(ops, "retrieval_salience", salience)
    return calls


@pytest.mark.parametrize("mode", ["chat", "eval"])
def test_one_image_scores_as_a_range_with_the_slot_tensor_answers(vlm, monkeypatch, mode):
    """One image is one run of retrievable slots: every question (first turn, a later one, an eval round)
    scores it as a range, with the tokens, logits and selection of scoring it through the slot tensor."""
    runs = []
    for tensor in (False, True):
        if tensor:
            monkeypatch.setattr(KVCache, "one_run", staticmethod(lambda runs: None))
        calls = spy_salience(monkeypatch)
        chat = vlm.chat(sampling=greedy(5), sparsity=SparsityConfig(decode_keep=0.3), mode=mode)
        out = []
        for k, q in enumerate(QUESTIONS[:3]):
            out.append((ask(chat, q, image=k == 0), chat.last_logits, chat.decoder.retrieval._storage.idx.clone()))
        n_layers = vlm.cfg.text.n_layers
        assert len(calls) == 3 * n_layers and all(isinstance(c, range) != tensor for c in calls)
        assert not tensor or all(c.numel() == vlm.cfg.image_tokens for c in calls)
        runs.append(out)
        monkeypatch.undo()
    for (ta, la, ia), (tb, lb, ib) in zip(*runs):
        assert ta == tb and torch.equal(la, lb) and torch.equal(ia, ib)


def test_an_image_and_a_document_score_through_the_slot_tensor(vlm, monkeypatch):
    """Two retrievable runs (an image, then a document after some text): the slot tensor, in slot order."""
    calls = spy_salience(monkeypatch)
    chat = vlm.chat(sampling=greedy(3), sparsity=SparsityConfig(decode_keep=0.3))
    chat.add_document("The secret code word is banana. " * 4)
    ask(chat, QUESTIONS[0], image=True)
    runs = [(s.start, s.end) for s in chat.decoder.cache.spans if s.retrievable]
    assert len(runs) == 2 and runs[0][1] < runs[1][0]
    want = torch.cat([torch.arange(a, b) for a, b in runs])
    assert len(calls) == vlm.cfg.text.n_layers
    assert all(torch.is_tensor(c) and torch.equal(c.cpu().long(), want) for c in calls)
    assert chat.stats.decode_rows == chat.stats.prefill_tokens - want.numel() + round(0.3 * want.numel())
