"""Perplexity of LLM checkpoints on held-out English text: fp16 against its W4A16 (RTN, AWQ) versions.

    python -m scripts.eval_quality [--models smollm2-135m smollm2-135m-rtn smollm2-135m-awq]
        [--n-blocks 16] [--seqlen 512] [--dequantize] [--device cpu]

Text: the held-out split of `pydoc_data.topics` (every 4th topic; tinyvila/convert/awq.py never
calibrates on it), tokenized per topic, concatenated, cut into n_blocks x seqlen tokens; each block is
scored independently (next-token NLL). Prints a table, then one JSON line. `--dequantize` evaluates a
W4A16 checkpoint as a dense model with the dequantized weights (no W4 kernels involved).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tinyvila import quant
from tinyvila.api import resolve_model
from tinyvila.convert.awq import pydoc_texts, token_blocks
from tinyvila.loader import _read_tensors, load_model, read_headers
from tinyvila.text import KVCache
from tinyvila.tokenizer import load_tokenizer
from tinyvila.vlm import VLM

DEFAULT_MODELS = ("smollm2-135m", "smollm2-135m-rtn", "smollm2-135m-awq")


def dequantized_model(folder: Path, device: str, dtype: torch.dtype | None) -> VLM:
    """A W4A16 checkpoint as a dense VLM whose linears hold `dequantize_w4` of the stored W4 tensors."""
    from tinyvila.config import VLMConfig

    cfg = VLMConfig.load(folder)
    dense_cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, llm="none"))
    _, where, _ = read_headers(folder)
    sd = _read_tensors(folder, where)
    wdtype = getattr(torch, cfg.dtype)
    for k in [k for k in sd if k.endswith(".qweight")]:
        p = k.removesuffix(".qweight")
        sd[p + ".weight"] = quant.dequantize_w4(sd.pop(k), sd.pop(p + ".scales"), sd.pop(p + ".zeros"), wdtype)
    with torch.device("meta"):
        model = VLM(dense_cfg)
    model.load_state_dict(sd, assign=True, strict=True)
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def perplexity(model: VLM, tokens: torch.Tensor, batch: int = 4, desc: str = "perplexity") -> float:
    """exp(mean next-token NLL) over blocks tokens (n, T), each block scored on its own."""
    text, nll, count = model.text, 0.0, 0
    for b0 in tqdm(range(0, tokens.shape[0], batch), desc=desc, unit="batch"):
        ids = tokens[b0:b0 + batch].to(model.device)  # (B, T)
        cache = KVCache(text.cfg, batch=ids.shape[0], max_seq_len=ids.shape[1], dtype=model.dtype,
                        device=model.device)
        logits = text(text.embed(ids), cache, 0)  # (B, T, V) fp32
        nll += F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids[:, 1:].numel()
    return math.exp(nll / count)


def evaluate(name: str, args: argparse.Namespace) -> dict:
    folder = resolve_model(name)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    t0 = time.perf_counter()
    from tinyvila.config import VLMConfig

    cfg = VLMConfig.load(folder)
    if cfg.quant.llm != "none" and args.dequantize:
        model = dequantized_model(folder, args.device, dtype)
    else:
        model = load_model(folder, device=args.device, dtype=dtype)
    tokens = token_blocks(load_tokenizer(folder / cfg.tokenizer), pydoc_texts("heldout"), args.n_blocks, args.seqlen)
    ppl = perplexity(model, tokens, desc=name)
    return {"model": name, "quant": cfg.quant.llm, "group_size": cfg.quant.group_size if cfg.quant.llm != "none"
            else None, "ppl": round(ppl, 4), "tokens": int(tokens.numel()), "seconds": round(time.perf_counter() - t0, 1),
            "weights": "dequantized" if cfg.quant.llm != "none" and args.dequantize else cfg.quant.llm}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="checkpoint folders or names")
    p.add_argument("--n-blocks", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="compute dtype (default float32; '' keeps the stored one)")
    p.add_argument("--dequantize", action="store_true", help="run W4A16 checkpoints as dense dequantized weights")
    args = p.parse_args(argv)
    rows = [evaluate(m, args) for m in args.models]
    print(f"{'model':<28} {'quant':<7} {'G':>4} {'ppl':>10} {'tokens':>7} {'s':>6}")
    for r in rows:
        print(f"{r['model']:<28} {r['quant']:<7} {str(r['group_size'] or '-'):>4} {r['ppl']:>10.4f} "
              f"{r['tokens']:>7} {r['seconds']:>6}")
    print(json.dumps({"eval": "perplexity", "text": "pydoc_data.topics heldout (every 4th topic)",
                      "device": args.device, "compute_dtype": args.dtype or "stored", "torch": torch.__version__,
                      "python": platform.python_version(), "date": datetime.date.today().isoformat(),
                      "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
