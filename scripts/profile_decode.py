"""Decode-step profile of the LLM alone: tok/s eager vs CUDA-graph replay, and where a step's GPU
time goes (per kernel, from torch.profiler over eager steps).

    PYTHONPATH=. python scripts/profile_decode.py --preset vila-8b --quant w4a16 --context 1024

Synthetic weights at the preset's shapes (speed does not depend on the values); greedy; stop
tokens ignored. Prints a table then one JSON line. The end-to-end numbers live in scripts/bench.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tinyvila.api import from_config  # noqa: E402
from tinyvila.config import QuantConfig, preset  # noqa: E402
from tinyvila.generate import Decoder, SamplingParams, generate  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="vila-8b")
    p.add_argument("--quant", default="w4a16", choices=["w4a16", "none"])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens before decoding")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=15, help="kernels listed in the profile")
    p.add_argument("--variants", default="",
                   help="also time the graph step under settings, e.g. 'pdl=0,pdl=1' (programmatic dependent "
                        "launch, csrc_triton/pdl.py) or 'lmhead=cublas,lmhead=triton' (ops.DENSE_GEMV) or "
                        "'norm=plain,norm=fused' / 'silu=...' (ops.FUSED_NORM_GEMV, ops.FUSED_SILU: RMSNorms / SwiGLU "
                        "in separate launches, or fused into the W4 GEMVs) or 'rope=kernel,rope=gemv' "
                        "(ops.FUSED_ROPE_GEMV: RoPE + KV write in the rope_qkv launch, or in the qkv GEMV's epilogue)")
    return p.parse_args(argv)


def text_model(args):
    cfg = dataclasses.replace(preset(args.preset), vision=None, projector=None,
                              quant=QuantConfig(llm=args.quant, vision="none", group_size=args.group_size))
    return from_config(cfg, device=args.device).model.text


def tok_per_s(text, args, graph: bool) -> float:
    dec = Decoder(text, max_seq_len=args.context + args.new_tokens + 64, cuda_graph=graph)
    ids = torch.randint(0, min(1000, text.cfg.vocab_size), (1, args.context), device=args.device)
    logits = dec.prefill(text.embed(ids))
    params = SamplingParams(max_new_tokens=args.new_tokens + 1)
    for _ in range(2):  # warm-up: compiles, captures, then the measured run
        dec.truncate(args.context)
        if args.device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = sum(1 for _ in generate(dec, logits, params)) - 1  # the first token came from the prefill
        if args.device != "cpu":
            torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def kernel_profile(text, args) -> list[tuple[str, float, int]]:
    """(kernel name, GPU us per decode step, calls per step) over 10 eager steps, largest first."""
    dec = Decoder(text, max_seq_len=args.context + 64, cuda_graph=False)
    logits = dec.prefill(text.embed(torch.randint(0, min(1000, text.cfg.vocab_size), (1, args.context), device=args.device)))
    token = int(logits.argmax())
    dec.step(token)
    steps = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.step(token)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / steps, e.count // steps) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def _patch(setting: str):
    """The mock patch of one 'key=value' setting of --variants."""
    from csrc_triton import w4a16_gemv
    from tinyvila import ops

    key, value = setting.split("=")
    if key == "pdl":
        return mock.patch.dict(os.environ, {"TINYVILA_PDL": value})
    if key == "lmhead" and value in ("cublas", "triton"):
        return mock.patch.object(ops, "DENSE_GEMV", value == "triton")
    if key == "silu" and value in ("plain", "fused"):
        return mock.patch.object(ops, "FUSED_SILU", value == "fused")
    if key == "rope" and value in ("kernel", "gemv"):
        return mock.patch.object(ops, "FUSED_ROPE_GEMV", value == "gemv")
    if key == "norm" and value in ("plain", "fused"):
        return mock.patch.object(ops, "FUSED_NORM_GEMV", "off" if value == "plain" else "auto")
    if key in ("trigger", "silutrigger") and value in ("0", "1", "2"):
        return mock.patch.object(w4a16_gemv, "TRIGGER" if key == "trigger" else "SILU_TRIGGER", int(value))
    raise SystemExit(f"--variants: unknown setting {setting!r} (pdl=0|1, lmhead=cublas|triton, norm|silu=plain|fused, "
                     "rope=kernel|gemv, trigger|silutrigger=0|1|2)")


def variants(text, args) -> dict[str, float]:
    """Graph tok/s per variant: settings 'pdl=P', 'lmhead=cublas|triton', 'norm=plain|fused', 'silu=plain|fused',
    'rope=kernel|gemv', 'trigger=T' / 'silutrigger=T' (when a W4 GEMV lets the next PDL kernel start: csrc_triton/w4a16_gemv.py),
    several joined by '+' (a fresh Decoder, so fresh graphs, for each); restores the settings afterwards."""
    out = {}
    for spec in args.variants.split(","):
        with contextlib.ExitStack() as stack:
            for setting in spec.split("+"):
                stack.enter_context(_patch(setting))
            out[spec] = tok_per_s(text, args, True)
        print(f"  variant {spec}: graph {out[spec]:.1f} tok/s ({1000 / out[spec]:.3f} ms/token)", flush=True)
    return out


def main(argv=None):
    args = parse_args(argv)
    text = text_model(args)
    eager, graph = tok_per_s(text, args, False), tok_per_s(text, args, args.device != "cpu")
    print(f"{args.preset} {args.quant} context {args.context}: eager {eager:.1f} tok/s | "
          f"graph {graph:.1f} tok/s ({1000 / graph:.2f} ms/token)")
    result = dict(preset=args.preset, quant=args.quant, context=args.context, eager_tok_s=eager, graph_tok_s=graph)
    if args.variants and args.device != "cpu":
        result["variants"] = variants(text, args)
    if args.device != "cpu":
        rows = kernel_profile(text, args)
        total = sum(r[1] for r in rows)
        print(f"\nGPU time per eager step: {total:.0f} us (graph step: {1e6 / graph:.0f} us)")
        print(f"{'kernel':<80} {'us/step':>8} {'calls':>6} {'share':>6}")
        for name, us, calls in rows[:args.top]:
            print(f"{name[:80]:<80} {us:8.1f} {calls:6d} {us / total:6.1%}")
        result.update(gpu=torch.cuda.get_device_name(), step_gpu_us=total,
                      kernels=[dict(name=n[:120], us=round(u, 2), calls=c) for n, u, c in rows[:args.top]])
    result.update(torch=torch.__version__)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
