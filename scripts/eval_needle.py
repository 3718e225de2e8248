"""Needle in a long text: does decode-time retrieval find what dense decoding finds?

    python -m scripts.eval_needle --model checkpoints/smollm2-135m [--needles 20 --tokens 600]

A haystack of English text (Python's own pydoc_data.topics) holds one sentence "The secret number
of NAME is NUMBER." at a depth cycling over 0.1..0.9; the question asks for it. The haystack is added
with `Chat.add_document`, so it is a retrievable text span. Methods: dense decoding; SparseVILA
retrieval at each `--keeps` (re-chosen per question, per layer and KV head, `--window` over text);
FastV-style permanent pruning at prefill (`retrieval.FastV`: layer K-1's last-row attention keeps
`--fastv-keep` of the haystack for layers >= K). Dense and the retrieval rounds share one document
prefill: an eval-mode session (partial eviction) answers each round as a fresh session would.
Prints counts of correct answers per method and depth, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

import tinyvila
from tinyvila.config import SparsityConfig
from tinyvila.generate import Decoder, SamplingParams, generate
from tinyvila.kv_cache import changed_range
from tinyvila.tokenizer import turn_ids

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


def answer_rounds(vlm, case, keeps: list[float], window: int, max_new: int) -> dict[str, str]:
    """Dense, then each decode keep, as rounds of one eval-mode session: the document is prefilled
    once and every round is answered as a fresh session with only that round's question."""
    chat = vlm.chat(sampling=SamplingParams(max_new_tokens=max_new), mode="eval",
                    sparsity=SparsityConfig(decode_window=window))
    chat.add_document(case["doc"])
    out = {"dense": "".join(chat.ask(case["question"]))}
    for keep in keeps:
        chat.sparsity = SparsityConfig(decode_keep=keep, decode_window=window)
        out[f"sparsevila@{keep:g}"] = "".join(chat.ask(case["question"]))
    return out


def answer_fastv(vlm, case, keep: float, max_new: int) -> str:
    """One prefill: after layer K-1 the haystack slots outside the last row's top `keep` are hidden
    from layers >= K, in this prefill and while decoding (the pruning is permanent)."""
    tok, tmpl = vlm.tokenizer, vlm.template
    ids = turn_ids(tok, tmpl, case["doc"] + "\n\n" + case["question"], 0, first=True)
    a, b = changed_range(ids, turn_ids(tok, tmpl, "\n\n" + case["question"], 0, first=True))
    dec = Decoder(vlm.model.text)
    dec.cache.add_span("text", a, b, retrievable=True)
    dec.fastv.begin(len(ids) - 1, keep)
    logits = dec.prefill(vlm.model.embed(ids))
    out = list(generate(dec, logits, SamplingParams(max_new_tokens=max_new), vlm.stop_ids, tok.vocab_size))
    return tok.decode([t for t in out if t not in vlm.stop_ids])


def evaluate(vlm, cases, keeps=(0.25, 0.1), fastv_keep: float | None = 0.1, window: int = 8,
             max_new: int = 16, log=None) -> dict[str, list[bool]]:
    """{method: [the needle's number is in the answer, per case]}."""
    results: dict[str, list[bool]] = {}
    for case in cases:
        answers = answer_rounds(vlm, case, list(keeps), window, max_new)
        if fastv_keep is not None:
            answers[f"fastv@{fastv_keep:g}"] = answer_fastv(vlm, case, fastv_keep, max_new)
        for m, text in answers.items():
            results.setdefault(m, []).append(case["number"] in text)
        if log:
            log(f"depth {case['depth']:.1f} {case['number']}: " + " | ".join(f"{m} {t.strip()!r}" for m, t in answers.items()))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m")
    p.add_argument("--needles", type=int, default=20)
    p.add_argument("--tokens", type=int, default=600, help="haystack length in tokens")
    p.add_argument("--keeps", default="0.25,0.1", help="decode_keep fractions of the haystack, comma-separated")
    p.add_argument("--fastv-keep", type=float, default=0.1, help="FastV keep fraction (0 = skip FastV)")
    p.add_argument("--window", type=int, default=SparsityConfig.decode_window, help="decode_window over the text")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true", help="print every answer")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vlm = tinyvila.load(args.model, device=device, dtype=getattr(torch, args.dtype))
    cases = make_cases(haystack(vlm.tokenizer, args.tokens), args.needles, args.seed)
    keeps = [float(k) for k in args.keeps.split(",") if k]
    t0 = time.perf_counter()
    results = evaluate(vlm, cases, keeps, args.fastv_keep or None, args.window, args.max_new_tokens,
                       log=print if args.verbose else None)
    depths = sorted({c["depth"] for c in cases})
    print(f"{'method':<16} correct / {len(cases)}   (haystack ~{args.tokens} tokens, window {args.window})")
    for m, ok in results.items():
        by_depth = {d: sum(o for o, c in zip(ok, cases) if c["depth"] == d) for d in depths}
        print(f"{m:<16} {sum(ok):>3}   by depth {by_depth}")
    print(json.dumps({"eval": "needle", "model": str(args.model), "tokens": args.tokens, "window": args.window,
                      "needles": len(cases), "device": device, "seconds": round(time.perf_counter() - t0, 1),
                      **{m: sum(ok) for m, ok in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
