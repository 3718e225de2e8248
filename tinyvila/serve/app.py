"""The HTTP routes: OpenAI's chat completions and model list, /health, /metrics, and the web chat page at /.

Built on Starlette, served by uvicorn (the `serve` extra): both are small pure-Python wheels with no pydantic; a
plain StreamingResponse carries server-sent events, and Starlette cancels it when the client disconnects. FastAPI
would add pydantic's compiled core for request models that protocol.py checks anyway, with errors in our own terms.

    POST /v1/chat/completions   (also /chat/completions, where VILA's own server has it)
    GET  /v1/models  /health  /metrics  /

With an API key set, /v1/* and /chat/completions need `Authorization: Bearer KEY`; /, /health and /metrics stay
open (the page asks for the key). A request is checked and the media it prefills decoded in the handler (4xx on any
fault), then queued for the engine's one worker; an error before the first token is an HTTP error, a later one an
SSE event with an `error` key (the official client raises APIError on it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine, Job
from .media import MediaPolicy, decode_media, read_media
from .protocol import Defaults, RequestError, chunk, completion, completion_id, parse_request, sse

PAGE = Path(__file__).with_name("static") / "index.html"
POLL_S = 0.25  # how often a request waiting for its first token checks that its client is still there


class _ClientGone(Exception):
    """The client disconnected before its answer started."""


def create_app(engine: Engine, *, model_name: str, api_key: str | None = None, max_body: int = 100 * 2**20,
               policy: MediaPolicy | None = None, defaults: Defaults | None = None) -> Starlette:
    """The ASGI app over a running engine. `max_body`: the request size limit in bytes (413 past it)."""
    policy = policy or MediaPolicy()
    defaults = defaults or Defaults(model=model_name)
    model = engine.vlm.model
    vision = model.cfg.vision if model.vision is not None else None
    metrics, started = engine.metrics, int(time.time())

    def authorise(request: HTTPRequest) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError("missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                               status=401, code="invalid_api_key")

    async def chat_completions(request: HTTPRequest) -> Response:
        received = time.perf_counter()
        authorise(request)
        body = await _read_body(request, max_body)
        req = await run_in_threadpool(_parse, body, defaults, policy, vision, engine)  # a large body takes a while
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(kind: str, payload) -> None:  # from the worker thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
            except RuntimeError:  # the event loop has closed: the server is shutting down
                pass

        job = Job(req, emit, received=received)
        engine.submit(job)
        try:
            kind, payload = await _next(events, request, job)
            if kind == "error":
                raise payload
            cid, created = completion_id(), int(time.time())
            if req.stream:
                metrics.inc("requests_total", code="200")
                return StreamingResponse(_stream(job, events, req, cid, created), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            text = []
            while (event := await _next(events, request, job))[0] == "text":
                text.append(event[1])
            if event[0] == "error":
                raise event[1]
            done = event[1]
            metrics.inc("requests_total", code="200")
            return JSONResponse(completion(cid, req.model, "".join(text), done["finish"], done["usage"],
                                           {"stats": done["stats"]}))
        except _ClientGone:
            metrics.inc("requests_total", code="499")
            return Response(status_code=499)
        except BaseException:
            job.cancelled.set()  # whatever ended this handler, the worker need not go on
            raise

    async def models(request: HTTPRequest) -> Response:
        authorise(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": started, "owned_by": "tinyvila",
             "max_model_len": engine.max_seq_len or model.cfg.text.max_seq_len}]})

    async def health(request: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok", "model": model_name, "queue_depth": engine.queue.qsize()})

    async def metrics_page(request: HTTPRequest) -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def page(request: HTTPRequest) -> Response:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    async def request_error(request: HTTPRequest, e: RequestError) -> Response:
        if request.url.path.endswith("/chat/completions"):
            metrics.inc("requests_total", code=str(e.status))
        return JSONResponse(e.body(), status_code=e.status)

    async def http_error(request: HTTPRequest, e: HTTPException) -> Response:
        return JSONResponse(RequestError(f"{request.method} {request.url.path}: {e.detail}", status=e.status_code,
                                         code="unknown_url" if e.status_code == 404 else None).body(),
                            status_code=e.status_code)

    async def internal_error(request: HTTPRequest, e: Exception) -> Response:
        return JSONResponse(RequestError(f"internal error: {type(e).__name__}: {e}", status=500, type="server_error",
                                         code="internal_error").body(), status_code=500)

    completions = ["POST"]
    routes = [Route("/v1/chat/completions", chat_completions, methods=completions),
              Route("/chat/completions", chat_completions, methods=completions),
              Route("/v1/models", models), Route("/models", models), Route("/health", health),
              Route("/metrics", metrics_page), Route("/", page)]
    return Starlette(routes=routes, exception_handlers={RequestError: request_error, HTTPException: http_error,
                                                        Exception: internal_error})


async def _read_body(request: HTTPRequest, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to be over `limit` bytes (from Content-Length, else while read)."""
    too_large = RequestError(f"the request body is over the server's limit of {limit} bytes (--max-body-mb)",
                             status=413, code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        chunks.append(part)
    return b"".join(chunks)


def _parse(body: bytes, defaults: Defaults, policy: MediaPolicy, vision, engine: Engine):
    """The request, checked, the media it will prefill decoded (in a worker thread of the event loop's pool): the last
    turn's, and the history's unless the engine holds a chat for it (a stateless client's follow-up)."""
    req = parse_request(_json(body), defaults)
    read_media(req.turns, policy, vision)
    decode_media(req.turns[-1:] if engine.holds(req) else req.turns)
    return req


def _json(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({e})", code="invalid_json") from None


async def _next(events: asyncio.Queue, request: HTTPRequest, job: Job) -> tuple[str, object]:
    """The job's next event; _ClientGone (and the job cancelled) if its client disconnects while waiting."""
    if not events.empty():  # no wait_for (a task per call) for an event already here: a burst of pieces
        return events.get_nowait()
    while True:
        try:
            return await asyncio.wait_for(events.get(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                raise _ClientGone from None


async def _stream(job: Job, events: asyncio.Queue, req, cid: str, created: int):
    """The SSE body after the first token: a role chunk, content chunks, the finish chunk, the usage chunk (with
    stream_options.include_usage), then [DONE]. A disconnect cancels it (Starlette); the worker then stops.
    Each wake-up writes the events queued by then in one send (the role chunk goes with the first piece): the worker
    emits pieces in bursts, one per host sync, and a send per piece would cost the event loop, and so the worker
    it shares the GIL with, a pass each. Events that come while a write is made go in the next one."""
    usage, end = req.include_usage, False
    out = [chunk(cid, req.model, created, {"role": "assistant", "content": ""}, include_usage=usage)]
    try:
        while not end:
            batch = [await events.get()]
            batch += [events.get_nowait() for _ in range(events.qsize())]
            for kind, payload in batch:
                if kind == "text":
                    out.append(chunk(cid, req.model, created, {"content": payload}, include_usage=usage))
                elif kind == "done":
                    out.append(chunk(cid, req.model, created, {}, payload["finish"], include_usage=usage,
                                     extra={"stats": payload["stats"]}))
                    if usage:
                        out.append(chunk(cid, req.model, created, None, usage=payload["usage"], include_usage=True))
                    end = True
                elif kind == "error":
                    out.append(sse(payload.body()))
                    end = True
                if end:
                    out.append(sse("[DONE]"))
                    break
            yield "".join(out)
            out.clear()
    finally:
        job.cancelled.set()  # a no-op once the job is done; else the client left and the worker stops


class BackgroundServer:
    """`app` served by uvicorn in a daemon thread named `name` on `host` (port 0: a free one), started and waited for:
    for embedding the server in a process that has other work, and for tests and benches. `url` is its base URL;
    `close()` stops it (the engine behind the app is the caller's to close)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, name: str = "tinyvila-http",
                 timeout_s: float = 60.0):
        import uvicorn

        # IPPROTO_TCP as uvicorn binds its own sockets: asyncio sets TCP_NODELAY only on such sockets, and without it
        # Nagle holds each SSE chunk back for the client's delayed ACK (~40 ms).
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind((host, port))
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.close()
                raise RuntimeError(f"the HTTP server did not start within {timeout_s:g} s")
            time.sleep(0.01)

    def close(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
