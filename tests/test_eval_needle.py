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


@pytest.fixture(scope="module")
def setup():
    import eval_needle

    import tinyvila

    vlm = tinyvila.load(CKPT, dtype=torch.float32)
    return eval_needle, vlm, eval_needle.make_cases(eval_needle.haystack(vlm.tokenizer, 600), 1, seed=0)


def test_dense_finds_the_needle(setup):
    eval_needle, vlm, cases = setup
    assert eval_needle.evaluate(vlm, cases, keep=1.0, max_new=14, methods=("dense",))["dense"] == [True]


# Measured in this session: with the haystack retrievable, decode_keep 0.25 (and 0.1) loses this needle
# that dense decoding finds (docs/benchmarks.md). Kept visible as a strict xfail, not skipped: it turns
# into a failure the day retrieval finds it, so the marker must then be removed.
@pytest.mark.xfail(strict=True, reason="SparseVILA retrieval misses the needle on SmolLM2 at keep 0.25 (open)")
def test_retrieval_at_quarter_keep_finds_the_needle(setup):
    eval_needle, vlm, cases = setup
    assert eval_needle.evaluate(vlm, cases, keep=0.25, max_new=14, methods=("sparsevila",))["sparsevila"] == [True]
