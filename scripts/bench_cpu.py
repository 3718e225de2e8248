"""CPU decode speed: the W4A16 LLM against the same model in fp16, at SmolLM2-135M's shapes (the real model the
project runs offline on CPU: 30 layers, width 576, 9 / 3 heads, FFN 1536, vocab 49152, tied embeddings).

    python -m scripts.bench_cpu                          # dense, W4 (group 64) in its three CPU forms; fp16
    python -m scripts.bench_cpu --new-tokens 64 --repeats 5 --threads 2 --pipelines dense,w4

w4 is the default: linears of up to 256 rows (decode, this short prompt's prefill) through PyTorch's packed-int4 CPU
matmul (Options.w4_cpu_int4, bf16 operands), longer ones through the reference path of ops.w4a16_linear, which
dequantizes all the weights for every call; w4+ref runs every call that way (w4_cpu_int4=0); w4+cache
(`--options w4_cpu_cache=1` in the CLI) keeps each linear's weights dequantized after the first call, at 4 bytes a
weight. Synthetic weights (speed does not depend on the
values), greedy, stop tokens ignored, a ~50-token text prompt; each pipeline answers once unmeasured, then
--repeats times (median decode tok/s). Prints a table, then one JSON line (versions, commit). A speed bench, not a
test: CPU timings move with the machine's load, so run it on a quiet machine and record the numbers in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

import tinyvila
from scripts.benches import common
from tinyvila.api import from_config
from tinyvila.config import QuantConfig, TextConfig, VLMConfig

SMOLLM2_135M = TextConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                          rope_theta=100000.0, tie_embeddings=True, max_seq_len=2048)
PIPELINES = {  # name -> (quant, options)
    "dense": ("none", tinyvila.Options()),
    "w4": ("w4a16", tinyvila.Options()),
    "w4+ref": ("w4a16", tinyvila.Options(w4_cpu_int4=False)),
    "w4+cache": ("w4a16", tinyvila.Options(w4_cpu_cache=True)),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pipelines", default=",".join(PIPELINES), help=f"comma-separated, from {','.join(PIPELINES)}")
    p.add_argument("--layers", type=int, default=SMOLLM2_135M.n_layers, help="fewer layers: a quicker, smaller run")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--group-size", type=int, default=64, help="W4 group size (576 is not a multiple of 128)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    return p.parse_args(argv)


def measure(name: str, args) -> dict:
    """One pipeline's row: decode tok/s (median of --repeats answers) and prefill ms."""
    quant, opts = PIPELINES[name]
    text = dataclasses.replace(SMOLLM2_135M, n_layers=args.layers)
    cfg = VLMConfig(text=text, dtype=args.dtype, template="smollm2",
                    quant=QuantConfig(llm=quant, group_size=args.group_size))
    vlm = from_config(cfg, device="cpu", options=opts)
    vlm.stop_ids = frozenset()  # exactly --new-tokens an answer
    chat = vlm.chat(sampling=tinyvila.SamplingParams(max_new_tokens=args.new_tokens))
    question = "Summarise the rules of chess in a few sentences, for a child who has never played."
    runs = []
    for i in range(args.repeats + 1):
        chat.clear()
        for _ in chat.ask(question):
            pass
        if i:  # the first answer warms up
            runs.append((chat.stats.decode_tok_s, chat.stats.prefill_ms))
    tok_s = statistics.median(r[0] for r in runs)
    return {"pipeline": name, "decode_tok_s": tok_s, "prefill_ms": statistics.median(r[1] for r in runs),
            "runs_tok_s": [r[0] for r in runs]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.pipelines.split(",") if n]
    unknown = [n for n in names if n not in PIPELINES]
    if unknown:
        raise SystemExit(f"unknown pipelines {unknown}; choose from {', '.join(PIPELINES)}")
    rows = [measure(n, args) for n in names]
    base = next((r for r in rows if r["pipeline"] == "dense"), None)
    for r in rows:
        r["x_dense"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
    common.print_table([{k: v for k, v in r.items() if k != "runs_tok_s"} for r in rows])
    print(json.dumps({"bench": "cpu_decode", **vars(args), "torch_threads": torch.get_num_threads(), "rows": rows,
                      **common.environment()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
