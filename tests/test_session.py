"""Chat sessions on a tiny synthetic checkpoint: the cache across turns, stop/max/context paths.

The central property: a session prefills only each turn's new tokens, yet every turn sees the
logits of prefilling the whole conversation from scratch (same ids, same positions).
"""

from pathlib import Path

import numpy as np
import pytest
import torch

import tinyvila
from tinyvila.errors import ContextLimitError, ImageError
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
