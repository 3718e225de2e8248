"""csrc_triton.argmax against torch.argmax: lengths across block edges, ties (the first index wins), NaN (the
first NaN wins), all -inf, fp16/bf16/fp32 inputs, bad arguments; on CUDA also the Llama-3 vocabulary and a
CUDA-graph replay."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from csrc_triton.argmax import BLOCK, argmax, argmax_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_matches_torch(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(DEVICE, dtype)
    assert argmax(x).tolist() == argmax_ref(x).tolist()
    if n > 3:
        top = x.float().max().item()
        x[n // 3] = top + 1
        x[n - 1] = top + 1  # a later tie, in another block when n > BLOCK: the first index wins
        assert argmax(x).tolist() == [n // 3] == argmax_ref(x).tolist()
        x[n // 2] = float("nan")
        x[n - 2] = float("nan")
        assert argmax(x).tolist() == [n // 2] == argmax_ref(x).tolist()


def test_all_minus_infinity_and_out_buffer():
    x = torch.full((BLOCK + 9,), float("-inf"), device=DEVICE)
    out = torch.full((1,), -1, device=DEVICE, dtype=torch.int64)
    assert argmax(x, out=out).data_ptr() == out.data_ptr()
    assert out.tolist() == argmax_ref(x).tolist() == [0]


@pytest.mark.parametrize("bad", ["2d", "strided", "int", "empty"])
def test_bad_arguments_are_named(bad):
    x = {"2d": torch.zeros(2, 3, device=DEVICE), "strided": torch.zeros(10, device=DEVICE)[::2],
         "int": torch.zeros(4, dtype=torch.int32, device=DEVICE), "empty": torch.zeros(0, device=DEVICE)}[bad]
    with pytest.raises(ValueError, match="argmax"):
        argmax(x)


@pytest.mark.skipif(DEVICE != "cuda", reason="graphs need a GPU")
def test_vocabulary_and_graph():
    x = torch.randn(128256, device=DEVICE)
    out = torch.empty(1, device=DEVICE, dtype=torch.int64)
    argmax(x, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax(x, out=out)
    x[77777] = 100.0
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [77777] == argmax_ref(x).tolist()
