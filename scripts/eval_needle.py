"""Needle in a long text: does decode-time retrieval find what dense decoding finds?

    PYTHONPATH=. python scripts/eval_needle.py --model checkpoints/smollm2-135m [--needles 20]

A haystack of English text (Python's own pydoc_data.topics) holds one sentence "The secret number
of NAME is NUMBER." at a given depth; the question asks for it. The haystack is added with
`Chat.add_document`, so it is a retrievable span. Methods: dense decoding; SparseVILA retrieval
(`decode_keep`, re-chosen per question, per layer and KV head); and FastV-style permanent pruning
at prefill (tinyvila.sparsity.fastv_keep_mask: layer K-1's last-token attention keeps the same
fraction for layers >= K). Prints counts of correct answers, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tinyvila  # noqa: E402
from tinyvila.config import SparsityConfig  # noqa: E402
from tinyvila.generate import Decoder, SamplingParams, generate  # noqa: E402
from tinyvila.kv_cache import changed_range  # noqa: E402
from tinyvila.sparsity import fastv_keep_mask  # noqa: E402
from tinyvila.tokenizer import turn_ids  # noqa: E402

NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena"]


def haystack(tokenizer, n_tokens: int) -> list[str]:
    """Sentences of English text, about n_tokens long in total."""
    import pydoc_data.topics as topics

    text = " ".join(" ".join(v.split()) for _, v in sorted(topics.topics.items()))
    sentences, total = [], 0
    for s in text.split(". "):
        sentences.append(s.strip() + ".")
        total += len(tokenizer.encode(s, add_special_tokens=False)) + 1
        if total >= n_tokens:
            break
    return sentences


def make_cases(sentences: list[str], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        depth = (i % 5 + 0.5) / 5  # 0.1, 0.3, 0.5, 0.7, 0.9 of the way in
        name, number = NAMES[i % len(NAMES)], str(rng.randrange(10000, 99999))
        at = int(depth * len(sentences))
        doc = " ".join(sentences[:at] + [f"The secret number of {name} is {number}."] + sentences[at:])
        cases.append({"depth": depth, "name": name, "number": number, "doc": doc,
                      "question": f"What is the secret number of {name}? Answer with the number only."})
    return cases


def answer_chat(vlm, case, keep: float, max_new: int) -> str:
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=max_new), sparsity=SparsityConfig(decode_keep=keep))
    chat.add_document(case["doc"])
    return "".join(chat.ask(case["question"]))


def answer_fastv(vlm, case, keep: float, max_new: int) -> str:
    """Prefill once to score (the last prompt row), then again with the pruned slots hidden from
    layers >= K, and decode with them hidden: the pruning is permanent."""
    tok, tmpl = vlm.tokenizer, vlm.template
    user = case["doc"] + "\n\n" + case["question"]
    ids = turn_ids(tok, tmpl, user, 0, first=True)
    a, b = changed_range(ids, turn_ids(tok, tmpl, "\n\n" + case["question"], 0, first=True))
    dec = Decoder(vlm.model.text)
    dec.cache.add_span("text", a, b, retrievable=True)
    dec.cache.begin_scoring(len(ids) - 1)
    h = vlm.model.embed(ids)
    dec.prefill(h)
    scores, idx = dec.cache.scoring.scores, dec.cache.scoring.idx
    dec.truncate(0)
    dec.cache.key_mask = fastv_keep_mask(scores, idx, dec.max_len, keep)
    logits = dec.prefill(h)
    out = list(generate(dec, logits, SamplingParams(max_new_tokens=max_new), vlm.stop_ids, tok.vocab_size))
    return tok.decode([t for t in out if t not in vlm.stop_ids])


METHODS = {
    "dense": lambda vlm, c, keep, n: answer_chat(vlm, c, 1.0, n),
    "sparsevila": answer_chat,
    "fastv": answer_fastv,
}


def evaluate(vlm, cases, keep: float, max_new: int, methods=tuple(METHODS)) -> dict:
    results = {m: [] for m in methods}
    for case in cases:
        for m in methods:
            text = METHODS[m](vlm, case, keep, max_new)
            results[m].append(case["number"] in text)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m")
    p.add_argument("--needles", type=int, default=20)
    p.add_argument("--tokens", type=int, default=1200, help="haystack length in tokens")
    p.add_argument("--keep", type=float, default=0.1, help="decode_keep / FastV keep fraction of the haystack")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vlm = tinyvila.load(args.model, device=device, dtype=getattr(torch, args.dtype))
    cases = make_cases(haystack(vlm.tokenizer, args.tokens), args.needles, args.seed)
    t0 = time.perf_counter()
    results = evaluate(vlm, cases, args.keep, args.max_new_tokens)
    print(f"{'method':<12} correct / {len(cases)}   (keep {args.keep}, haystack ~{args.tokens} tokens)")
    for m, ok in results.items():
        by_depth = {d: sum(o for o, c in zip(ok, cases) if c["depth"] == d) for d in sorted({c["depth"] for c in cases})}
        print(f"{m:<12} {sum(ok):>3}   by depth {by_depth}")
    print(json.dumps({"eval": "needle", "model": str(args.model), "keep": args.keep, "tokens": args.tokens,
                      "needles": len(cases), "device": device, "seconds": round(time.perf_counter() - t0, 1),
                      **{m: sum(ok) for m, ok in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
