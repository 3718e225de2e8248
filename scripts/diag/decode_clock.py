"""SM clock, power and throttle reasons while the CUDA-graph decode step runs for several seconds (issues 3, 7: is
sustained decode power-bound, so that energy per step rather than latency sets its pace?).

    PYTHONPATH=. python scripts/diag/decode_clock.py [--context 1024] [--tokens 4000]

vila-8b shapes, W4A16, synthetic weights (scripts/profile_decode.py's model). nvidia-smi samples every 50 ms;
prints tok/s per window of 500 tokens (host timestamps of the streamed tokens), then the samples summarised
(median / min SM clock, median / max power, the throttle-reason masks seen) and raw.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from profile_decode import text_model  # noqa: E402
from tinyvila.generate import Decoder, SamplingParams, generate  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--window", type=int, default=500)
    args = p.parse_args(argv)
    text = text_model(argparse.Namespace(preset="vila-8b", quant="w4a16", group_size=128, device="cuda"))
    dec = Decoder(text, max_seq_len=args.context + args.tokens + 64, cuda_graph=True)
    logits = dec.prefill(text.embed(torch.randint(0, 1000, (1, args.context), device="cuda")))
    params = SamplingParams(max_new_tokens=args.tokens + 1)
    dec.truncate(args.context)
    sum(1 for _ in zip(range(300), generate(dec, logits, params)))  # compile + capture
    dec.truncate(args.context)
    torch.cuda.synchronize()
    time.sleep(2.0)  # let the GPU cool to its idle state
    mon = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,"
                            "clocks_throttle_reasons.active,temperature.gpu", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    stamps = [time.perf_counter()]
    for i, _ in enumerate(generate(dec, logits, params), 1):
        if i % args.window == 0:
            stamps.append(time.perf_counter())
    torch.cuda.synchronize()
    time.sleep(0.3)
    mon.terminate()
    raw = mon.communicate()[0].strip().splitlines()
    rates = [args.window / (b - a) for a, b in zip(stamps, stamps[1:])]
    print(f"context {args.context}, {args.tokens} tokens: tok/s per {args.window}-token window: "
          + " ".join(f"{r:.1f}" for r in rates))
    rows = [[c.strip() for c in line.split(",")] for line in raw]
    busy = [r for r in rows if len(r) == 6 and r[3] not in ("", "[N/A]") and float(r[3]) > 150]
    if busy:
        clk, pw = [float(r[1]) for r in busy], [float(r[3]) for r in busy]
        reasons = collections.Counter(r[4] for r in busy)
        print(f"busy samples {len(busy)}: SM clock median {statistics.median(clk):.0f} MHz (min {min(clk):.0f}), "
              f"power median {statistics.median(pw):.0f} W (max {max(pw):.0f}), throttle reasons {dict(reasons)}")
    print("\n".join(raw))


if __name__ == "__main__":
    main()
