"""Decode-step profile of the LLM alone: eager vs CUDA-graph tok/s, and where a step's GPU time goes.

Per kernel, from torch.profiler over eager steps; with --variant, the graph step under other runtime options.

    python -m scripts.profile_decode --preset vila-8b --quant w4a16 --context 1024
    python -m scripts.profile_decode --variant pdl=0 --variant fused_norm_gemv=off,fused_silu=0

Synthetic weights at the preset's shapes (speed does not depend on the values); greedy; stop tokens ignored.
--options sets the model's runtime options (tinyvila.options.Options, on top of Options.from_env()); each
--variant times the graph step again with those options changed on top of them. Prints a table then one
JSON line. The end-to-end numbers live in scripts/bench.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from scripts.benches import common
from tinyvila.api import from_config
from tinyvila.config import QuantConfig, preset
from tinyvila.generate import Decoder, SamplingParams, generate
from tinyvila.options import Options


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="vila-8b")
    p.add_argument("--quant", default="w4a16", choices=["w4a16", "none"])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens before decoding")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=15, help="kernels listed in the profile")
    p.add_argument("--options", default="", metavar="NAME=VALUE,...",
                   help="runtime options of the model (tinyvila.options.Options fields), on top of Options.from_env()")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE,...",
                   help="also time the graph step with these options changed (repeatable), e.g. pdl=0, "
                        "dense_gemv=0, fused_norm_gemv=off, fused_silu=0, fused_rope_gemv=0, w4_gemv_kernel=fma")
    args = p.parse_args(argv)
    try:
        args.opts = Options.parse(args.options, Options.from_env())
        args.variant_opts = {spec: Options.parse(spec, args.opts) for spec in args.variant}
    except ValueError as e:
        p.error(str(e))
    return args


def text_vlm(args):
    """A text-only VLM of the preset's LLM under args.opts."""
    cfg = dataclasses.replace(preset(args.preset), vision=None, projector=None,
                              quant=QuantConfig(llm=args.quant, vision="none", group_size=args.group_size))
    return from_config(cfg, device=args.device, options=args.opts).model


def _sync(args) -> None:
    if args.device != "cpu":
        torch.cuda.synchronize()


def tok_per_s(vlm, args, opts: Options) -> float:
    """Decode tok/s of a fresh Decoder (fresh graphs) with the model under `opts`, after one warm-up run."""
    vlm.set_options(opts)
    text = vlm.text
    dec = Decoder(text, max_seq_len=args.context + args.new_tokens + 64)
    ids = torch.randint(0, min(1000, text.cfg.vocab_size), (1, args.context), device=args.device)
    logits = dec.prefill(text.embed(ids))
    params = SamplingParams(max_new_tokens=args.new_tokens + 1)
    for _ in range(2):  # warm-up: compiles, captures, then the measured run
        dec.truncate(args.context)
        _sync(args)
        t0 = time.perf_counter()
        n = sum(1 for _ in generate(dec, logits, params)) - 1  # the first token came from the prefill
        _sync(args)
    vlm.set_options(args.opts)
    return n / (time.perf_counter() - t0)


def kernel_profile(vlm, args) -> list[tuple[str, float, int]]:
    """(kernel name, GPU us per decode step, calls per step) over 10 eager steps, largest first."""
    vlm.set_options(args.opts.with_(cuda_graph=False))
    text = vlm.text
    dec = Decoder(text, max_seq_len=args.context + 64)
    logits = dec.prefill(text.embed(torch.randint(0, min(1000, text.cfg.vocab_size), (1, args.context),
                                                  device=args.device)))
    token = int(logits.argmax())
    dec.step(token)
    steps = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.step(token)
        torch.cuda.synchronize()
    vlm.set_options(args.opts)
    rows = [(e.key, e.device_time_total / steps, e.count // steps) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def print_profile(rows, graph_tok_s: float, top: int) -> float:
    """The per-kernel table; returns the eager step's GPU us."""
    total = sum(r[1] for r in rows)
    print(f"\nGPU time per eager step: {total:.0f} us (graph step: {1e6 / graph_tok_s:.0f} us)")
    print(f"{'kernel':<80} {'us/step':>8} {'calls':>6} {'share':>6}")
    for name, us, calls in rows[:top]:
        print(f"{name[:80]:<80} {us:8.1f} {calls:6d} {us / total:6.1%}")
    return total


def main(argv=None) -> int:
    args = parse_args(argv)
    vlm = text_vlm(args)
    eager = tok_per_s(vlm, args, args.opts.with_(cuda_graph=False))
    graph = tok_per_s(vlm, args, args.opts)
    print(f"{args.preset} {args.quant} context {args.context}: eager {eager:.1f} tok/s | "
          f"graph {graph:.1f} tok/s ({1000 / graph:.2f} ms/token)" + ("" if args.opts.cuda_graph else " (graphs off)"))
    result = dict(preset=args.preset, quant=args.quant, context=args.context, new_tokens=args.new_tokens,
                  options=dataclasses.asdict(args.opts), eager_tok_s=eager, graph_tok_s=graph)
    if args.variant_opts:
        result["variants"] = {}
        for spec, opts in args.variant_opts.items():
            result["variants"][spec] = v = tok_per_s(vlm, args, opts)
            print(f"  variant {spec}: {v:.1f} tok/s ({1000 / v:.3f} ms/token, x{v / graph:.3f} of the default)",
                  flush=True)
    if args.device != "cpu":
        rows = kernel_profile(vlm, args)
        total = print_profile(rows, graph, args.top)
        result.update(step_gpu_us=total,
                      kernels=[dict(name=n[:120], us=round(u, 2), calls=c) for n, u, c in rows[:args.top]])
    env = common.environment()
    if args.device == "cpu":
        env["gpu"] = "cpu"
    print(json.dumps({"bench": "profile_decode", **result, **env}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
