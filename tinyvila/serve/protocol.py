"""The OpenAI chat-completions protocol: request JSON -> a checked `Request`, answers -> response JSON and SSE chunks.

Follows OpenAI's API as vLLM and SGLang serve it (the conventions clients are written against): `messages` with
system / user / assistant roles, sampling fields, `stream` with `stream_options.include_usage`, errors as
`{"error": {"message", "type", "param", "code"}}`. Every fault in a request is a `RequestError` with a 4xx status:
the official client retries 5xx twice, which would re-run a rejected request's work.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from ..errors import ArgumentError
from ..generate import SamplingParams
from ..tokenizer.templates import IMAGE_PLACEHOLDER

MAX_STOP = 4  # OpenAI's limit on stop strings
# Fields whose non-default values this runtime cannot honour: refused rather than silently ignored.
UNSUPPORTED = {"n": 1, "logprobs": False, "frequency_penalty": 0, "presence_penalty": 0, "tools": None,
               "tool_choice": None, "functions": None, "logit_bias": None}


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI's error `type`, the `param` at fault, a `code`."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Part:
    """One media content part as sent, not yet decoded (media.py decodes it)."""

    kind: str                   # "image" | "video"
    url: str
    where: str                  # e.g. "messages[1].content[0]": what errors name
    fps: float | None = None    # video: frames per second to sample (SGLang's field)
    max_frames: int | None = None


@dataclass
class Turn:
    """A user message (its text and media parts, in order) and the assistant answer that followed it (None for
    the last, the one to answer). `media` is filled by media.py: digests, and pixels once decoded."""

    text: str
    parts: list[Part]
    answer: str | None = None
    media: list = field(default_factory=list)


@dataclass
class Request:
    system: str | None
    turns: list[Turn]
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    model: str


@dataclass(frozen=True)
class Defaults:
    """The server's defaults for fields a request leaves out (its flags)."""

    model: str = "tinyvila"
    max_tokens: int = 512
    temperature: float = 0.0
    system: str | None = None       # for requests without a system message (None: the chat template's)


def parse_request(data, defaults: Defaults) -> Request:
    """A decoded JSON body -> Request; RequestError (400) naming the field at fault."""
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    model = data.get("model", defaults.model)
    if not isinstance(model, str):
        raise RequestError("'model' must be a string (any name is accepted: one model is served)", "model")
    for name, default in UNSUPPORTED.items():
        if data.get(name, default) not in (default, None):
            raise RequestError(f"'{name}' is not supported by this server (leave it out)", name)
    stream = _bool(data, "stream", False)
    options = data.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    system, turns = parse_messages(data.get("messages"))
    return Request(defaults.system if system is None else system, turns, _sampling(data, defaults), _stop(data.get("stop")), stream,
                   _bool(options, "include_usage", False, "stream_options."), model)


def _bool(d: dict, name: str, default: bool, prefix: str = "") -> bool:
    v = d.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{prefix}{name}' must be true or false, got {v!r}", prefix + name)
    return v


def _number(d: dict, name: str, default, integer: bool = False):
    v = d.get(name)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)
    if isinstance(v, bool) or not ok:
        raise RequestError(f"'{name}' must be {'a whole number' if integer else 'a finite number'}, got {v!r}", name)
    return v


def _sampling(data: dict, defaults: Defaults) -> SamplingParams:
    max_tokens = _number(data, "max_completion_tokens", None, True)
    max_tokens = _number(data, "max_tokens", defaults.max_tokens, True) if max_tokens is None else max_tokens
    fields = dict(temperature=_number(data, "temperature", defaults.temperature),
                  top_p=_number(data, "top_p", 1.0), top_k=max(0, _number(data, "top_k", 0, True)),
                  max_new_tokens=max_tokens, seed=_number(data, "seed", None, True))
    try:
        return SamplingParams(**fields)
    except ArgumentError as e:
        param = {"max_new_tokens": "max_tokens"}.get(e.name, e.name)
        raise RequestError(f"'{param}': {e}".replace("SamplingParams.max_new_tokens", "max_tokens"), param) from None


def _stop(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    return stops


# -- messages ----------------------------------------------------------------------------------------
def parse_messages(messages) -> tuple[str | None, list[Turn]]:
    """`messages` -> (system text or None, turns). Leading system (or developer) messages form the system prompt;
    then user and assistant messages alternate (consecutive user messages are joined), ending with a user one."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of messages", "messages")
    system, turns = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role in ("system", "developer"):
            if turns:
                raise RequestError("system messages must come before the conversation's first user message", where)
            system.append(_text_only(m.get("content"), where))
        elif role == "user":
            text, parts = _user_content(m.get("content"), where)
            if turns and turns[-1].answer is None:  # a second user message in a row joins the first
                turns[-1].text, turns[-1].parts = "\n".join(t for t in (turns[-1].text, text) if t), turns[-1].parts + parts
            else:
                turns.append(Turn(text, parts))
        elif role == "assistant":
            if not turns or turns[-1].answer is not None:
                raise RequestError("an assistant message must follow a user message", where)
            turns[-1].answer = _text_only(m.get("content"), where)
        else:
            raise RequestError(f"{where}.role must be 'system', 'user' or 'assistant', got {role!r}", f"{where}.role")
    if not turns or turns[-1].answer is not None:
        raise RequestError("the last message must be a user message (the one to answer)", "messages")
    return ("\n".join(system) if system else None), turns


def _text_only(content, where: str) -> str:
    """System and assistant content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(_text_of(p, f"{where}.content[{j}]") for j, p in enumerate(content))
    raise RequestError(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _text_of(part: dict, where: str) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise RequestError(f"{where}.text must be a string", f"{where}.text")
    return text


def _user_content(content, where: str) -> tuple[str, list[Part]]:
    """A user message's text (its text parts joined by newlines) and media parts. VILA puts media before the
    text; a text that places them itself holds one <image> per image."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    texts, parts = [], []
    for j, p in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text":
            texts.append(_text_of(p, w))
        elif kind in ("image_url", "video_url"):
            parts.append(_media_part(p, kind, w))
        else:
            raise RequestError(f"{w}.type {kind!r} is not supported: use 'text', 'image_url' or 'video_url'",
                               f"{w}.type", code="unsupported_content_type")
    text = "\n".join(texts)
    placed = text.count(IMAGE_PLACEHOLDER)
    if placed and (placed != len(parts) or any(p.kind == "video" for p in parts)):
        raise RequestError(f"{where}: the text holds {placed} {IMAGE_PLACEHOLDER} placeholders for {len(parts)} media "
                           f"parts; leave them out (media go before the text) or give one per image part",
                           f"{where}.content")
    return text, parts


def _media_part(p: dict, kind: str, where: str) -> Part:
    spec = p.get(kind)
    spec = {"url": spec} if isinstance(spec, str) else spec  # the bare-string form
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str) or not spec["url"]:
        raise RequestError(f"{where}.{kind}.url must be a non-empty string", f"{where}.{kind}.url")
    part = Part("image" if kind == "image_url" else "video", spec["url"], where)
    if kind == "video_url":
        fps = _number(spec, "fps", None) if "fps" in spec else p.get("fps")
        frames = _number(spec, "max_frames", None, True) if "max_frames" in spec else p.get("max_frames")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < math.inf):
            raise RequestError(f"{where}.video_url.fps must be a positive number, got {fps!r}", f"{where}.video_url.fps")
        if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
            raise RequestError(f"{where}.video_url.max_frames must be a whole number >= 1, got {frames!r}",
                               f"{where}.video_url.max_frames")
        part.fps, part.max_frames = fps, frames
    return part


# -- stop strings ------------------------------------------------------------------------------------
class StopMatcher:
    """Cuts a text stream at the first stop string: `push` returns the text safe to send and whether a stop string
    appeared (which is never sent). Text that may be the start of a stop string is held back until it is not."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""

    def push(self, piece: str) -> tuple[str, bool]:
        if not self.stops:
            return piece, False
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[:min(hits)], True
        keep = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


# -- responses ---------------------------------------------------------------------------------------
FINISH = {"stop": "stop", "max_tokens": "length", "context": "length", "interrupted": "stop"}


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def chunk(cid: str, model: str, created: int, delta: dict | None, finish: str | None = None,
          usage: dict | None = None, include_usage: bool = False, extra: dict | None = None) -> str:
    """One SSE event of a chat.completion.chunk; `delta` None makes the usage chunk (no choices)."""
    body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                   "finish_reason": finish}]}
    if include_usage:
        body["usage"] = usage
    body.update(extra or {})
    return sse(body)


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, separators=(',', ':'))}\n\n"


def completion(cid: str, model: str, text: str, finish: str, usage: dict, extra: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}], "usage": usage, **extra}
