"""First-turn prefill of the LLM: eager against CUDA-graph replay (tinyvila/generate.py, issue 7 TTFT).

    PYTHONPATH=. python scripts/benches/prefill_graph.py
    PYTHONPATH=. python scripts/bench_kernels.py --only prefill_graph [--quick]
    PREFILL_GRAPH_T=200,447,1000 PREFILL_GRAPH_PRESET=vila-8b PREFILL_GRAPH_QUANT=w4a16 ... (the defaults: 447)

One prefill of T tokens into an empty cache (a chat's first turn: system + one image + a short question
is 447 tokens for vila-8b), synthetic weights at the preset's shapes (tinyvila.api.from_config, as
scripts/bench.py), fp16. Per T: `eager` (cuda_graph=False: the chunked eager prefill at T rows),
`eager_pad` (the same forward eagerly at the padded bucket: the padding's GPU cost) and `graph` (the
replay at the bucket). Each is timed over `iters` prefills (after warm-up) both with CUDA events around
the call and by wall clock with a synchronize before and after (what a user waits); medians. `capture_ms`
is the first graph prefill (eager warm-up + capture + replay), `pool_mb` the memory it reserved.
`max_dlogit` is max |graph - eager| over the logits, `same_argmax` whether their argmax agree.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benches`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tinyvila`

import torch  # noqa: E402

from benches import common  # noqa: E402
from tinyvila.api import from_config  # noqa: E402
from tinyvila.config import QuantConfig, preset  # noqa: E402
from tinyvila.generate import Decoder, prefill_bucket  # noqa: E402


def text_model(name: str, quant: str):
    cfg = dataclasses.replace(preset(name), vision=None, projector=None,
                              quant=QuantConfig(llm=quant, vision="none", group_size=128))
    return from_config(cfg, device="cuda").model.text


def time_prefill(dec: Decoder, h: torch.Tensor, iters: int) -> tuple[float, float, torch.Tensor]:
    """(median event ms, median wall ms, last logits) of `iters` first-turn prefills of h."""
    events, walls = [], []
    for _ in range(iters):
        dec.truncate(0)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        logits = dec.prefill(h)
        end.record()
        torch.cuda.synchronize()
        walls.append(1000 * (time.perf_counter() - t0))
        events.append(start.elapsed_time(end))
    return sorted(events)[iters // 2], sorted(walls)[iters // 2], logits


def measure(text, T: int, iters: int) -> dict:
    with torch.inference_mode():
        h = text.embed(torch.randint(0, min(1000, text.cfg.vocab_size), (1, T), device="cuda"))  # (1, T, d)
    eager = Decoder(text, max_seq_len=4096, cuda_graph=False)
    padded = Decoder(text, max_seq_len=4096, cuda_graph=False)
    padded.pad_prefill = True
    graph = Decoder(text, max_seq_len=4096, cuda_graph=True)
    for dec in (eager, padded):  # warm-up: compiles and grows workspaces before anything is timed
        time_prefill(dec, h, 2)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    graph.prefill(h)
    torch.cuda.synchronize()
    capture_ms = 1000 * (time.perf_counter() - t0)
    pool_mb = (torch.cuda.memory_reserved() - reserved) / 2**20
    row = {"T": T, "bucket": prefill_bucket(T)}
    out = {}
    for name, dec in (("eager", eager), ("eager_pad", padded), ("graph", graph)):
        ev, wall, out[name] = time_prefill(dec, h, iters)
        row[f"{name}_ms"], row[f"{name}_wall_ms"] = ev, wall
    assert graph._prefill_graphs, "the graph path did not run"
    row.update(capture_ms=capture_ms, pool_mb=pool_mb, speedup_wall=row["eager_wall_ms"] / row["graph_wall_ms"],
               max_dlogit=(out["graph"] - out["eager"]).abs().max().item(),
               same_argmax=bool(out["graph"].argmax() == out["eager"].argmax()))
    return row


def run(args) -> list[dict]:
    name = os.environ.get("PREFILL_GRAPH_PRESET", "vila-8b")
    quant = os.environ.get("PREFILL_GRAPH_QUANT", "w4a16")
    lengths = [int(t) for t in os.environ.get("PREFILL_GRAPH_T", "447").split(",")]
    iters = 5 if getattr(args, "quick", False) else 20
    text = text_model(name, quant)
    rows = []
    for T in lengths:
        rows.append({"preset": name, "quant": quant, **measure(text, T, iters)})
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    common.emit("prefill_graph", run(None))
