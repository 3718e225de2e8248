"""Chat sessions on a tiny synthetic checkpoint: the cache across turns, stop/max/context paths.

The central property: a session prefills only each turn's new tokens, yet every turn sees the
logits of prefilling the whole conversation from scratch (same ids, same positions).
"""

import dataclasses
import gc
from pathlib import Path

import numpy as np
import pytest
import torch

import tinyvila
import tinyvila.retrieval
from tinyvila.errors import AnswerClosedError, ContextLimitError, EvalModeError, ImageError
from tinyvila.generate import Decoder, SamplingParams
from tinyvila.loader import build_synthetic
from tinyvila.tokenizer import conversation_ids

DEMO_IMAGE = Path(tinyvila.__file__).parent / "assets" / "demo.png"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    build_synthetic(path, "tiny-siglip-llama", seed=0)
    return path


@pytest.fixture(scope="module")
def vlm(folder):
    # float64 makes "the same computation" exact to ~1e-15, so the comparison below is about
    # bookkeeping (ids, positions, cache slots), not about fp32 reduction order.
    return tinyvila.load(folder, dtype=torch.float64)


def scratch_logits(vlm, turns, images):
    """Logits after prefilling the whole conversation in one go, in a fresh cache."""
    ids = conversation_ids(vlm.tokenizer, vlm.template, turns)
    dec = Decoder(vlm.model.text)
    embeds = vlm.model.embed(ids, images)
    return dec.prefill(embeds), ids


def test_second_question_sees_the_logits_of_a_fresh_prefill(vlm):
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=7))
    chat.add_image(DEMO_IMAGE)
    images = torch.cat(chat.images)
    "".join(chat.ask("What is in the picture?"))
    answer1 = list(chat.turns[0][2])
    assert len(answer1) == 7 and chat.stats.finish == "max_tokens"
    "".join(chat.ask("And what colour is the roof?"))
    turns = [("What is in the picture?", 1, answer1), ("And what colour is the roof?", 0, None)]
    logits, ids = scratch_logits(vlm, turns, images)
    # The session's cache holds exactly those ids: one image's tokens expanded.
    assert chat.stats.context_tokens - 7 == vlm.model.n_embeds(ids)
    torch.testing.assert_close(chat.last_logits, logits, rtol=0, atol=1e-12)


def test_three_turns_with_an_image_added_later(vlm):
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=3))
    "".join(chat.ask("Hello"))
    chat.add_image(DEMO_IMAGE)
    images = torch.cat(chat.images)
    "".join(chat.ask("Look at this."))
    "".join(chat.ask("Thanks"))
    turns = [(q, n, list(a)) for q, n, a in chat.turns]
    turns[-1] = (turns[-1][0], 0, None)
    logits, _ = scratch_logits(vlm, turns, images)
    torch.testing.assert_close(chat.last_logits, logits, rtol=0, atol=1e-12)


def test_stop_token_ends_the_answer_and_is_kept_for_the_next_turn(vlm):
    free = vlm.chat(sampling=SamplingParams(max_new_tokens=10))
    "".join(free.ask("Count to ten."))
    tokens = free.turns[0][2]
    stop = tokens[3]
    assert stop not in tokens[:3], "pick a seed/prompt where the 4th token is new"
    vlm_stop = vlm.stop_ids
    vlm.stop_ids = frozenset({stop})
    try:
        chat = vlm.chat(sampling=SamplingParams(max_new_tokens=10))
        "".join(chat.ask("Count to ten."))
        assert chat.turns[0][2] == tokens[:4]
        assert chat.stats.finish == "stop" and chat.stats.decode_tokens == 4
        assert chat.pending == [stop]  # written with the next turn's prefill
    finally:
        vlm.stop_ids = vlm_stop


def test_max_new_tokens_bounds_the_answer(vlm):
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=5))
    text = "".join(chat.ask("Say something long."))
    assert chat.stats.decode_tokens == 5 and chat.stats.finish == "max_tokens"
    assert isinstance(text, str)


def test_answer_stopped_early_keeps_the_history_consistent(vlm):
    """What the CLI's Ctrl-C does: the reader stops mid-answer (here inside a 16-token greedy batch).
    The partial answer is the history: the next question sees a fresh prefill's logits."""
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=40))
    chat.add_image(DEMO_IMAGE)
    images = torch.cat(chat.images)
    stream = chat.ask("Describe it.")
    for _ in range(5):
        next(stream)
    stream.close()
    answer1 = list(chat.turns[0][2])
    assert len(answer1) == 5 and chat.stats.finish == "interrupted" and chat.pending == answer1[-1:]
    "".join(chat.ask("Go on.", SamplingParams(max_new_tokens=1)))  # only its prefill logits matter
    logits, _ = scratch_logits(vlm, [("Describe it.", 1, answer1), ("Go on.", 0, None)], images)
    torch.testing.assert_close(chat.last_logits, logits, rtol=0, atol=1e-12)


def test_interrupt_inside_a_decode_step_keeps_the_history_consistent(vlm, monkeypatch):
    """Ctrl-C most often lands inside the model's forward: a KeyboardInterrupt raised from the second
    greedy batch leaves the first batch's tokens as the answer and the session usable."""
    real, calls = Decoder.greedy, []

    def interrupted(self, token, n, *args, **kw):
        calls.append(n)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, token, n, *args, **kw)

    monkeypatch.setattr(Decoder, "greedy", interrupted)
    monkeypatch.setattr(vlm, "stop_ids", frozenset())  # this prompt's answer would stop after 12 tokens
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=40))
    with pytest.raises(KeyboardInterrupt):
        "".join(chat.ask("Describe it."))
    answer1 = list(chat.turns[0][2])
    assert len(answer1) == 1 + calls[0] > 2 and chat.stats.finish == "interrupted"  # prefill's token + 1 batch
    monkeypatch.undo()
    "".join(chat.ask("Go on.", SamplingParams(max_new_tokens=1)))  # only its prefill logits matter
    logits, _ = scratch_logits(vlm, [("Describe it.", 0, answer1), ("Go on.", 0, None)], None)
    torch.testing.assert_close(chat.last_logits, logits, rtol=0, atol=1e-12)


def prompt_tokens(vlm, question, image=False):
    """Tokens a first turn with this question occupies (the llama_3 system prompt is long)."""
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=1))
    if image:
        chat.add_image(DEMO_IMAGE)
    "".join(chat.ask(question))
    return chat.stats.prefill_tokens


def test_over_long_prompt_is_refused_and_the_session_stays_usable(vlm):
    ctx = prompt_tokens(vlm, "short?", image=True) + 10
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=4), max_seq_len=ctx)
    chat.add_image(DEMO_IMAGE)
    with pytest.raises(ContextLimitError, match=f"context is {ctx}"):
        chat.ask("x" * 200)
    assert chat.decoder.length == 0 and len(chat.images) == 1 and chat.turns == []
    "".join(chat.ask("short?"))
    assert chat.stats.images == 1 and chat.stats.context_tokens > 16


def test_conversation_growing_past_the_context_is_refused_without_damage(vlm):
    ctx = prompt_tokens(vlm, "a" * 30) + 40
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=4), max_seq_len=ctx)
    "".join(chat.ask("a" * 30))
    length, turns = chat.decoder.length, len(chat.turns)
    cache = [k.clone() for k in chat.decoder.cache.k]
    with pytest.raises(ContextLimitError):
        chat.ask("b" * 60)
    assert chat.decoder.length == length and len(chat.turns) == turns
    assert all(torch.equal(a, b) for a, b in zip(cache, chat.decoder.cache.k))
    "".join(chat.ask("ok"))  # still usable
    assert len(chat.turns) == turns + 1


def test_answer_that_fills_the_context_stops_cleanly(vlm):
    ctx = prompt_tokens(vlm, "hi") + 20
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=500), max_seq_len=ctx)
    "".join(chat.ask("hi"))
    assert chat.stats.finish == "context" and chat.decoder.length == ctx


def test_unreadable_image_is_a_clear_error_and_changes_nothing(vlm, tmp_path):
    chat = vlm.chat()
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not an image")
    with pytest.raises(ImageError, match="broken.jpg"):
        chat.add_image(bad)
    with pytest.raises(ImageError):
        chat.add_image(np.zeros((4, 4), dtype=np.float32))
    assert chat.images == [] and chat.decoder.length == 0


def test_clear_starts_over(vlm):
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=3))
    "".join(chat.ask("one"))
    chat.clear()
    assert chat.decoder.length == 0 and chat.turns == [] and chat.pending == []
    fresh = vlm.chat(sampling=SamplingParams(max_new_tokens=3))
    assert "".join(chat.ask("two")) == "".join(fresh.ask("two"))
    torch.testing.assert_close(chat.last_logits, fresh.last_logits, rtol=0, atol=0)


def test_sampling_with_a_seed_is_reproducible(vlm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=3)
    a = vlm.chat(sampling=p)
    b = vlm.chat(sampling=p)
    "".join(a.ask("hi"))
    "".join(b.ask("hi"))
    assert a.turns[0][2] == b.turns[0][2]


# -- interleaved answers, failed turns, refused turns ------------------------------------------
def assert_cache_is_the_history(chat):
    """The cache holds the recorded conversation exactly: its ids, every answer token but the pending
    last one, and spans that tile the cache with one answer span per answer (its tokens less one)."""
    vlm, turns = chat.vlm, [(q, n, list(a)) for q, n, a in chat.turns]
    ids = conversation_ids(vlm.tokenizer, vlm.template, turns)
    assert chat.decoder.length + len(chat.pending) == vlm.model.n_embeds(ids, None)
    assert chat.pending == turns[-1][2][-1:]
    spans = chat.decoder.cache.spans
    assert spans[0].start == 0 and spans[-1].end == chat.decoder.length
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    assert [s.end - s.start for s in spans if s.kind == "answer"] == [len(a) - 1 for _, _, a in turns if len(a) > 1]


def test_a_new_question_first_ends_the_answer_still_streaming(vlm, monkeypatch):
    """ask() while the previous answer streams: that answer ends with exactly the tokens it yielded, and
    its stream, read or closed or dropped later, never touches the chat again."""
    monkeypatch.setattr(vlm, "stop_ids", frozenset())
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=20))
    first = chat.ask("First?")
    next(first)
    next(first)  # inside a 16-token greedy batch
    "".join(chat.ask("Second?"))
    a1, a2 = chat.turns[0][2], chat.turns[1][2]
    assert len(a1) == 2 and len(a2) == 20 and chat.stats.finish == "max_tokens"
    assert_cache_is_the_history(chat)
    state = (chat.decoder.length, list(chat.pending), chat.stats, [list(a) for _, _, a in chat.turns],
             [(s.kind, s.start, s.end) for s in chat.decoder.cache.spans])
    with pytest.raises(AnswerClosedError, match="later ask"):
        next(first)
    first.close()
    del first
    gc.collect()
    assert state == (chat.decoder.length, list(chat.pending), chat.stats, [list(a) for _, _, a in chat.turns],
                     [(s.kind, s.start, s.end) for s in chat.decoder.cache.spans])
    "".join(chat.ask("Third?", SamplingParams(max_new_tokens=1)))
    logits, _ = scratch_logits(vlm, [("First?", 0, a1), ("Second?", 0, a2), ("Third?", 0, None)], None)
    torch.testing.assert_close(chat.last_logits, logits, rtol=0, atol=1e-12)


def test_interleaved_streams_only_the_newest_is_live(vlm):
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=6))
    unread = chat.ask("Never read.")
    streams = [chat.ask(f"Question {i}?") for i in range(3)]  # each ends the one before, unread: no turn
    assert chat.turns == []
    for stream in [unread, *streams[:-1]]:
        with pytest.raises(AnswerClosedError):
            next(stream)
    next(streams[-1])
    chat.add_image(DEMO_IMAGE)  # for the next question; the streaming answer goes on
    images = torch.cat(chat.images)
    rest = chat.ask("Look.")
    "".join(rest)
    assert [q for q, _, _ in chat.turns] == ["Question 2?", "Look."] and len(chat.turns[0][2]) == 1
    assert_cache_is_the_history(chat)
    "".join(chat.ask("More?", SamplingParams(max_new_tokens=1)))
    turns = [(q, n, list(a)) for q, n, a in chat.turns]
    logits, _ = scratch_logits(vlm, turns[:-1] + [("More?", 0, None)], images)
    torch.testing.assert_close(chat.last_logits, logits, rtol=0, atol=1e-12)


def test_clear_ends_the_streaming_answer(vlm):
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=8))
    stream = chat.ask("Hello?")
    next(stream)
    chat.clear()
    with pytest.raises(AnswerClosedError, match="clear"):
        next(stream)
    assert chat.turns == [] and chat.decoder.length == 0 and chat.decoder.cache.spans == []
    fresh = vlm.chat(sampling=SamplingParams(max_new_tokens=8))
    assert "".join(chat.ask("Two?")) == "".join(fresh.ask("Two?"))


def chat_state(chat):
    """Everything a turn may change, as comparable values."""
    d = chat.decoder
    return {
        "turns": [(q, n, list(a)) for q, n, a in chat.turns], "pending": list(chat.pending),
        "images": [t.clone() for t in chat.images], "documents": list(chat.documents),
        "stats": dataclasses.replace(chat.stats), "length": d.length, "position": d.position,
        "explicit": [(s, p.tolist()) for s, p in d._explicit],
        "spans": [(s.kind, s.start, s.end, s.retrievable) for s in d.cache.spans],
        "scoring": d.retrieval.scoring, "packed": d.retrieval.packed, "anchor": chat._anchor,
        "kv": d.cache.k_stack[:, :, :, :d.length].clone(),
    }


def assert_same_state(a, b):
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif key == "images":
            assert len(a[key]) == len(b[key]) and all(map(torch.equal, a[key], b[key])), key
        else:
            assert a[key] == b[key], key


def _raise_in_second_layer(vlm, monkeypatch, exc):
    """The forward of layer 1 raises: layer 0 has written its K/V and scored the question."""
    def boom(*args, **kw):
        raise exc
    monkeypatch.setattr(vlm.model.text.layers[1], "forward_residual", boom)


def _raise_in_pack(vlm, monkeypatch, exc):
    def boom(*args, **kw):
        raise exc
    monkeypatch.setattr(tinyvila.retrieval.Retrieval, "pack", boom)


DOC = "Note: the house in the picture has a red roof and two windows. " * 3


@pytest.mark.parametrize("inject, exc", [
    (_raise_in_second_layer, KeyboardInterrupt()),
    (_raise_in_pack, torch.OutOfMemoryError("CUDA out of memory (injected)")),
], ids=["ctrl-c-in-prefill", "oom-in-pack"])
def test_a_turn_that_fails_in_prefill_changes_nothing(vlm, monkeypatch, inject, exc):
    """A turn is a transaction: an exception in the prefill or the packing leaves spans, pending inputs,
    stats, scoring and the cache as they were; the retried turn selects and answers as a fresh chat."""
    sparsity, p = tinyvila.Sparsity(decode_keep=0.5), SamplingParams(max_new_tokens=6)

    def first_turn():
        c = vlm.chat(sampling=p, sparsity=sparsity)
        c.add_image(DEMO_IMAGE)
        "".join(c.ask("What is it?"))
        c.add_document(DOC)
        return c

    chat = first_turn()
    before = chat_state(chat)
    inject(vlm, monkeypatch, exc)
    with pytest.raises(type(exc)):
        "".join(chat.ask("And the roof?"))
    monkeypatch.undo()
    assert_same_state(before, chat_state(chat))
    "".join(chat.ask("And the roof?"))
    ref = first_turn()
    "".join(ref.ask("And the roof?"))
    assert chat.turns[-1][2] == ref.turns[-1][2] and chat.stats.decode_rows == ref.stats.decode_rows > 0
    assert torch.equal(chat.decoder.retrieval._storage.idx, ref.decoder.retrieval._storage.idx)  # same selection
    torch.testing.assert_close(chat.last_logits, ref.last_logits, rtol=0, atol=0)


def test_a_failed_eval_round_restores_the_evicted_round(vlm, monkeypatch):
    """An eval round evicts the last round before its prefill overwrites those slots: on failure both
    come back, so the chat equals the one that never tried."""
    p = SamplingParams(max_new_tokens=5)
    chat = vlm.chat(sampling=p, mode="eval")
    chat.add_image(DEMO_IMAGE)
    "".join(chat.ask("Round one?"))
    "".join(chat.ask("Round two, a longer question?"))
    before = chat_state(chat)
    _raise_in_second_layer(vlm, monkeypatch, RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        "".join(chat.ask("Round three?"))
    monkeypatch.undo()
    assert_same_state(before, chat_state(chat))
    "".join(chat.ask("Round three?"))
    ref = vlm.chat(sampling=p, mode="eval")
    ref.add_image(DEMO_IMAGE)
    "".join(ref.ask("Round one?"))
    "".join(ref.ask("Round three?"))
    assert chat.turns[-1][2] == ref.turns[-1][2]
    torch.testing.assert_close(chat.last_logits, ref.last_logits, rtol=0, atol=0)


def test_a_refused_turn_lists_its_queued_inputs_and_discard_pending_drops_them(vlm):
    p = SamplingParams(max_new_tokens=4)
    ctx = prompt_tokens(vlm, "a" * 30) + 60
    chat = vlm.chat(sampling=p, max_seq_len=ctx)
    "".join(chat.ask("a" * 30))
    chat.add_image(DEMO_IMAGE)
    chat.add_document(DOC)
    with pytest.raises(ContextLimitError, match="1 image and 1 document") as refused:
        chat.ask("What does the note say?")
    assert "discard_pending()" in str(refused.value) and f"context is {ctx}" in str(refused.value)
    assert len(chat.images) == 1 and chat.documents == [DOC]  # kept: a shorter question may fit
    chat.discard_pending()
    assert chat.images == [] and chat.image_index == [] and chat.documents == []
    "".join(chat.ask("ok?"))
    ref = vlm.chat(sampling=p, max_seq_len=ctx)
    "".join(ref.ask("a" * 30))
    "".join(ref.ask("ok?"))
    assert chat.turns == ref.turns
    torch.testing.assert_close(chat.last_logits, ref.last_logits, rtol=0, atol=0)


def test_eval_mode_refuses_new_inputs_after_the_first_round_when_they_are_added(vlm):
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=3), mode="eval")
    chat.add_image(DEMO_IMAGE)
    "".join(chat.ask("One?"))
    with pytest.raises(EvalModeError, match=r"clear\(\).*mode=\"chat\""):
        chat.add_image(DEMO_IMAGE)
    with pytest.raises(EvalModeError, match=r"clear\(\)"):
        chat.add_document(DOC)
    assert chat.images == [] and chat.documents == []
    "".join(chat.ask("Two?"))  # the evaluation goes on
    assert chat.stats.decode_tokens == 3


def test_the_stream_passes_the_decoded_text_through_unchanged(vlm, monkeypatch):
    """Control characters the model generates reach the caller as they are (the CLI strips them)."""
    esc = vlm.tokenizer.encode("\x1b[2J\x07", add_special_tokens=False)
    monkeypatch.setattr(tinyvila.api, "generate", lambda *args, **kw: iter(esc))
    chat = vlm.chat()
    assert "".join(chat.ask("Clear my screen.")) == "\x1b[2J\x07"
