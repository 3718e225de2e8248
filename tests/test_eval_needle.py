"""Needle-in-a-text on the real SmolLM2-135M (scripts/eval_needle.py) with a few needles.

Skipped only when the checkpoint (built by `scripts/quantize.py import-gguf`) is absent. The full
20-needle comparison with counts is the script's job (docs/benchmarks.md).
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CKPT = ROOT / "checkpoints" / "smollm2-135m"
sys.path.insert(0, str(ROOT / "scripts"))

pytestmark = pytest.mark.skipif(not (CKPT / "config.json").is_file(), reason="SmolLM2 checkpoint not built")


def test_dense_and_retrieval_find_a_needle_in_a_short_text():
    import eval_needle

    import tinyvila

    vlm = tinyvila.load(CKPT, dtype=torch.float32)
    cases = eval_needle.make_cases(eval_needle.haystack(vlm.tokenizer, 600), 1, seed=0)
    res = eval_needle.evaluate(vlm, cases, keep=0.25, max_new=14, methods=("dense", "sparsevila"))
    assert res["dense"] == [True]
    assert res["sparsevila"] == [True]
