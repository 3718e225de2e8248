"""Threads and one model: separate chats answer as they would alone; one chat shared by two threads
refuses the second (ChatBusyError) instead of corrupting its cache; concurrent image encodes on one
model, which share the vision encoder's device buffers on CUDA, never mix their images."""

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tinyvila
from tinyvila.errors import ChatBusyError
from tinyvila.generate import Decoder, SamplingParams
from tinyvila.tokenizer import conversation_ids

DEMO_IMAGE = Path(tinyvila.__file__).parent / "assets" / "demo.png"
QUESTIONS = ["What is in the picture?", "What colour is it?", "Is it big?"]


@pytest.fixture(scope="module")
def vlm():
    return tinyvila.api.from_config("tiny-siglip-llama")


def run_threads(fn, n):
    """fn(i) in n threads started together; re-raises the first exception a thread hit."""
    errors, start = [], threading.Barrier(n)

    def body(i):
        try:
            start.wait()
            fn(i)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def image(i):
    return np.random.default_rng(i).integers(0, 256, (40 + 8 * i, 48, 3), dtype=np.uint8)


def conversation(vlm, i):
    """Answer ids of a two-question conversation about image i."""
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=12))
    chat.add_image(image(i))
    for q in QUESTIONS[:2]:
        "".join(chat.ask(q))
    return [list(a) for _, _, a in chat.turns]


def test_separate_chats_on_one_model_answer_as_they_would_alone(vlm):
    alone = [conversation(vlm, i) for i in range(3)]
    together = [None] * 3

    def fn(i):
        for _ in range(2):
            together[i] = conversation(vlm, i)

    run_threads(fn, 3)
    assert together == alone


def test_a_chat_streaming_for_one_thread_refuses_another(vlm):
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=8))
    streaming, asked = threading.Event(), threading.Event()
    seen = {}

    def owner():
        stream = chat.ask(QUESTIONS[0])
        next(stream)
        streaming.set()
        asked.wait(10)
        seen["rest"] = "".join(stream)  # the other thread changed nothing

    def other():
        streaming.wait(10)
        try:
            for call in (lambda: chat.ask(QUESTIONS[1]), chat.clear, lambda: chat.add_image(DEMO_IMAGE),
                         chat.discard_pending):
                with pytest.raises(ChatBusyError, match="one thread at a time"):
                    call()
        finally:
            asked.set()

    run_threads(lambda i: (owner, other)[i](), 2)
    assert "rest" in seen
    ref = vlm.chat(sampling=SamplingParams(max_new_tokens=8))
    "".join(ref.ask(QUESTIONS[0]))
    assert chat.turns == ref.turns and chat.decoder.length == ref.decoder.length
    "".join(chat.ask(QUESTIONS[1]))  # the answer has ended: any thread may go on
    assert len(chat.turns) == 2


def test_two_threads_sharing_one_chat_never_corrupt_it(vlm, monkeypatch):
    """Both threads ask over and over; every call either runs whole or raises ChatBusyError, and the
    cache is the recorded conversation at the end (the next question sees a fresh prefill's logits)."""
    monkeypatch.setattr(vlm, "stop_ids", frozenset())
    real = Decoder.greedy

    def slow(self, *args, **kw):  # give the other thread a chance mid-answer
        time.sleep(0.002)
        return real(self, *args, **kw)

    monkeypatch.setattr(Decoder, "greedy", slow)
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=20), max_seq_len=4096)
    done, busy = [0, 0], [0, 0]

    def fn(i):
        for k in range(300):  # until each thread has had 3 answers
            if done[i] == 3:
                return
            try:
                for _ in chat.ask(f"thread {i} question {k}"):
                    pass
                done[i] += 1
            except ChatBusyError:
                busy[i] += 1
                time.sleep(0.003)

    run_threads(fn, 2)
    assert done == [3, 3] and len(chat.turns) == 6 and sum(busy) > 0
    monkeypatch.undo()
    turns = [(q, n, list(a)) for q, n, a in chat.turns]
    "".join(chat.ask("last", SamplingParams(max_new_tokens=1)))
    ids = conversation_ids(vlm.tokenizer, vlm.template, turns + [("last", 0, None)])
    dec = Decoder(vlm.model.text, max_seq_len=4096)
    torch.testing.assert_close(chat.last_logits, dec.prefill(vlm.model.embed(ids)), rtol=1e-5, atol=1e-5)


def test_concurrent_image_encodes_on_one_model_are_not_mixed(vlm, monkeypatch):
    """On CUDA every chat's encode goes through the encoder's one static input buffer (a CUDA graph's);
    here a stand-in with a shared buffer and a pause between filling and reading it (where another
    thread would refill it) shows that encodes of one model are serialised."""
    model = vlm.model
    alone = [model.encode_images(tinyvila.image.resize_uint8(image(i), model.cfg.vision)) for i in range(3)]
    real, shared = model._encode, {}

    def through_one_buffer(pixels, *args):
        shared["x"] = pixels.clone()
        time.sleep(0.02)
        return real(shared["x"], *args)

    monkeypatch.setattr(model, "_encode", through_one_buffer)
    chats = [vlm.chat() for _ in range(3)]
    run_threads(lambda i: chats[i].add_image(image(i)), 3)
    for i, chat in enumerate(chats):
        torch.testing.assert_close(chat.images[0], alone[i], rtol=0, atol=0)


def test_chats_of_one_model_take_turns_on_the_device(vlm, monkeypatch):
    """Prefills and runs of decode steps of different chats never overlap (VLM.device_lock): on CUDA they share the
    W4 GEMM's scratch and the kernels' workspaces, which another thread's launches in between would overwrite."""
    text, inside, most = vlm.model.text, [0], [0]
    real = type(text).forward

    def forward(self, *args, **kwargs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.002)  # long enough for another thread to come in, were it let in
        try:
            return real(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(type(text), "forward", forward)
    alone = [conversation(vlm, i) for i in range(2)]
    together = [None] * 2

    def fn(i):
        together[i] = conversation(vlm, i)

    run_threads(fn, 2)
    assert most[0] == 1 and together == alone
