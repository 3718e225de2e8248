"""Decode step time of the first chat of a process against later chats of the same process.

The end-to-end bench (scripts/bench.py) measures the first chat a process opens. After the structure refactor that
chat's CUDA-graph decode step ran ~4% slower than before it while later chats of the same process ran as fast as
ever, and only with programmatic dependent launch on (docs/benchmarks.md, "Structure refactor"). This script
measures exactly that: it opens `--chats` chats one after another on one model, fills each one's cache with a
`--context`-token prompt, and times `Decoder.greedy` batches of `--batch` graph-replayed steps (one host sync per
batch, so the host's work between batches is out of the number).

    python -m scripts.first_chat_decode --chats 3
    python -m scripts.first_chat_decode --chats 3 --options pdl=0

Synthetic vila-8b W4A16 weights (speed does not depend on the values). Prints one line per chat, then one JSON
line (GPU, versions, commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import torch

import tinyvila
from scripts.benches import common
from tinyvila.api import from_config
from tinyvila.config import QuantConfig, preset
from tinyvila.options import Options


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="vila-8b")
    p.add_argument("--chats", type=int, default=3, help="chats opened one after another on the same model")
    p.add_argument("--context", type=int, default=900, help="prompt tokens before decoding (about)")
    p.add_argument("--batch", type=int, default=64, help="greedy steps per host synchronisation")
    p.add_argument("--repeats", type=int, default=5, help="timed groups of 4 batches per chat (median taken)")
    p.add_argument("--options", default="", metavar="NAME=VALUE,...", help="runtime options (tinyvila.Options)")
    p.add_argument("--pad-mb", default="", metavar="MB,...",
                   help="before chat i, allocate (and keep) the i-th of these many MB: moves the chat's buffers")
    p.add_argument("--keep", action="store_true", help="keep every chat alive (later chats get fresh addresses)")
    p.add_argument("--prime", choices=["graph", "eager", "prefill", "short"], default=None,
                   help="first run a throwaway chat, unmeasured: 8 graph-replayed decode steps after a 3-word prompt "
                        "(graph), the same eagerly (eager), the prompt's prefill only (prefill), or graph with a "
                        "256-token cache (short)")
    p.add_argument("--step-warmups", type=int, default=1, help="eager warm-ups before each decode-step capture")
    p.add_argument("--throwaway", choices=["capture", "replay"], default=None,
                   help="the first decode-step capture of the process is done twice, the first graph dropped "
                        "(replay: after replaying it once)")
    p.add_argument("--dump", default="", metavar="DIR", help="write each chat's decode-step graph as DOT here")
    return p.parse_args(argv)


def step_ms(chat, batch: int, repeats: int) -> list[float]:
    """ms per decode step, `repeats` times: 4 batches of `batch` greedy steps from the same cache length each."""
    dec = chat.decoder
    start = dec.length

    def timed(k: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            dec.greedy(5, batch)
            dec.truncate(start)
        torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - t0) / (batch * k)

    timed(3)  # captures the step graph
    return sorted(timed(4) for _ in range(repeats))


def throwaway(mode: str) -> None:
    """Patch Decoder._capture: its first call in the process captures a decode-step graph it drops (after one
    replay, with the step state put back, for mode "replay") before the graph it keeps."""
    from tinyvila import generate

    orig, done = generate.Decoder._capture, []

    def first_twice(self, vocab_size):
        if not done:
            done.append(True)
            graph, _ = orig(self, vocab_size)
            if mode == "replay":
                live = (*self.cache.step_index().tensors(), self._token, self._count)
                saved = [t.clone() for t in live]
                graph.replay()
                for t, v in zip(live, saved):
                    t.copy_(v)
            del graph
        return orig(self, vocab_size)

    generate.Decoder._capture = first_twice


def main(argv=None) -> int:
    args = parse_args(argv)
    opts = Options.parse(args.options, Options.from_env())
    base = preset(args.preset)
    cfg = dataclasses.replace(base, quant=QuantConfig(llm="w4a16", vision="w8a8" if base.vision else "none",
                                                      group_size=128))
    vlm = from_config(cfg, device="cuda", options=opts)
    vlm.stop_ids = frozenset()
    rows, kept = [], []
    pads = [int(x) for x in args.pad_mb.split(",")] if args.pad_mb else []
    if args.step_warmups != 1:
        from tinyvila import cuda_graph, generate
        generate.capture = functools.partial(cuda_graph.capture, warmups=args.step_warmups)
    if args.throwaway:
        throwaway(args.throwaway)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)

        class DebugGraph(torch.cuda.CUDAGraph):
            def __new__(cls, keep_graph: bool = True):
                graph = super().__new__(cls, keep_graph=True)
                graph.enable_debug_mode()
                return graph

        torch.cuda.CUDAGraph = DebugGraph
    if args.prime:
        warm = vlm.chat(max_seq_len=256 if args.prime == "short" else args.context + 1024)
        warm.decoder.cuda_graph = args.prime != "eager"
        n = 1 if args.prime == "prefill" else 8
        for _ in warm.ask("word " * 3, tinyvila.SamplingParams(max_new_tokens=n)):
            pass
        del warm
        torch.cuda.empty_cache()
    for i in range(args.chats):
        if i < len(pads) and pads[i]:
            kept.append(torch.empty(pads[i] << 20, dtype=torch.uint8, device="cuda"))
        chat = vlm.chat(max_seq_len=args.context + 1024)
        for _ in chat.ask("word " * (args.context // 5), tinyvila.SamplingParams(max_new_tokens=1)):
            pass
        times = step_ms(chat, args.batch, args.repeats)
        kv = chat.decoder.cache.k_stack.data_ptr()
        rows.append({"chat": i + 1, "step_ms": times[len(times) // 2], "runs_ms": times, "kv_ptr": hex(kv)})
        print(f"chat {i + 1}: {times[len(times) // 2]:.4f} ms a step ({1000 / times[len(times) // 2]:.1f} tok/s); "
              f"runs {', '.join(f'{t:.4f}' for t in times)}; kv at {kv:#x}", flush=True)
        if args.dump:
            for key, entry in chat.decoder.graphs.entries.items():
                if key[0] == "step":
                    entry[0].debug_dump(os.path.join(args.dump, f"chat{i + 1}_step.dot"))
        if args.keep:
            kept.append(chat)
        del chat
        torch.cuda.empty_cache()
    print(json.dumps({"bench": "first_chat_decode", **vars(args), "options": dataclasses.asdict(opts), "rows": rows,
                      **common.environment()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
