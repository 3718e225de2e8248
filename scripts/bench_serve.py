"""HTTP serving overhead: the OpenAI-compatible server (tinyvila.serve) against the same conversation in-process.

    python -m scripts.bench_serve                     # vila-8b W4A16 + W8A8, synthetic weights, cuda, 128 tokens a turn
    python -m scripts.bench_serve --device cpu --preset tiny-siglip-llama --group-size 32 --new-tokens 8
    python -m scripts.bench_serve --device cpu --preset tiny-siglip-llama --group-size 32 --image-size 384  # H200's payload
    python -m scripts.bench_serve ... --floor         # and the payload's floor: the same requests, no model

One model (bench.py's "quant" pipeline) is built once and served by the real app under uvicorn on a free 127.0.0.1
port in a thread, so both sides share weights and compiled kernels. bench.py's 4-turn conversation (a random PNG as a
data: URL in the first user message; greedy, stop tokens off, exactly --new-tokens a turn) runs three ways, each warmed
twice, then interleaved per repeat: in-process on one Chat reused with clear(), in-process on a new Chat per
conversation (what the server opens for each), and over HTTP (httpx streaming SSE, from a process of its own), each
request resending the whole history (the prefix-reuse LRU must serve turns 2-4). TTFT: send (in-process: add_image of the PNG bytes) to
the first non-empty text; tok/s: (tokens - 1) / (end of stream - first token) over the 4 turns; medians of --repeats.
HTTP rows also give the server's own TTFT (request received -> first token: body, parsing, media, queue, prefill), so the
rest of the HTTP TTFT is the client, the connection and the SSE write.
--floor adds two paths: the same client sends the same bodies to a Starlette app with no model on the same uvicorn
setup (`floor_app`), which reads the body, json.loads it, base64-decodes every data URL as the server does, and
answers one SSE chunk and [DONE]; "floor + PNG" also decodes the last message's images as add_image does.
HTTP - in-process (each path's own chat TTFT taken out) less the floor is what the server adds over moving and parsing
the payload at all (both sides of that difference decode the PNG, so the payload-only floor is the one to subtract).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gc
import io
import json
import multiprocessing
import statistics
import sys
import time

import torch

import tinyvila
from scripts import bench
from scripts.benches import common
from tinyvila import benchmark as bm
from tinyvila.api import from_config
from tinyvila.config import preset

ROUNDS = 4
PATHS = {"warm": "in-process, one Chat", "new": "in-process, new Chat", "http": "HTTP, stateless"}
FLOORS = {"floor": "floor: payload only", "floor_image": "floor + PNG decode"}
CLIENT_TIMEOUT_S = 600
TARGETS = {"ttft_ms": 2.0, "tok_s": 0.97, "total_ms": 1.10}  # HTTP over the warm Chat: +ms, ratio >=, ratio <=


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="vila-8b")
    p.add_argument("--new-tokens", type=int, default=128, help="answer tokens a turn (at least 2)")
    p.add_argument("--repeats", type=int, default=5, help="measured conversations per path (medians)")
    p.add_argument("--group-size", type=int, default=128, help="W4 group size (tiny presets: 32)")
    p.add_argument("--image-size", type=int, default=None,
                   help="side of the random PNG sent (default: the encoder's; both paths resize it alike)")
    p.add_argument("--floor", action="store_true",
                   help="also time the same requests against a server with no model (the payload's floor)")
    args = p.parse_args(argv)
    if args.new_tokens < 2 or args.repeats < 1 or (args.image_size or 1) < 1:
        p.error("--new-tokens must be at least 2, --repeats and --image-size at least 1")
    return args


class Server:
    """The app over an Engine of `vlm`, served in a thread on a free 127.0.0.1 port."""

    def __init__(self, vlm, max_seq_len: int, max_tokens: int):
        from tinyvila.serve.app import BackgroundServer, create_app
        from tinyvila.serve.engine import Engine
        from tinyvila.serve.protocol import Defaults

        # One cached conversation: after the warm-up the LRU is full, so every new conversation reuses a chat (its
        # KV cache and captured graphs) as a busy server's does once `--cache-size` conversations have run.
        self.engine = Engine(vlm, max_seq_len=max_seq_len, cache_size=1)
        app = create_app(self.engine, model_name="bench", defaults=Defaults(model="bench", max_tokens=max_tokens))
        try:
            self.http = BackgroundServer(app, name="bench-serve-http")
        except RuntimeError:
            self.engine.close()
            raise
        self.url = self.http.url + "/v1/chat/completions"

    def close(self) -> None:
        self.http.close()
        self.engine.close()


def floor_app(vision, answers: list[str]):
    """The payload's floor at the server's path: the body read, json.loads, every data URL base64-decoded by the
    server's own function, one SSE event (role, content, finish, usage) and [DONE]; no model, no checks, no queue.
    At /image/... the last user message's images are also decoded and resized as add_image does. Turn k is answered
    `answers[k]` (the model's answer, set once known), so the follow-up bodies equal the real server's byte for byte."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from tinyvila.image import resize_uint8
    from tinyvila.serve.media import _data_url
    from tinyvila.serve.protocol import chunk, sse

    async def answer(request, pixels: bool):
        received = time.perf_counter()
        data = json.loads(await request.body())
        users = [m["content"] for m in data["messages"] if m["role"] == "user"]
        for i, content in enumerate(users):
            for part in content:
                if part["type"] == "image_url":
                    _, raw = _data_url(part["image_url"]["url"], "image_url")
                    if pixels and i == len(users) - 1:  # a history's image is decoded by neither path
                        resize_uint8(raw, vision)
        stats = {"ttft_ms": 0.0, "server_ttft_ms": 1000 * (time.perf_counter() - received)}
        event = chunk("floor", data["model"], 0, {"role": "assistant", "content": answers[len(users) - 1]}, "length",
                      usage={"completion_tokens": 1}, include_usage=True, extra={"stats": stats})

        async def body():  # one write, chunked as the server's stream is
            yield event + sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # the server's

    async def payload(request):
        return await answer(request, False)

    async def image(request):
        return await answer(request, True)

    return Starlette(routes=[Route("/v1/chat/completions", payload, methods=["POST"]),
                             Route("/image/v1/chat/completions", image, methods=["POST"])])


# -- one turn, either way -----------------------------------------------------------------------------
def _turn(t0: float, first_token: float, first_text: float | None, end: float, tokens: int, text: str,
          inner_ttft_ms: float, server: dict | None = None) -> dict:
    first_text = first_text or end  # an answer of special tokens only has no text: its TTFT is its end
    return {"ttft_ms": 1000 * (first_text - t0), "first_token_ms": 1000 * (first_token - t0),
            "e2e_ms": 1000 * (end - t0), "decode_s": end - first_token, "tokens": tokens, "text": text,
            "inner_ttft_ms": inner_ttft_ms, "server": server}


def local_turn(chat, question: str, sampling, png: bytes | None, t0: float) -> dict:
    """One in-process turn from t0: the image (if any) added as its file's bytes, then the streamed answer."""
    if png is not None:
        chat.add_image(png)
    first_token = first_text = None
    text = []
    for piece in chat.ask(question, sampling):
        now = time.perf_counter()
        first_token = first_token or now
        if piece:
            text.append(piece)
            first_text = first_text or now
    end = time.perf_counter()
    return _turn(t0, first_token, first_text, end, chat.stats.decode_tokens, "".join(text), chat.stats.ttft_ms)


def http_turn(client, url: str, body: bytes) -> dict:
    """One streamed request: times at the arrival of the role chunk (the first token), the first non-empty content
    chunk and the finish chunk (whose `stats` are the server's own)."""
    t0 = time.perf_counter()
    first_token = first_text = end = None
    text, stats, usage = [], None, None
    with client.stream("POST", url, content=body, headers={"Content-Type": "application/json"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():  # read to the end of the body, so the connection goes back to the pool
            now = time.perf_counter()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the server answered an error: {event['error']}")
            usage = event.get("usage") or usage
            if not event["choices"]:
                continue
            choice = event["choices"][0]
            first_token = first_token or now
            if content := choice["delta"].get("content"):
                text.append(content)
                first_text = first_text or now
            if choice["finish_reason"]:
                end, stats = now, event["stats"]
    if end is None or usage is None:
        raise RuntimeError("the stream ended without its finish and usage chunks")
    return _turn(t0, first_token, first_text, end, usage["completion_tokens"], "".join(text), stats["ttft_ms"], stats)


# -- one conversation, each way -----------------------------------------------------------------------
def local_conversation(vlm, chat, png: bytes, sampling, max_seq_len: int) -> tuple[list[dict], int]:
    """The conversation on `chat` (cleared first), or with chat None on a new Chat opened inside turn 1's time.
    -> (turns, CUDA graphs the chat captured during it)."""
    if chat is not None:
        chat.clear()
    before = chat.decoder.graphs.captures if chat is not None else 0
    turns = []
    for i, question in enumerate(bench.QUESTIONS[:ROUNDS]):
        t0 = time.perf_counter()
        if chat is None:
            chat = vlm.chat(max_seq_len=max_seq_len)
        turns.append(local_turn(chat, question, sampling, png if i == 0 else None, t0))
    return turns, chat.decoder.graphs.captures - before


def http_conversation(client, url: str, image_url: str, new_tokens: int) -> list[dict]:
    """The conversation as an OpenAI client sends it: every request carries the whole history, image included."""
    messages, turns = [], []
    for i, question in enumerate(bench.QUESTIONS[:ROUNDS]):
        content = [{"type": "image_url", "image_url": {"url": image_url}}] if i == 0 else []
        messages.append({"role": "user", "content": [*content, {"type": "text", "text": question}]})
        body = json.dumps({"model": "bench", "messages": messages, "max_tokens": new_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        turns.append(http_turn(client, url, body))
        messages.append({"role": "assistant", "content": turns[-1]["text"]})
    return turns


def _client_loop(conn) -> None:
    """The client process: (image_url, new_tokens) first, then one conversation per URL received (until a falsy one)."""
    import httpx

    config = conn.recv()
    if not config:  # closed before it was given a server
        return
    image_url, new_tokens = config
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        while url := conn.recv():
            try:
                conn.send(http_conversation(client, url, image_url, new_tokens))
            except Exception as e:  # sent back whole, raised in the bench
                conn.send(RuntimeError(f"HTTP client: {type(e).__name__}: {e}"))


class ClientProcess:
    """The HTTP client in a process of its own, as a real client is: its SSE parsing then takes no GIL time from
    the server's event loop and engine threads, which share this process. Spawned (not forked: this process has
    threads and maybe CUDA); its imports overlap the model build."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_client_loop, args=(child,), name="bench-serve-client", daemon=True)
        self.process.start()
        child.close()  # the child's end lives in the child only: its exit is then an EOFError here, not a hang

    def configure(self, image_url: str, new_tokens: int) -> None:
        self.conn.send((image_url, new_tokens))

    def conversation(self, url: str) -> list[dict]:
        self.conn.send(url)
        if not self.conn.poll(CLIENT_TIMEOUT_S):
            raise RuntimeError(f"the HTTP client gave no answer in {CLIENT_TIMEOUT_S} s")
        turns = self.conn.recv()
        if isinstance(turns, BaseException):
            raise turns
        return turns

    def close(self) -> None:
        try:
            self.conn.send(False)
        except OSError:  # it has exited already
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def run_summary(turns: list[dict]) -> dict:
    steps, seconds = sum(t["tokens"] - 1 for t in turns), sum(t["decode_s"] for t in turns)
    out = {"ttft_ms": turns[0]["ttft_ms"], "first_token_ms": turns[0]["first_token_ms"],
           "inner_ttft_ms": turns[0]["inner_ttft_ms"],
           "followup_ttft_ms": statistics.median(t["ttft_ms"] for t in turns[1:]),
           "followup_inner_ttft_ms": statistics.median(t["inner_ttft_ms"] for t in turns[1:]),
           "tok_s": steps / seconds if seconds > 0 else None, "total_ms": sum(t["e2e_ms"] for t in turns)}
    if turns[0]["server"]:  # HTTP: the server's own share of the TTFT
        out["server_ttft_ms"] = turns[0]["server"]["server_ttft_ms"]
        out["server_followup_ttft_ms"] = statistics.median(t["server"]["server_ttft_ms"] for t in turns[1:])
    return out


def row(path: str, runs: list[list[dict]], captures: list, first_use: int) -> dict:
    """A path's medians over its measured conversations, with every run's summary."""
    summaries = [run_summary(turns) for turns in runs]
    out = {"path": path, **{k: statistics.median(s[k] for s in summaries if s[k] is not None) for k in summaries[0]},
           "tokens": [t["tokens"] for turns in runs for t in turns], "graph_captures": captures,
           "first_use": first_use, "runs": summaries}
    if path == "http":
        out["prefix_reused"] = sum(bool(t["server"]["prefix_reused"]) for turns in runs for t in turns[1:])
        out["prefill_tokens"] = [t["server"]["prefill_tokens"] for t in runs[-1]]
    return out


def floor_row(path: str, runs: list[list[dict]]) -> dict:
    """A floor path's medians: its TTFTs at the client and in the app (no decode, so no tok/s)."""
    keys = ("ttft_ms", "followup_ttft_ms", "server_ttft_ms", "server_followup_ttft_ms")
    summaries = [{k: run_summary(turns)[k] for k in keys} for turns in runs]
    return {"path": path, **{k: statistics.median(s[k] for s in summaries) for k in keys}, "runs": summaries}


# -- measuring and reporting --------------------------------------------------------------------------
@contextlib.contextmanager
def _count_decoder_captures():
    """Count every decoder CUDA-graph capture inside the block, in any thread (the server's worker too): yields a
    one-item list holding the count."""
    from tinyvila import generate

    count, real = [0], generate.capture

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    generate.capture = counted
    try:
        yield count
    finally:
        generate.capture = real


def measure(args, vlm, server: Server, client: ClientProcess, png: bytes, max_seq_len: int,
            floor=None) -> tuple[dict, dict, dict]:
    """Warm each path twice (a later turn's graph is captured at its key's second turn), then run them in turn
    --repeats times. `floor`: (its base URL, the list it answers from), or None. -> (rows by path, floor rows by path,
    answers by path)."""
    sampling = tinyvila.SamplingParams(max_new_tokens=args.new_tokens)
    warm_chat = vlm.chat(max_seq_len=max_seq_len)
    paths = {"warm": lambda: local_conversation(vlm, warm_chat, png, sampling, max_seq_len),
             "new": lambda: local_conversation(vlm, None, png, sampling, max_seq_len),
             "http": lambda: (client.conversation(server.url), None)}
    if floor is not None:
        paths["floor"] = lambda: (client.conversation(floor[0] + "/v1/chat/completions"), None)
        paths["floor_image"] = lambda: (client.conversation(floor[0] + "/image/v1/chat/completions"), None)
    for _ in range(2):
        for p, run in paths.items():
            turns, _ = run()
            if p == "warm" and floor is not None:  # the floor answers what the model does: the same follow-up bodies
                floor[1][:] = [t["text"] for t in turns]
    runs, captures, first_use = {p: [] for p in paths}, {p: [] for p in paths}, dict.fromkeys(paths, 0)
    with _count_decoder_captures() as captured:
        for _ in range(args.repeats):  # interleaved: a drift of the clocks touches every path alike
            for p, run in paths.items():
                gc.collect()  # the previous run's chats go outside the timed span
                counter, before = bm.FirstUse().start(), captured[0]
                turns, _ = run()
                first_use[p] += counter.stop()
                runs[p].append(turns)
                captures[p].append(captured[0] - before)
    rows = {p: row(p, runs[p], captures[p], first_use[p]) for p in paths if p not in FLOORS}
    floors = {p: floor_row(p, runs[p]) for p in paths if p in FLOORS}
    return rows, floors, {p: [[t["text"] for t in turns] for turns in runs[p]] for p in rows}


def targets(rows: dict) -> list[dict]:
    """Issue targets: HTTP against the warm in-process Chat (the one bench.py measures)."""
    local, http = rows["warm"], rows["http"]
    checks = [("TTFT overhead, ms", http["ttft_ms"] - local["ttft_ms"], f"<= {TARGETS['ttft_ms']}",
               lambda v: v <= TARGETS["ttft_ms"]),
              ("decode tok/s, HTTP over in-process", http["tok_s"] / local["tok_s"], f">= {TARGETS['tok_s']}",
               lambda v: v >= TARGETS["tok_s"]),
              (f"{ROUNDS}-turn end to end, HTTP over in-process", http["total_ms"] / local["total_ms"],
               f"<= {TARGETS['total_ms']}", lambda v: v <= TARGETS["total_ms"])]
    return [{"what": w, "value": round(v, 4), "target": t, "met": bool(ok(v))} for w, v, t, ok in checks]


def floor_split(rows: dict, floors: dict) -> list[dict]:
    """Turn 1 and the follow-ups: HTTP - in-process (the warm Chat) against the payload's floor. "outside the chats":
    the same difference with each path's own chat TTFT taken out, which leaves the time spent outside the model (a
    chat that runs faster in the server's thread than in the bench's would otherwise hide some of the server's)."""
    out = []
    for what, key, inner in (("turn 1 (image + question)", "ttft_ms", "inner_ttft_ms"),
                             ("follow-ups (history resent)", "followup_ttft_ms", "followup_inner_ttft_ms")):
        local, http, floor = rows["warm"], rows["http"], floors["floor"][key]
        outside = (http[key] - http[inner]) - (local[key] - local[inner])
        out.append({"request": what, "in-process ms": local[key], "HTTP ms": http[key],
                    "HTTP - in-process ms": http[key] - local[key], "outside the chats ms": outside, "floor ms": floor,
                    "floor + PNG ms": floors["floor_image"][key], "over the floor ms": outside - floor})
    return out


def report_floor(rows: dict, floors: dict) -> list[dict]:
    split = floor_split(rows, floors)
    print(f"\npayload floor: the same requests to a server with no model ({', '.join(FLOORS.values())})")
    common.print_table(split)
    http, floor, image = rows["http"], floors["floor"], floors["floor_image"]
    print(f"server side, received -> first token / answer: HTTP {http['server_ttft_ms']:.2f} ms, floor "
          f"{floor['server_ttft_ms']:.2f} ms, floor + PNG {image['server_ttft_ms']:.2f} ms; HTTP outside the chat's "
          f"own TTFT {http['ttft_ms'] - http['inner_ttft_ms']:.2f} ms, against the floor + PNG's "
          f"{image['ttft_ms']:.2f} ms")
    print("outside the chats: HTTP - in-process less the difference of the chats' own TTFTs; over the floor: that less "
          "the floor, the time the server adds beyond moving and parsing the payload\n(the PNG decode is on both sides "
          "of HTTP - in-process, so the payload-only floor is the one to subtract; floor + PNG compares with HTTP "
          "outside its chat's own TTFT)")
    return split


def report(args, rows: dict, checks: list[dict], same: bool, info: dict, floors: dict | None = None) -> None:
    print(f"{args.preset} W4A16 + W8A8 (synthetic weights), {args.device}: {ROUNDS} turns x {args.new_tokens} new "
          f"tokens, {info['image']}, KV cache {info['max_seq_len']}, {args.repeats} repeats, client {info['client']}")
    common.print_table([{"path": PATHS[p], "TTFT ms": r["ttft_ms"], "inner TTFT ms": r["inner_ttft_ms"],
                         "follow-up TTFT ms": r["followup_ttft_ms"], "tok/s": r["tok_s"],
                         "server TTFT ms": r.get("server_ttft_ms", "-"),
                         "server follow-up ms": r.get("server_followup_ttft_ms", "-"),
                         f"{ROUNDS}-turn ms": r["total_ms"], "graph captures": max(r["graph_captures"], key=lambda n: n or 0),
                         "first use": r["first_use"]} for p, r in rows.items()])
    print("TTFT: turn 1 (image + question), from the send to the first non-empty text; inner: the chat's own TTFT "
          "(encode + prefill + first token); follow-up: turns 2-4;\nserver: request received -> first token, in the "
          "server; graph captures: decoder CUDA graphs captured during a conversation, the most of the repeats")
    http = rows["http"]
    for p in ("warm", "new"):
        r = rows[p]
        print(f"HTTP over {PATHS[p]}: TTFT {http['ttft_ms'] - r['ttft_ms']:+.2f} ms | tok/s x{http['tok_s'] / r['tok_s']:.3f}"
              f" | {ROUNDS} turns x{http['total_ms'] / r['total_ms']:.3f}")
    for c in checks:
        print(f"target: {c['what']}: {c['value']:.3g} ({c['target']}: {'met' if c['met'] else 'MISSED'})")
    want = (ROUNDS - 1) * args.repeats
    print(f"prefix reuse: {http['prefix_reused']}/{want} follow-up requests served from the cached chat; answers "
          f"identical on every path: {'yes' if same else 'NO'}")
    if http["prefix_reused"] < want:
        print("WARNING: prefix reuse missed: those HTTP turns prefilled the resent history")
    for p, r in rows.items():
        if r["first_use"]:
            print(f"WARNING: {PATHS[p]}: {r['first_use']} Triton kernel loads/autotunings in the measured runs")
    extra = {"floor": list(floors.values()), "floor_split": report_floor(rows, floors)} if floors else {}
    print(json.dumps({"bench": "serve", "args": vars(args), **info, "same_answers": same, "rows": list(rows.values()),
                      "targets": checks, **extra, **bench.environment(args.device)}))


def random_image(size: int):
    """A deterministic random size x size RGB uint8 image (random pixels: a PNG of it barely compresses)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy()


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import httpx
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"error: this bench needs the serve and test extras ({e.name} is missing): pip install -e '.[serve,test]'",
              file=sys.stderr)
        return 1
    from PIL import Image

    client = ClientProcess()
    try:
        cfg = bench.pipeline_config(preset(args.preset), "quant", args)
        vlm = from_config(cfg, device=args.device)  # as bench.py builds it
        vlm.stop_ids = frozenset()  # exactly --new-tokens a turn, on both sides (the server's chats read the same set)
        image = bench.random_images(cfg, 1)[0] if args.image_size is None else random_image(args.image_size)
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG")
        png = buf.getvalue()
        turns = [bench.Turn([image] if i == 0 else [], q) for i, q in enumerate(bench.QUESTIONS[:ROUNDS])]
        max_seq_len = bench.context_needed(cfg, turns, args.new_tokens, vlm.tokenizer, vlm.template)
        server = Server(vlm, max_seq_len, args.new_tokens)
        with contextlib.ExitStack() as stack:
            stack.callback(server.close)
            floor = None
            if args.floor:
                from tinyvila.serve.app import BackgroundServer

                floor_answers = []
                floor_http = BackgroundServer(floor_app(vlm.model.cfg.vision, floor_answers), name="bench-serve-floor")
                stack.callback(floor_http.close)
                floor = (floor_http.url, floor_answers)
            client.configure("data:image/png;base64," + base64.b64encode(png).decode(), args.new_tokens)
            rows, floors, answers = measure(args, vlm, server, client, png, max_seq_len, floor)
    finally:
        client.close()
    same = all(a == answers["warm"][0] for runs in answers.values() for a in runs)
    info = {"image": f"1 image {image.shape[1]}x{image.shape[0]} PNG ({len(png) / 1024:.0f} KiB)",
            "max_seq_len": max_seq_len, "client": f"httpx {httpx.__version__}, streaming, in its own process",
            "gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    report(args, rows, targets(rows), same, info, floors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
