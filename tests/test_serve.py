"""`python -m tinyvila.serve` over real HTTP: the official `openai` client, raw requests (httpx), disconnects, prefix
reuse, a small load, /metrics. Servers run the demo model on a free loopback port, started and stopped here; the
expected answers come from the same model's in-process `Chat` (greedy), never from hard-coded text.
"""

import asyncio
import base64
import concurrent.futures
import copy
import gc
import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import cv2
import httpx
import numpy as np
import openai  # the test extra has the server's test tools: a missing one is a broken set-up, not a skip
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

import tinyvila
from tinyvila.api import Chat
from tinyvila.config import preset
from tinyvila.serve import app as serve_app
from tinyvila.serve import media as serve_media
from tinyvila.serve.app import BackgroundServer, create_app
from tinyvila.serve.engine import Engine, Job, PrefixCache
from tinyvila.serve.media import MediaPolicy, read_media
from tinyvila.serve.protocol import Defaults, RequestError, StopMatcher, parse_request

DEMO_IMAGE = Path(tinyvila.__file__).parent / "assets" / "demo.png"
KEY = "test-key"
MAX_BODY = 1 << 20


class Server:
    """An engine and its app under uvicorn in a thread, on a free 127.0.0.1 port."""

    def __init__(self, vlm, *, cache_size=4, max_queue=64, **app_kw):
        self.engine = Engine(vlm, cache_size=cache_size, max_queue=max_queue)
        app_kw.setdefault("defaults", Defaults(model="demo", max_tokens=16))
        self.app = create_app(self.engine, model_name="demo", **app_kw)
        self.http = BackgroundServer(self.app, timeout_s=20)
        self.url = self.http.url

    def metric(self, name: str, **labels) -> float:
        return self.engine.metrics.get(name, **labels)

    def close(self) -> None:
        self.http.close(20)
        self.engine.close()


@pytest.fixture(scope="module")
def vlm():
    return tinyvila.load("demo")


@pytest.fixture(scope="module")
def server(vlm):
    s = Server(vlm, api_key=KEY, max_body=MAX_BODY)
    yield s
    s.close()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60)


def answer_in_process(vlm, questions, max_tokens=16, media=()):
    """The answers of a stateful in-process Chat asked `questions` in turn; media [(kind, source)] go with the
    first. Returns (answers, the Chat)."""
    chat = vlm.chat(sampling=tinyvila.SamplingParams(max_new_tokens=max_tokens))
    for kind, source in media:
        chat.add_image(source) if kind == "image" else chat.add_video(source, num_frames=len(source)
                                                                      if isinstance(source, list) else 4)
    return ["".join(chat.ask(q)) for q in questions], chat


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def image_message(text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(DEMO_IMAGE, "image/png")}},
                                        {"type": "text", "text": text}]}


def post(server, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60,
                      **({"json": body} if isinstance(body, (dict, list)) else {"content": body}), **kw)


# -- the official client -----------------------------------------------------------------------------------
def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["demo"] and models[0].object == "model"


def test_completion_equals_the_in_process_chat(client, vlm):
    (want,), chat = answer_in_process(vlm, ["What is in the picture?"], 8)
    r = client.chat.completions.create(model="any-name-at-all", max_tokens=8,
                                       messages=[{"role": "user", "content": "What is in the picture?"}])
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if chat.stats.finish == "max_tokens" else "stop")
    assert r.usage.completion_tokens == chat.stats.decode_tokens
    assert r.usage.prompt_tokens == chat.stats.context_tokens - chat.stats.decode_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens and r.model == "any-name-at-all"


def test_streamed_completion_with_usage(client, vlm):
    (want,), chat = answer_in_process(vlm, ["Tell me more."], 12)
    chunks = list(client.chat.completions.create(model="demo", max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "Tell me more."}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # streamed, not one blob
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length" if chat.stats.finish == "max_tokens" else "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.stats.decode_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_image_part(client, vlm):
    (want,), _ = answer_in_process(vlm, ["What is it?"], 10, [("image", DEMO_IMAGE)])
    r = client.chat.completions.create(model="demo", max_tokens=10, messages=[image_message("What is it?")])
    assert r.choices[0].message.content == want
    details = r.usage.prompt_tokens_details.model_dump()
    assert details["image_tokens"] == vlm.cfg.image_tokens and details["video_tokens"] == 0


def write_clip(path: Path, n: int = 12) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10, (64, 48))
    for i in range(n):
        frame = np.zeros((48, 64, 3), np.uint8)
        frame[:, : 5 * i + 4] = (20 * i, 255 - 20 * i, (37 * i) % 256)
        writer.write(frame)
    writer.release()
    return path


def test_video_part_mp4_with_max_frames(client, vlm, tmp_path):
    clip = write_clip(tmp_path / "clip.mp4")
    (want,), _ = answer_in_process(vlm, ["What happens?"], 10, [("video", str(clip))])  # 4 frames
    part = {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4"), "max_frames": 4}}
    r = client.chat.completions.create(model="demo", max_tokens=10, messages=[
        {"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}])
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens_details.model_dump()["video_tokens"] == 4 * vlm.cfg.image_tokens


def encoded_frames(n: int, shape: tuple[int, int], step: int, fmt: str) -> list[bytes]:
    """n flat frames of `shape`, frame i at gray level step * i, each encoded as `fmt`."""
    frames = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(np.full((*shape, 3), step * i, np.uint8)).save(buf, fmt)
        frames.append(buf.getvalue())
    return frames


def test_video_part_presampled_jpeg_frames(client, vlm):
    frames = encoded_frames(3, (40, 56), 60, "JPEG")
    decoded = [np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in frames]
    (want,), _ = answer_in_process(vlm, ["Describe."], 8, [("video", decoded)])
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    r = client.chat.completions.create(model="demo", max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                     {"type": "text", "text": "Describe."}]}])
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens_details.model_dump()["video_tokens"] == 3 * vlm.cfg.image_tokens


def test_bad_image_is_a_400_and_is_not_retried(client, server):
    before = server.metric("requests_total", code="400")
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": [bad, {"type": "text",
                                                                                                  "text": "hi"}]}])
    assert e.value.status_code == 400 and "messages[0].content[0]" in e.value.message
    assert server.metric("requests_total", code="400") == before + 1  # the client retries 5xx, never this


def test_stop_strings_cut_the_answer(client, vlm):
    (full,), _ = answer_in_process(vlm, ["Go on."], 16)
    words = full.split()
    stop = words[len(words) // 2]
    want = full[:full.index(stop)]
    for stream in (False, True):
        r = client.chat.completions.create(model="demo", max_tokens=16, stop=[stop, "\x00never"], stream=stream,
                                           messages=[{"role": "user", "content": "Go on."}])
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            text, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
        assert text == want and finish == ["stop"]


@pytest.mark.parametrize("pieces", [["ab", "cSTOPd"], ["abcS", "TO", "Pd"], ["abc", "S", "T", "O", "P"]])
def test_stop_matcher_across_pieces(pieces):
    m = StopMatcher(["STOP"])
    out, hit = "", False
    for p in pieces:
        text, hit = m.push(p)
        out += text
        if hit:
            break
    assert hit and out == "abc"
    m = StopMatcher(["STOP"])
    assert "".join(m.push(p)[0] for p in ["aS", "Tb", "S"]) + m.flush() == "aSTbS"  # held back, then released


# -- raw HTTP ----------------------------------------------------------------------------------------------
def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_malformed_json(server):
    assert_error(post(server, b'{"messages": [}'), 400, code="invalid_json")


def test_body_over_the_limit_is_413(server):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]})
    assert_error(post(server, big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit applies while the body is read
        for _ in range(MAX_BODY // 65536 + 2):
            yield b" " * 65536
    assert_error(post(server, chunks()), 413, code="request_too_large")


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "q"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "q"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "q"}], "top_p": "high"}, "top_p"),
    ({"messages": [{"role": "user", "content": "q"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "q"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA",
                                                                                   "max_frames": 1000}}]}]},
     "messages[0].content[0].video_url.max_frames"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param):
    assert_error(post(server, body), 400, param=param)


def test_bad_base64(server):
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not-base64@@@"}}
    assert_error(post(server, {"messages": [{"role": "user", "content": [part]}]}), 400,
                 param="messages[0].content[0].image_url.url", code="invalid_base64")


def test_bad_video_is_a_400(server):
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"junk" * 50).decode()}}
    assert_error(post(server, {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}]}), 400,
                 param="messages[0].content[0]", code="invalid_video")


def test_api_key(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(post(server, body, key=None), 401, code="invalid_api_key")
    assert_error(post(server, body, key="wrong"), 401, code="invalid_api_key")
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    assert post(server, body).status_code == 200
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # open, for load balancers
    assert_error(httpx.get(server.url + "/v2/nothing"), 404)


def test_context_overflow_is_a_400_and_the_server_goes_on(server, client, vlm):
    long = "word " * (vlm.cfg.text.max_seq_len + 10)
    assert_error(post(server, {"messages": [{"role": "user", "content": long}]}), 400,
                 code="context_length_exceeded")
    (want,), _ = answer_in_process(vlm, ["Short one."], 6)
    r = client.chat.completions.create(model="demo", max_tokens=6, messages=[{"role": "user", "content": "Short one."}])
    assert r.choices[0].message.content == want


def test_without_the_serve_extra_it_prints_the_pip_command():
    code = ("import sys; sys.modules['uvicorn'] = None; from tinyvila.serve.__main__ import main; "
            "sys.exit(main(['--model', 'demo']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and 'pip install "tinyvila[serve]"' in r.stderr, r.stderr


# -- disconnects, prefix reuse, load -----------------------------------------------------------------------
def test_disconnect_mid_stream_frees_the_worker(vlm):
    body = {"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 3500, "stream": True}
    next_body = {"messages": [{"role": "user", "content": "And now?"}], "max_tokens": 8}
    endless = copy.copy(vlm)  # the same weights with no stop token: every answer runs to max_tokens
    endless.stop_ids = frozenset()
    a = Server(endless)
    try:
        with httpx.stream("POST", a.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(4)) if line.startswith("data:")]
        assert len(got) >= 2  # the answer was streaming when the client left
        deadline = time.monotonic() + 20
        while a.metric("cancelled_total") < 1:
            assert time.monotonic() < deadline, "the worker never noticed the disconnect"
            time.sleep(0.01)
        assert 0 < a.metric("completion_tokens_total") < 1000  # of 3500: it stopped early
        after = post(a, next_body, key=None).json()["choices"][0]["message"]["content"]
    finally:
        a.close()
    b = Server(endless)
    try:
        fresh = post(b, next_body, key=None).json()["choices"][0]["message"]["content"]
    finally:
        b.close()
    assert after == fresh


QUESTIONS = ["What is in the image?", "What colour is it?", "Is it large?", "Where is it?", "Why?"]


def run_conversation(server, questions, max_tokens=10):
    """Ask `questions` statelessly (each request resends the whole conversation, the image in the first message);
    -> the responses' JSON."""
    messages, out = [], []
    for i, q in enumerate(questions):
        messages.append(image_message(q) if i == 0 else {"role": "user", "content": q})
        r = post(server, {"model": "demo", "messages": messages, "max_tokens": max_tokens}, key=None).json()
        out.append(r)
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return out


def test_prefix_reuse_equals_no_reuse_and_prefills_only_the_suffix(vlm):
    answers, chat = answer_in_process(vlm, QUESTIONS[:1], 10, [("image", DEMO_IMAGE)])
    prefills = [chat.stats.prefill_tokens]
    for q in QUESTIONS[1:]:
        answers.append("".join(chat.ask(q, tinyvila.SamplingParams(max_new_tokens=10))))
        prefills.append(chat.stats.prefill_tokens)
    reuse, fresh = Server(vlm, cache_size=4), Server(vlm, cache_size=0)
    try:
        with_reuse, without = run_conversation(reuse, QUESTIONS), run_conversation(fresh, QUESTIONS)
        assert reuse.metric("prefix_cache_hits_total") == 4 and reuse.metric("prefix_cache_misses_total") == 0
        assert fresh.metric("prefix_cache_misses_total") == 4
        # an edited history matches no cached chat: prefilled whole, answered as the no-reuse server answers it
        edited = [image_message(QUESTIONS[0]), {"role": "assistant", "content": "something else"},
                  {"role": "user", "content": QUESTIONS[1]}]
        r1, r2 = (post(s, {"messages": edited, "max_tokens": 10}, key=None).json() for s in (reuse, fresh))
        assert reuse.metric("prefix_cache_misses_total") == 1 and r1["choices"] == r2["choices"]
    finally:
        reuse.close()
        fresh.close()
    for k, (a, b) in enumerate(zip(with_reuse, without)):
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"] == answers[k]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert a["stats"]["prefill_tokens"] == prefills[k]  # the same suffix the stateful Chat prefilled
        assert b["stats"]["prefill_tokens"] == b["usage"]["prompt_tokens"]  # everything, every time
        assert a["stats"]["prefix_reused"] == (k > 0) and not b["stats"]["prefix_reused"]
        if k > 0:  # the whole earlier conversation came from the cache
            prev = with_reuse[k - 1]["usage"]
            assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == prev["total_tokens"] - 1
            assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_new_conversation_reuses_the_chat_a_full_cache_pushes_out(vlm):
    """cache_size 1: a second conversation takes the first one's chat (cleared, its system prompt replaced), so a
    busy server keeps its KV caches and captured graphs; it answers as a fresh stateful Chat does, its follow-up too."""
    want, _ = answer_in_process(vlm, QUESTIONS[:2], 10, [("image", DEMO_IMAGE)])
    s = Server(vlm, cache_size=1)
    try:
        first = post(s, {"messages": [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Count to three."}], "max_tokens": 10}, key=None)
        assert first.status_code == 200
        (chat,) = [e.chat for e in s.engine.cache.entries.values()]
        got = run_conversation(s, QUESTIONS[:2])
        (entry,) = s.engine.cache.entries.values()
        assert entry.chat is chat and chat.system is None
        assert s.metric("chats_recycled_total") == 1 and s.metric("prefix_cache_hits_total") == 1
        assert [r["choices"][0]["message"]["content"] for r in got] == want
    finally:
        s.close()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_bounded_load_50_requests_from_8_threads(vlm):
    prompts = [f"Question number {i}?" for i in range(5)]
    want = {p: answer_in_process(vlm, [p], 3)[0][0] for p in prompts}
    chats = lambda: sum(type(o) is Chat for o in gc.get_objects())  # noqa: E731
    gc.collect()
    before = chats()  # the chats other servers keep
    s = Server(vlm, cache_size=4)
    try:
        def ask(i):
            p = prompts[i % len(prompts)]
            r = post(s, {"messages": [{"role": "user", "content": p}], "max_tokens": 3}, key=None)
            return p, r.status_code, r.json()["choices"][0]["message"]["content"]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(ask, range(16)))  # warm-up: allocator pools, threads, connections
            gc.collect()
            rss = _rss_mb()
            results = list(pool.map(ask, range(50)))
        gc.collect()
        assert all(code == 200 and text == want[p] for p, code, text in results)
        assert len(s.engine.cache.entries) <= 4 and s.engine.queue.qsize() == 0
        assert chats() - before <= 4, f"{chats() - before} chats alive: the LRU does not bound them"
        assert _rss_mb() - rss < 64, "memory grew under load"
    finally:
        s.close()


def test_full_queue_is_503(vlm):
    engine = Engine(vlm, cache_size=0, max_queue=1)
    started = threading.Event()
    req = parse_request({"messages": [{"role": "user", "content": "long"}], "max_tokens": 3000, "stream": True},
                        Defaults())
    first = Job(req, lambda kind, _: started.set() if kind == "start" else None)
    second = Job(req, lambda *_: None)
    try:
        engine.submit(first)
        assert started.wait(30)
        engine.submit(second)  # waits in the queue
        with pytest.raises(RequestError) as e:
            engine.submit(Job(req, lambda *_: None))
        assert e.value.status == 503 and e.value.code == "queue_full"
    finally:
        first.cancelled.set()
        second.cancelled.set()
        engine.close()


def test_prefix_cache_gives_way_when_memory_is_short():
    free = {"bytes": 0}
    cache = PrefixCache(8, free_bytes=lambda: free["bytes"])
    for k in "abc":
        cache.put(k, object())

    def free_after_drop():  # each chat dropped frees 100 bytes
        return 100 * (3 - len(cache.entries))
    cache.free_bytes = free_after_drop
    cache.make_room(150)
    assert list(cache.entries) == ["c"]  # oldest first, and only as many as needed
    cache.put("d", object())
    small = PrefixCache(2)
    for k in "xyz":
        small.put(k, object())
    assert list(small.entries) == ["y", "z"]


def test_metrics_exposition(server, client):
    client.chat.completions.create(model="demo", max_tokens=3, messages=[{"role": "user", "content": "Count."}])
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("tinyvila_requests", "tinyvila_prefix_cache_hits", "tinyvila_prefix_cache_misses",
                 "tinyvila_queue_depth", "tinyvila_ttft_seconds", "tinyvila_decode_tokens_per_second",
                 "tinyvila_completion_tokens"):
        assert name in families, name
    assert [f.type for f in (families["tinyvila_ttft_seconds"], families["tinyvila_queue_depth"],
                             families["tinyvila_requests"])] == ["histogram", "gauge", "counter"]
    ttft = {(s.name, s.labels.get("le")): s.value for s in families["tinyvila_ttft_seconds"].samples}
    buckets = [v for (n, le), v in ttft.items() if n.endswith("_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == ttft[("tinyvila_ttft_seconds_count", None)] > 0
    ok = [s.value for s in families["tinyvila_requests"].samples if s.labels.get("code") == "200"]
    assert ok and ok[0] >= 1
    for kind in ("HELP", "TYPE"):
        assert f"# {kind} tinyvila_ttft_seconds " in text


# -- media sources behind flags, history replay ----------------------------------------------------------
def test_file_urls_only_under_the_allowed_folder(vlm, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "demo.png").write_bytes(DEMO_IMAGE.read_bytes())
    clip = write_clip(media / "clip.mp4")
    (want_image,), _ = answer_in_process(vlm, ["What?"], 6, [("image", DEMO_IMAGE)])
    (want_video,), _ = answer_in_process(vlm, ["What?"], 6, [("video", str(clip))])
    s = Server(vlm, policy=MediaPolicy(local_root=media))
    try:
        def ask(kind, url):
            part = {"type": f"{kind}_url", f"{kind}_url": {"url": url, **({"max_frames": 4} if kind == "video" else {})}}
            return post(s, {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}],
                            "max_tokens": 6}, key=None)
        assert ask("image", (media / "demo.png").as_uri()).json()["choices"][0]["message"]["content"] == want_image
        assert ask("video", clip.as_uri()).json()["choices"][0]["message"]["content"] == want_video
        assert_error(ask("image", f"file://{media}/../media/../{DEMO_IMAGE.name}"), 400, code="invalid_url")
        assert_error(ask("image", DEMO_IMAGE.as_uri()), 400, code="invalid_url")  # outside the folder
        assert_error(ask("image", (media / "none.png").as_uri()), 400, code="invalid_url")
    finally:
        s.close()


def test_http_media_only_with_the_flag(vlm, tmp_path):
    import functools
    import http.server

    (tmp_path / "demo.png").write_bytes(DEMO_IMAGE.read_bytes())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{files.server_address[1]}/demo.png"
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": url},
                                                      {"type": "text", "text": "What?"}]}], "max_tokens": 6}
    (want,), _ = answer_in_process(vlm, ["What?"], 6, [("image", DEMO_IMAGE)])
    on = Server(vlm, policy=MediaPolicy(allow_http=True, allow_private_hosts=True))  # the file server is on loopback
    small = Server(vlm, policy=MediaPolicy(allow_http=True, allow_private_hosts=True, max_bytes=100))
    public_only = Server(vlm, policy=MediaPolicy(allow_http=True))
    try:
        assert post(on, body, key=None).json()["choices"][0]["message"]["content"] == want
        assert_error(post(small, body, key=None), 413, code="media_too_large")
        missing = json.loads(json.dumps(body).replace("demo.png", "none.png"))
        assert_error(post(on, missing, key=None), 400, code="invalid_url")
        r = post(public_only, body, key=None)
        assert_error(r, 400, code="invalid_url")
        assert "non-public address" in r.json()["error"]["message"]
    finally:
        on.close()
        small.close()
        public_only.close()
        files.shutdown()


def test_http_media_hosts_must_be_public_and_so_must_redirects(monkeypatch):
    """A fetch (and every redirect it follows) must resolve to global addresses only: no loopback services, LAN hosts
    or cloud metadata endpoint (169.254.169.254) through the server, unless --allow-private-media-hosts."""
    media = serve_media
    answers = {"public.test": "93.184.216.34", "meta.test": "169.254.169.254", "lan.test": "192.168.1.20",
               "six.test": "::1"}
    monkeypatch.setattr(media.socket, "getaddrinfo", lambda host, *a, **k: [(0, 0, 0, "", (answers[host], 0))])
    policy = MediaPolicy(allow_http=True)
    media._check_host("http://public.test/a.png", "img", policy)
    for host in ("meta.test", "lan.test", "six.test"):
        with pytest.raises(RequestError, match="non-public address"):
            media._check_host(f"https://{host}/a.png", "img", policy)
        media._check_host(f"https://{host}/a.png", "img", MediaPolicy(allow_http=True, allow_private_hosts=True))
    redirects = media._CheckedRedirects("img", policy)
    for target in ("http://meta.test/latest/meta-data/", "file:///etc/passwd"):
        with pytest.raises(RequestError):
            redirects.redirect_request(None, None, 302, "Found", {}, target)


def test_presampled_frames_over_max_frames_are_sampled_before_decoding(client, vlm):
    frames = encoded_frames(5, (32, 32), 50, "PNG")
    from tinyvila.video import sample_indices

    picks = sample_indices(5, 2)
    decoded = [np.asarray(Image.open(io.BytesIO(frames[i])).convert("RGB")) for i in picks]
    (want,), _ = answer_in_process(vlm, ["Describe."], 8, [("video", decoded)])
    items = [base64.b64encode(f).decode() for f in frames]
    items[[i for i in range(5) if i not in picks][0]] = "@@not-base64@@"  # never decoded: not picked
    url = "data:video/png;base64," + ",".join(items)
    r = client.chat.completions.create(model="demo", max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url, "max_frames": 2}}, {"type": "text", "text": "Describe."}]}])
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens_details.model_dump()["video_tokens"] == 2 * vlm.cfg.image_tokens


def test_add_turn_replays_history_and_is_a_transaction(vlm):
    (first, second), stateful = answer_in_process(vlm, ["One?", "Two?"], 8, [("image", DEMO_IMAGE)])
    chat = vlm.chat(sampling=tinyvila.SamplingParams(max_new_tokens=8))
    chat.add_image(DEMO_IMAGE)
    with pytest.raises(tinyvila.ContextLimitError):
        chat.add_turn("One?", "word " * vlm.cfg.text.max_seq_len)
    assert chat.turns == [] and chat.decoder.length == 0 and len(chat.images) == 1  # nothing changed
    chat.add_turn("One?", first)
    assert "".join(chat.ask("Two?")) == second
    assert chat.decoder.length == stateful.decoder.length


# -- history media on a prefix hit, digests, SSE writes ----------------------------------------------------
def test_a_prefix_hit_decodes_no_history_media(vlm, monkeypatch):
    """A stateless follow-up resends the first turn's image: with its chat cached the image is only hashed, not
    decoded; without the cache every request decodes it. The answers are the same."""
    decoded = []
    real = serve_media._image_pixels
    monkeypatch.setattr(serve_media, "_image_pixels", lambda *a: decoded.append(1) or real(*a))
    reuse, fresh = Server(vlm, cache_size=4), Server(vlm, cache_size=0)
    try:
        with_reuse = run_conversation(reuse, QUESTIONS[:3])
        assert len(decoded) == 1 and reuse.metric("prefix_cache_hits_total") == 2
        decoded.clear()
        without = run_conversation(fresh, QUESTIONS[:3])
        assert len(decoded) == 3
    finally:
        reuse.close()
        fresh.close()
    assert [r["choices"] for r in with_reuse] == [r["choices"] for r in without]


def media_of(content: list, **fields) -> list:
    """The Media of one user message with `content` parts, as the server reads them (nothing decoded)."""
    req = parse_request({"messages": [{"role": "user", "content": content}]}, Defaults())
    read_media(req.turns, MediaPolicy(**fields), preset("tiny-siglip-llama").vision)
    return req.turns[0].media


def test_media_digests_follow_the_medium_and_its_sampling_fields():
    png, other = (data_url(DEMO_IMAGE, "image/png"), "data:image/png;base64," +
                  base64.b64encode(encoded_frames(1, (20, 30), 9, "PNG")[0]).decode())
    image = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    video = lambda url, **kw: {"type": "video_url", "video_url": {"url": url, **kw}}  # noqa: E731
    a, b, c = media_of([image(png), image(png), image(other)])
    assert a.digest == b.digest != c.digest and len(a.digest) == 64  # SHA-256: equal only for equal media
    assert a.pixels is None and a._digest is not None  # hashed (by that comparison), not decoded
    (v,), (v2,), (v3,) = media_of([video(png)]), media_of([video(png, max_frames=2)]), media_of([video(png)],
                                                                                                  video_frames=4)
    assert len({a.digest, v.digest, v2.digest, v3.digest}) == 4  # the same bytes sampled otherwise: other pixels
    (bad,) = media_of([image("data:image/png;base64,@@@not-base64@@@")])
    assert bad.digest  # a digest needs no decoding; decoding finds the fault
    with pytest.raises(RequestError) as e:
        bad.decode()
    assert e.value.code == "invalid_base64" and e.value.param == "messages[0].content[0].image_url.url"


def test_mime_style_base64_decodes_as_plain_base64():
    plain = data_url(DEMO_IMAGE, "image/png")
    head, data = plain.split(",", 1)
    wrapped = head + "," + "\n".join(data[i:i + 76] for i in range(0, len(data), 76))
    (a, b) = media_of([{"type": "image_url", "image_url": {"url": u}} for u in (plain, wrapped)])
    assert np.array_equal(a.decode(), b.decode()) and a.pixels.shape[0] == 1


def test_the_engine_decodes_history_media_the_request_thread_skipped(vlm):
    """The request's thread skips a history's media when the engine holds its chat; should the chat be gone when
    the request runs, the worker decodes them itself (and a bad one is the client's 400, before anything changed)."""
    (first, second), _ = answer_in_process(vlm, QUESTIONS[:2], 8, [("image", DEMO_IMAGE)])
    engine = Engine(vlm, cache_size=2)

    def run(image_url: str) -> list:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                                 {"type": "text", "text": QUESTIONS[0]}]},
                    {"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
        req = parse_request({"messages": messages, "max_tokens": 8}, Defaults())
        read_media(req.turns, MediaPolicy(), vlm.cfg.vision)
        serve_media.decode_media(req.turns[-1:])  # as the request's thread does on a hit
        assert req.turns[0].media[0].pixels is None
        events, done = [], threading.Event()
        engine.submit(Job(req, lambda kind, payload: (events.append((kind, payload)),
                                                      kind in ("done", "error") and done.set())))
        assert done.wait(60)
        return events
    try:
        bad = run("data:image/png;base64," + base64.b64encode(b"not a png").decode())
        assert [k for k, _ in bad] == ["error"] and bad[0][1].code == "invalid_image"
        good = run(data_url(DEMO_IMAGE, "image/png"))
        assert "".join(p for k, p in good if k == "text") == second and good[-1][0] == "done"
    finally:
        engine.close()


def sse_writes(events: list, include_usage: bool = False) -> list[str]:
    """What app._stream writes for `events` queued before it runs."""
    async def run():
        queue = asyncio.Queue()
        for e in events:
            queue.put_nowait(e)
        req = parse_request({"messages": [{"role": "user", "content": "q"}],
                             "stream_options": {"include_usage": include_usage}}, Defaults())
        return [w async for w in serve_app._stream(Job(req, lambda *_: None), queue, req, "id", 0)]
    return asyncio.run(run())


def test_sse_events_queued_together_go_out_in_one_write():
    done = ("done", {"finish": "length", "usage": {"completion_tokens": 3}, "stats": {}})
    (write,) = sse_writes([("text", "a"), ("text", "b"), done], include_usage=True)
    events = [json.loads(e[6:]) for e in write.split("\n\n") if e.startswith("data: {")]
    assert [e["choices"][0]["delta"] for e in events[:3]] == [{"role": "assistant", "content": ""}, {"content": "a"},
                                                              {"content": "b"}]
    assert events[3]["choices"][0]["finish_reason"] == "length" and events[4]["usage"]["completion_tokens"] == 3
    assert write.endswith("data: [DONE]\n\n") and write.count("data: ") == 6


def test_sse_events_that_come_during_a_write_go_in_the_next():
    """The first piece is not held back for the ones the worker emits after it."""
    async def run():
        queue, req = asyncio.Queue(), parse_request({"messages": [{"role": "user", "content": "q"}]}, Defaults())
        stream = serve_app._stream(Job(req, lambda *_: None), queue, req, "id", 0)
        queue.put_nowait(("text", "a"))
        first = await anext(stream)
        queue.put_nowait(("text", "b"))
        queue.put_nowait(("done", {"finish": "stop", "usage": {}, "stats": {}}))
        return first, [w async for w in stream]
    first, rest = asyncio.run(run())
    assert first.count("data: ") == 2 and '"content":"a"' in first  # the role chunk and the first piece
    assert len(rest) == 1 and '"content":"b"' in rest[0] and rest[0].endswith("data: [DONE]\n\n")
