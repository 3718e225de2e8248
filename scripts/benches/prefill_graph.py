"""First-turn prefill of the LLM: eager against CUDA-graph replay (tinyvila/generate.py; the chat's TTFT).

    python -m scripts.bench_kernels --only prefill_graph [--quick]
    python -m scripts.bench_kernels --only prefill_graph --prefill-graph-t 200,447,1000 \
        --prefill-graph-preset vila-8b --prefill-graph-quant w4a16      (the defaults: 447, vila-8b, w4a16)
    python -m scripts.bench_kernels --only prefill_graph --prefill-graph-t 46 --prefill-graph-start 600 \
        --prefill-graph-profile 12      (a follow-up question: 46 rows over a 600-token cache; top 12 kernels)

One prefill of T tokens into an empty cache (a chat's first turn: system + one image + a short question
is 447 tokens for vila-8b), synthetic weights at the preset's shapes (tinyvila.api.from_config, as
scripts/bench.py), fp16. Per T: `eager` (Options cuda_graph off: the chunked eager prefill at T rows),
`eager_pad` (the same forward eagerly at the padded bucket: the padding's GPU cost) and `graph` (the
replay at the bucket). Each is timed over `iters` prefills (after warm-up) both with CUDA events around
the call and by wall clock with a synchronize before and after (what a user waits); medians. `capture_ms`
is the first graph prefill (eager warm-up + capture + replay), `pool_mb` the memory it reserved.
`max_dlogit` is max |graph - eager| over the logits, `same_argmax` whether their argmax agree.
With `--prefill-graph-start S` the cache already holds S tokens and the T rows are a later turn (a follow-up
question), replayed from the later-turn graph; `--prefill-graph-profile N` prints the N kernels with the most
device time over the graph replays (torch.profiler), each with its share: where a turn's device time goes.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from scripts.benches import common
from tinyvila.api import from_config
from tinyvila.config import QuantConfig, preset
from tinyvila.generate import Decoder, prefill_bucket
from tinyvila.options import Options


def text_vlm(name: str, quant: str):
    """A text-only VLM of the preset's LLM (synthetic weights)."""
    cfg = dataclasses.replace(preset(name), vision=None, projector=None,
                              quant=QuantConfig(llm=quant, vision="none", group_size=128))
    return from_config(cfg, device="cuda").model


def decoder(vlm, opts: Options, max_seq_len: int = 4096) -> Decoder:
    """A Decoder of vlm's LLM built under `opts` (the Decoder takes its CUDA-graph switch from the model's options)."""
    vlm.set_options(opts)
    return Decoder(vlm.text, max_seq_len=max_seq_len)


def time_prefill(dec: Decoder, h: torch.Tensor, iters: int, cached: int = 0) -> tuple[float, float, torch.Tensor]:
    """(median event ms, median wall ms, last logits) of `iters` prefills of h after the first `cached`
    tokens (0: a first turn)."""
    events, walls = [], []
    for _ in range(iters):
        dec.truncate(cached)
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


def kernel_profile(fn, top: int) -> list[tuple[str, float, float]]:
    """(kernel name, device us per call of fn, share of fn's kernel time) of the `top` kernels, over 5 calls."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name] = times.get(ev.name, 0.0) + ev.device_time_total / 5
    total = sum(times.values()) or 1.0
    return [(name, us, us / total) for name, us in sorted(times.items(), key=lambda kv: -kv[1])[:top]]


def measure(vlm, opts: Options, T: int, iters: int, start: int = 0, profile_top: int = 0) -> dict:
    """Eager, padded eager and graph prefills of T tokens after `start` cached ones; each Decoder is built and
    timed under its own options (set on the model again before it runs, whether a Decoder reads them once or
    per call)."""
    text, eager_opts, graph_opts = vlm.text, opts.with_(cuda_graph=False), opts.with_(cuda_graph=True)
    with torch.inference_mode():
        h = text.embed(torch.randint(0, min(1000, text.cfg.vocab_size), (1, T), device="cuda"))  # (1, T, d)
        h0 = text.embed(torch.randint(0, min(1000, text.cfg.vocab_size), (1, start), device="cuda")) if start else None
    room = max(4096, start + 2 * T)
    eager, padded = decoder(vlm, eager_opts, room), decoder(vlm, eager_opts, room)
    padded.pad_prefill = True
    graph = decoder(vlm, graph_opts, room)
    for dec, dec_opts in ((eager, eager_opts), (padded, eager_opts), (graph, graph_opts)):
        vlm.set_options(dec_opts)
        if start:  # the earlier turns, once: every timed prefill truncates back to them
            dec.prefill(h0)
    vlm.set_options(eager_opts)
    for dec in (eager, padded):  # warm-up: compiles and grows workspaces before anything is timed
        time_prefill(dec, h, 2, start)
    vlm.set_options(graph_opts)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    for _ in range(2 if start else 1):  # a later turn's graph is captured on its key's second use
        graph.truncate(start)
        graph.prefill(h)
    torch.cuda.synchronize()
    capture_ms = 1000 * (time.perf_counter() - t0)
    pool_mb = (torch.cuda.memory_reserved() - reserved) / 2**20
    row = {"T": T, "start": start, "bucket": prefill_bucket(T)}
    out = {}
    for name, dec, dec_opts in (("eager", eager, eager_opts), ("eager_pad", padded, eager_opts),
                                ("graph", graph, graph_opts)):
        vlm.set_options(dec_opts)
        ev, wall, out[name] = time_prefill(dec, h, iters, start)
        row[f"{name}_ms"], row[f"{name}_wall_ms"] = ev, wall
    if profile_top:
        vlm.set_options(graph_opts)
        def replay():
            graph.truncate(start)
            graph.prefill(h)
        prof = kernel_profile(replay, profile_top)
        print(f"T={T} start={start}: top kernels of the graph prefill (us a call, share of its kernel time)")
        for kname, us, share in prof:
            print(f"  {us:9.1f} us {100 * share:5.1f}%  {kname[:110]}")
        row["profile"] = [{"kernel": k[:120], "us": round(us, 2), "share": round(sh, 4)} for k, us, sh in prof]
    vlm.set_options(opts)
    row["graph_ran"] = any(key[0] == "prefill" and key[2] == (start > 0) for key in graph.graphs.entries)
    if not row["graph_ran"]:
        print(f"T={T} start={start}: no graph prefill ran (the graph rows time the eager path)")
    row.update(capture_ms=capture_ms, pool_mb=pool_mb, speedup_wall=row["eager_wall_ms"] / row["graph_wall_ms"],
               max_dlogit=(out["graph"] - out["eager"]).abs().max().item(),
               same_argmax=bool(out["graph"].argmax() == out["eager"].argmax()))
    return row


def add_args(p) -> None:
    p.add_argument("--prefill-graph-t", type=common.ints, default=[447], metavar="T,...",
                   help="prompt lengths (default 447: system + one image + a short question for vila-8b)")
    p.add_argument("--prefill-graph-preset", default="vila-8b")
    p.add_argument("--prefill-graph-quant", default="w4a16", choices=["w4a16", "none"])
    p.add_argument("--prefill-graph-start", type=int, default=0, metavar="S",
                   help="tokens already cached before the timed prefill (a later turn; default 0: a first turn)")
    p.add_argument("--prefill-graph-options", default="", metavar="NAME=VALUE,...[;...]",
                   help="runtime options (tinyvila.options.Options fields, e.g. split_rows_attention=0); several "
                        "sets separated by ';' are each timed on the same model, in turn (A/B in one process)")
    p.add_argument("--prefill-graph-profile", type=int, default=0, metavar="N",
                   help="also print the N kernels with the most device time in the graph prefill")


def run(args) -> list[dict]:
    name, quant = args.prefill_graph_preset, args.prefill_graph_quant
    iters = 5 if args.quick else 20
    specs = args.prefill_graph_options.split(";")
    all_opts = [Options.parse(spec, Options.from_env()) for spec in specs]  # bad options fail before the model
    vlm = text_vlm(name, quant)
    rows = []
    for T in args.prefill_graph_t:
        for spec, opts in zip(specs, all_opts):
            rows.append({"preset": name, "quant": quant, "options": spec,
                         **measure(vlm, opts, T, iters, args.prefill_graph_start, args.prefill_graph_profile)})
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in rows[-1].items() if k != "profile"), flush=True)  # JSON lines come at the end
    return rows
