"""The engine: one worker thread owns the model and answers requests one at a time, in arrival order (FIFO).

Batch size 1 is this runtime's design: its kernels, CUDA graphs and SparseVILA's per-question retrieval are built
for one sequence at a time, so requests queue rather than share a batch. Media to prefill arrive decoded and resized
(media.py runs in the request's thread, off the worker); the worker only encodes them and runs the turn. It checks
its job's `cancelled` flag after every piece of the answer, so a client that disconnects frees it within one decode
batch (greedy decoding synchronises with the host every 16 tokens).

Prefix reuse. The API is stateless: a multi-turn client resends the whole conversation. The engine keeps the Chats
(with their KV caches) of the last conversations it answered in an LRU, keyed by their history: the system prompt,
and per turn the user text, the media digests and the answer text that Chat generated. A request whose messages
before the last user message equal such a history takes that Chat and prefills only its new question; any other
request opens a fresh Chat, which prefills the resent history (`Chat.add_turn`) and then the question. The request's
thread skips decoding the media of a history `holds` finds cached; should that chat be gone by the time the request
runs, the worker decodes them before it changes anything. The LRU holds at most `cache_size` chats and, on CUDA,
gives up its oldest while free GPU memory is below two chats' KV caches (the one to open and room for its prefill),
so reuse never makes a request run out of memory. A new conversation arriving while the LRU is full reuses the chat
it would push out (cleared), so in steady state a request neither allocates a KV cache nor captures CUDA graphs.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import ContextLimitError, TinyVilaError
from .media import decode_media
from .metrics import Metrics
from .protocol import FINISH, Request, RequestError, StopMatcher, Turn

log = logging.getLogger("tinyvila.serve")


@dataclass
class Job:
    """One request on its way through the engine. `emit(kind, payload)` is called in the worker thread:
    ("start", None) when the first token is out, ("text", str) per piece of the answer, then ("done", dict) or
    ("error", RequestError) last."""

    request: Request
    emit: Callable[[str, object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    received: float = field(default_factory=time.perf_counter)
    first_token: float | None = None  # perf_counter when the first piece came out


@dataclass
class _Entry:
    chat: object
    image_tokens: int = 0   # visual tokens of the conversation's images and videos, as prefilled
    video_tokens: int = 0


def history_key(system: str | None, turns: list[Turn]) -> str:
    """What prefix reuse compares: the system prompt and, per finished turn, its text, media digests and answer."""
    h = hashlib.sha256(repr(system).encode())
    for t in turns:
        h.update(repr((t.text, [m.digest for m in t.media], t.answer)).encode())
    return h.hexdigest()


class PrefixCache:
    """The LRU of reusable chats: at most `size`, and (where `free_bytes` tells free device memory) none kept while
    memory is short."""

    def __init__(self, size: int, free_bytes: Callable[[], int] | None = None):
        self.size, self.free_bytes = size, free_bytes
        self.entries: OrderedDict[str, _Entry] = OrderedDict()

    def take(self, key: str) -> _Entry | None:
        return self.entries.pop(key, None)

    def put(self, key: str, entry: _Entry) -> None:
        if self.size > 0:
            self.entries[key] = entry
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)

    def make_room(self, need: int) -> None:
        """Drop the oldest chats while less than `need` bytes of device memory are free."""
        if self.free_bytes is None:
            return
        while self.entries and self.free_bytes() < need:
            self.entries.popitem(last=False)
            torch.cuda.empty_cache()


def cuda_free_bytes(device: torch.device) -> Callable[[], int]:
    """Free memory of a CUDA device, counting what torch's allocator holds but does not use."""
    def free() -> int:
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free


class Engine:
    """The worker thread and its queue. `submit` a Job; `close` stops the worker after the job it runs."""

    def __init__(self, vlm, *, sparsity=None, max_seq_len: int | None = None, cache_size: int = 4,
                 max_queue: int = 64, metrics: Metrics | None = None):
        self.vlm, self.sparsity, self.max_seq_len = vlm, sparsity, max_seq_len
        device = vlm.model.device
        self.cache = PrefixCache(cache_size, cuda_free_bytes(device) if device.type == "cuda" else None)
        self.metrics = metrics or Metrics()
        self.queue: queue.Queue[Job | None] = queue.Queue(max_queue)
        self._chat_bytes = 0  # one chat's KV cache, once the first is open
        self._thread = threading.Thread(target=self._loop, name="tinyvila-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or RequestError (503) when the queue is full."""
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise RequestError(f"the server is busy: {self.queue.maxsize} requests are waiting; retry later",
                               status=503, type="server_error", code="queue_full") from None
        self.metrics.set("queue_depth", self.queue.qsize())

    def holds(self, req: Request) -> bool:
        """Whether a chat holding the request's history is cached now (from any thread: it may be gone, or pushed out,
        by the time the worker takes the request)."""
        return len(req.turns) > 1 and history_key(req.system, req.turns[:-1]) in self.cache.entries

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self.queue.get()) is not None:
            self.metrics.set("queue_depth", self.queue.qsize())
            if job.cancelled.is_set():  # its client left while it waited
                continue
            try:
                self._serve(job)
            except RequestError as e:
                job.emit("error", e)
            except TinyVilaError as e:  # bad input found late (e.g. a turn that does not fit): the client's fault
                code = "context_length_exceeded" if isinstance(e, ContextLimitError) else None
                job.emit("error", RequestError(str(e), "messages", code=code))
            except Exception as e:  # a defect: logged, answered as one, and the worker goes on
                log.exception("request failed")
                job.emit("error", RequestError(f"internal error: {type(e).__name__}: {e}", status=500,
                                               type="server_error", code="internal_error"))

    # -- one request ---------------------------------------------------------------------------------
    def _serve(self, job: Job) -> None:
        req = job.request
        history, last = req.turns[:-1], req.turns[-1]
        key = history_key(req.system, history)
        entry = self.cache.take(key) if history else None
        if history:
            self.metrics.inc("prefix_cache_hits_total" if entry else "prefix_cache_misses_total")
        if entry is None:  # every medium gets prefilled: any the request's thread skipped is decoded before a change
            decode_media(req.turns)
        reused = entry is not None
        cached = entry.chat.decoder.length if reused else 0
        if entry is None:
            entry = self._fresh(req)
        chat = entry.chat
        self._add_media(entry, last.media)
        try:
            text, finish = self._stream(job, chat.ask(last.text, req.sampling), req.stop)
        except BaseException:
            if reused and len(chat.turns) == len(history):  # the turn changed nothing: keep the chat
                chat.discard_pending()
                self.cache.put(key, entry)
            raise
        if job.cancelled.is_set():  # nobody reads the answer; the partial conversation is not worth caching
            self.metrics.inc("cancelled_total")
            self.metrics.inc("completion_tokens_total", chat.stats.decode_tokens)
            return
        answer = chat.vlm.tokenizer.decode(chat.turns[-1][2], skip_special_tokens=True)
        self.cache.put(history_key(req.system, [*history, Turn(last.text, [], answer, last.media)]), entry)
        self.metrics.set("cached_chats", len(self.cache.entries))
        job.emit("done", self._summary(job, chat.stats, entry, finish or FINISH[chat.stats.finish], cached, reused))

    def _fresh(self, req: Request) -> _Entry:
        """A chat for a new conversation holding the request's history (prefilled now, as the client sent it).
        When the LRU is full, its oldest chat (the one this conversation's entry will push out) is cleared and
        reused: its KV cache stays allocated and its captured CUDA graphs (first-turn prefill, decode step) stay
        valid, so a busy server does not allocate and capture per conversation."""
        chat = self._recycle()
        if chat is not None:
            chat.clear()
            chat.system = req.system
            self.metrics.inc("chats_recycled_total")
        else:
            if self._chat_bytes:
                self.cache.make_room(2 * self._chat_bytes)
            chat = self.vlm.chat(system=req.system, sparsity=self.sparsity, max_seq_len=self.max_seq_len)
        kv = chat.decoder.cache
        self._chat_bytes = kv.k_stack.nbytes + kv.v_stack.nbytes
        entry = _Entry(chat)
        for turn in req.turns[:-1]:
            self._add_media(entry, turn.media)
            chat.add_turn(turn.text, turn.answer)
        return entry

    def _recycle(self):
        """The LRU's oldest chat, taken out, when the LRU is full; else None."""
        entries = self.cache.entries
        if self.cache.size > 0 and len(entries) >= self.cache.size:
            return entries.popitem(last=False)[1].chat
        return None

    def _add_media(self, entry: _Entry, media: list) -> None:
        """Encode a turn's media into its chat, counting their visual tokens."""
        chat = entry.chat
        for m in media:
            before = sum(x.shape[0] * x.shape[1] for x in chat.images)
            pixels = m.decode()  # a no-op unless the request's thread skipped it
            if m.kind == "image":
                chat.add_image(pixels[0])
            else:
                chat.add_video(list(pixels), num_frames=len(pixels))
            added = sum(x.shape[0] * x.shape[1] for x in chat.images) - before
            if m.kind == "image":
                entry.image_tokens += added
            else:
                entry.video_tokens += added

    def _stream(self, job: Job, answer, stops: list[str]) -> tuple[str, str | None]:
        """Read the answer into job.emit, cut at a stop string; -> (the text sent, "stop" when a stop string cut
        it, else None). Closes the answer when the client has gone or a stop string appeared."""
        matcher, sent, finish, first = StopMatcher(stops), [], None, True
        try:
            for piece in answer:
                if first:
                    job.first_token = time.perf_counter()
                    job.emit("start", None)
                    self.metrics.observe("ttft_seconds", job.first_token - job.received)
                    first = False
                if job.cancelled.is_set():
                    break
                text, hit = matcher.push(piece)
                if text:
                    sent.append(text)
                    job.emit("text", text)
                if hit:
                    finish = "stop"
                    break
            else:
                if tail := matcher.flush():
                    sent.append(tail)
                    job.emit("text", tail)
        finally:
            answer.close()
        return "".join(sent), finish

    def _summary(self, job: Job, stats, entry: _Entry, finish: str, cached: int, reused: bool) -> dict:
        prompt = stats.context_tokens - stats.decode_tokens
        m = self.metrics
        m.inc("prompt_tokens_total", prompt)
        m.inc("prefill_tokens_total", prompt - cached)
        m.inc("completion_tokens_total", stats.decode_tokens)
        if stats.decode_tokens > 1:
            m.observe("decode_tokens_per_second", stats.decode_tok_s)
        usage = {"prompt_tokens": prompt, "completion_tokens": stats.decode_tokens,
                 "total_tokens": prompt + stats.decode_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached, "image_tokens": entry.image_tokens,
                                           "video_tokens": entry.video_tokens}}
        info = {"line": stats.line(), "encode_ms": round(stats.encode_ms, 2), "prefill_ms": round(stats.prefill_ms, 2),
                "prefill_tokens": prompt - cached, "ttft_ms": round(stats.ttft_ms, 2),
                "server_ttft_ms": round(1000 * (job.first_token - job.received), 2) if job.first_token else None,
                "decode_tokens_per_second": round(stats.decode_tok_s, 1), "context_tokens": stats.context_tokens,
                "prefix_reused": reused}
        return {"finish": finish, "usage": usage, "stats": info}
