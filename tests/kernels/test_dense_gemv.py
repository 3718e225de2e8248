"""csrc_triton.dense_gemv (the decode lm_head) against its fp32 reference: M = 1..8, odd N and K (masked
tails), fp16/bf16, strided x, the `out` buffer, bad arguments; on CUDA also the Llama-3-8B vocabulary
shape against cuBLAS and a CUDA-graph replay."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from csrc_triton.dense_gemv import dense_gemv, dense_gemv_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEVICE, dtype)
    return x, w


def close(y, ref, dtype):
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2  # one rounding of an fp32-accumulated result
    torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 64, 256), (3, 77, 300), (8, 130, 512), (5, 200, 40)])
def test_matches_reference(M, N, K, dtype):
    x, w = make(M, N, K, dtype)
    for config in [(64, 256, 4, 2), (32, 64, 4, 2)]:  # K in one step or several, N tails of both sizes
        close(dense_gemv(x, w, config=config), dense_gemv_ref(x, w), dtype)


def test_strided_x_and_out_buffer():
    x, w = make(8, 96, 128, torch.float16, seed=1)
    xs = x[::2]  # row stride 2K
    out = torch.full((4, 96), float("nan"), device=DEVICE, dtype=torch.float16)
    y = dense_gemv(xs, w, out=out, config=(32, 64, 4, 2))
    assert y.data_ptr() == out.data_ptr()
    close(out, dense_gemv_ref(xs, w), torch.float16)


@pytest.mark.parametrize("bad", ["rows", "k", "dtype", "stride"])
def test_bad_arguments_are_named(bad):
    x, w = make(2, 32, 64, torch.float16)
    if bad == "rows":
        x = torch.zeros(9, 64, device=DEVICE, dtype=torch.float16)
    elif bad == "k":
        w = w[:, :32]
    elif bad == "dtype":
        w = w.float()
    else:
        w = w.t().contiguous().t()
    with pytest.raises(ValueError, match="dense_gemv"):
        dense_gemv(x, w)


@pytest.mark.gpu  # real shapes and CUDA graphs
@pytest.mark.parametrize("M", [1, 4])
def test_llama3_vocabulary_shape_and_graph(M):
    x, w = make(M, 128256, 4096, torch.float16, seed=2)
    ref = torch.nn.functional.linear(x, w)
    close(dense_gemv(x, w), ref, torch.float16)
    out = torch.empty_like(ref)
    dense_gemv(x, w, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dense_gemv(x, w, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    close(out, ref, torch.float16)
    assert torch.equal(out.argmax(-1), dense_gemv(x, w).argmax(-1))
