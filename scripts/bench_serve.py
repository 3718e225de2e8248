"""HTTP serving overhead: the OpenAI-compatible server (tinyvila.serve) against the same conversation in-process.

    python -m scripts.bench_serve                     # vila-8b W4A16 + W8A8, synthetic weights, cuda, 128 tokens a turn
    python -m scripts.bench_serve --device cpu --preset tiny-siglip-llama --group-size 32 --new-tokens 8
    python -m scripts.bench_serve --device cpu --preset tiny-siglip-llama --group-size 32 --image-size 384  # H200's payload

One model (bench.py's "quant" pipeline) is built once and served by the real app under uvicorn on a free 127.0.0.1
port in a thread, so both sides share weights and compiled kernels. bench.py's 4-turn conversation (a random PNG as a
data: URL in the first user message; greedy, stop tokens off, exactly --new-tokens a turn) runs three ways, each warmed
twice, then interleaved per repeat: in-process on one Chat reused with clear(), in-process on a new Chat per
conversation (what the server opens for each), and over HTTP (httpx streaming SSE, from a process of its own), each
request resending the whole history (the prefix-reuse LRU must serve turns 2-4). TTFT: send (in-process: add_image of the PNG bytes) to
the first non-empty text; tok/s: (tokens - 1) / (end of stream - first token) over the 4 turns; medians of --repeats.
HTTP rows also give the server's own TTFT (request received -> first token: body, parsing, media, queue, prefill), so the
rest of the HTTP TTFT is the client, the connection and the SSE write.
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
    """The client process: (url, image_url, new_tokens) first, then one conversation per True received."""
    import httpx

    config = conn.recv()
    if not config:  # closed before it was given a server
        return
    url, image_url, new_tokens = config
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        while conn.recv():
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

    def configure(self, url: str, image_url: str, new_tokens: int) -> None:
        self.conn.send((url, image_url, new_tokens))

    def conversation(self) -> list[dict]:
        self.conn.send(True)
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


def measure(args, vlm, server: Server, client: ClientProcess, png: bytes, max_seq_len: int) -> tuple[dict, dict]:
    """Warm each path twice (a later turn's graph is captured at its key's second turn), then run them in turn
    --repeats times. -> (rows by path, answers by path)."""
    sampling = tinyvila.SamplingParams(max_new_tokens=args.new_tokens)
    warm_chat = vlm.chat(max_seq_len=max_seq_len)
    paths = {"warm": lambda: local_conversation(vlm, warm_chat, png, sampling, max_seq_len),
             "new": lambda: local_conversation(vlm, None, png, sampling, max_seq_len),
             "http": lambda: (client.conversation(), None)}
    for run in [*paths.values()] * 2:
        run()
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
    rows = {p: row(p, runs[p], captures[p], first_use[p]) for p in paths}
    return rows, {p: [[t["text"] for t in turns] for turns in runs[p]] for p in paths}


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


def report(args, rows: dict, checks: list[dict], same: bool, info: dict) -> None:
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
    print(json.dumps({"bench": "serve", "args": vars(args), **info, "same_answers": same, "rows": list(rows.values()),
                      "targets": checks, **bench.environment(args.device)}))


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
        try:
            client.configure(server.url, "data:image/png;base64," + base64.b64encode(png).decode(), args.new_tokens)
            rows, answers = measure(args, vlm, server, client, png, max_seq_len)
        finally:
            server.close()
    finally:
        client.close()
    same = all(a == answers["warm"][0] for runs in answers.values() for a in runs)
    info = {"image": f"1 image {image.shape[1]}x{image.shape[0]} PNG ({len(png) / 1024:.0f} KiB)",
            "max_seq_len": max_seq_len, "client": f"httpx {httpx.__version__}, streaming, in its own process",
            "gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    report(args, rows, targets(rows), same, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
