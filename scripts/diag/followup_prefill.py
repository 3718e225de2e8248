"""Where a follow-up question's eager prefill spends its time (issues 6, 7): vila-8b shapes, synthetic weights,
the quant and sparse pipelines of scripts/bench.py's image chat.

A first turn replays a CUDA graph; a later turn's prefill runs eagerly (its attention reads a cache prefix whose
length the host knows only per turn). For each pipeline this runs the 3-turn chat twice to warm up, then turn 3's
ask (1 new token) three ways: timed, under torch.profiler (self CPU and device time per op), and under cProfile
(the Python calls behind the host time).

    PYTHONPATH=. python scripts/diag/followup_prefill.py [--pipelines quant,sparse] [--top 30]
    (one GPU, ~1 min; on CPU with --preset tiny-siglip-llama --group-size 32 it runs the reference path)
    ... --frames 256   (the video conversation of scripts/bench.py at the paper's keeps, 0.25 / 0.1, instead)
    ... --split        (instead of the profiles: turn 3 twice with each of begin_scoring, the prefill and pack
                        followed by a device sync, printing each one's host time and the wait after it)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench as B  # noqa: E402
import tinyvila  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def to_turn_3(chat, turns) -> None:
    """A fresh conversation up to (not including) turn 3's question."""
    chat.clear()
    chat.add_image(turns[0].images)
    for t in turns[:2]:
        for _ in chat.ask(t.question, tinyvila.SamplingParams(max_new_tokens=8)):
            pass
    sync()


def ask_turn_3(chat, turns) -> None:
    for _ in chat.ask(turns[2].question, tinyvila.SamplingParams(max_new_tokens=1)):
        pass
    sync()


def split_turn_3(chat, turns, name: str) -> None:
    """Turn 3 twice, each step of the question's prefill (KVCache.begin_scoring, Decoder.prefill, KVCache.pack)
    timed on the host and then synchronised: host ms and the device wait after it, per step. A wait near zero
    means the step's host work, not the GPU, set its pace."""
    from tinyvila.generate import Decoder
    from tinyvila.kv_cache import KVCache

    log = []

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            t1 = time.perf_counter()
            sync()
            log.append((fn.__name__, 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t1)))
            return out
        return wrapper

    steps = [(KVCache, "begin_scoring"), (Decoder, "prefill"), (KVCache, "pack")]
    for _ in range(2):
        to_turn_3(chat, turns)
        log.clear()
        originals = [getattr(cls, attr) for cls, attr in steps]
        for (cls, attr), fn in zip(steps, originals):
            setattr(cls, attr, timed(fn))
        try:
            t0 = time.perf_counter()
            ask_turn_3(chat, turns)
            wall = 1e3 * (time.perf_counter() - t0)
        finally:
            for (cls, attr), fn in zip(steps, originals):
                setattr(cls, attr, fn)
        print(f"[{name}] turn-3 ask, steps synchronised: wall {wall:.2f} ms; "
              + "; ".join(f"{n} host {h:.2f} ms, wait {w:.2f}" for n, h, w in log), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="vila-8b")
    p.add_argument("--group-size", default="128")
    p.add_argument("--pipelines", default="quant,sparse")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--frames", type=int, default=0, help="a video of this many frames instead of one image")
    p.add_argument("--split", action="store_true", help="host time and device wait per prefill step, no profiles")
    a = p.parse_args(argv)
    media = ["--frames", str(a.frames), "--prefill-keep", "0.25", "--decode-keep", "0.1"] if a.frames else \
        ["--images", "1", "--prefill-keep", "0.5", "--decode-keep", "0.25"]
    args = B.parse_args([*media, "--rounds", "3", "--new-tokens", "8", "--preset", a.preset,
                         "--group-size", a.group_size])
    base = B.preset(args.preset)
    tok, tmpl = B.tokenizer_and_template(args, base)
    turns = B.conversation(args, base, tok, tmpl)
    max_seq_len = max(4096, B.context_needed(base, turns, args.new_tokens, tok, tmpl))
    cuda = torch.cuda.is_available()
    for name in a.pipelines.split(","):
        pipe = B.build(name, args, base, turns, max_seq_len, tok, tmpl)
        pipe.run(turns, 8)
        pipe.run(turns, 8)
        chat = pipe.chat
        if a.split:
            split_turn_3(chat, turns, name)
            del pipe, chat
            continue
        to_turn_3(chat, turns)
        t0 = time.perf_counter()
        ask_turn_3(chat, turns)
        print(f"[{name}] turn-3 ask (1 token): wall {1e3 * (time.perf_counter() - t0):.2f} ms, prefill "
              f"{chat.stats.prefill_ms:.2f} ms for {chat.stats.prefill_tokens} tokens", flush=True)
        to_turn_3(chat, turns)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            ask_turn_3(chat, turns)
        ka = prof.key_averages()
        print(f"[{name}] torch.profiler, by self CPU time")
        print(ka.table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60))
        if cuda:
            print(f"[{name}] torch.profiler, by device time")
            print(ka.table(sort_by="self_cuda_time_total", row_limit=a.top, max_name_column_width=60))
        to_turn_3(chat, turns)
        pr = cProfile.Profile()
        pr.enable()
        ask_turn_3(chat, turns)
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(a.top)
        print(f"[{name}] cProfile, by own time\n{out.getvalue()}")
        del pipe, chat
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
