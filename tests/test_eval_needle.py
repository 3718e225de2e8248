"""Needle-in-a-text on the real SmolLM2-135M (scripts/eval_needle.py) with one needle.

Skipped only when the checkpoint (built by `scripts/quantize.py import-gguf`) is absent. The 20-needle
comparison with counts is the script's job (docs/benchmarks.md); this runs its first case.
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CKPT = ROOT / "checkpoints" / "smollm2-135m"
sys.path.insert(0, str(ROOT / "scripts"))

pytestmark = pytest.mark.skipif(not (CKPT / "config.json").is_file(), reason="SmolLM2 checkpoint not built")


def test_retrieval_at_keep_one_tenth_finds_the_needle_dense_finds():
    import eval_needle

    import tinyvila

    vlm = tinyvila.load(CKPT, dtype=torch.float32)
    cases = eval_needle.make_cases(eval_needle.haystack(vlm.tokenizer, 600), 1, seed=0)
    got = eval_needle.evaluate(vlm, cases, keeps=(0.1,), fastv_keep=None, window=8, max_new=14)
    assert got == {"dense": [True], "sparsevila@0.1": [True]}
