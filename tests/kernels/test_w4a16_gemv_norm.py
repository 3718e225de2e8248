"""csrc_triton.w4a16_gemv_norm (the residual add and the next RMSNorm's share in the W4 GEMV's epilogue) and the
normalising prologue of w4a16_gemv (prenorm) that consumes its partial sums.

On CPU under TRITON_INTERPRET=1 at small shapes with both kernels ("fma" G = 64, "mma" G = 128, split-K):
h = residual + y is PyTorch's add of the plain GEMV's output, xg = gamma * h exactly, the partial sums of h^2
cover exactly the N columns, and a producer -> consumer chain equals RMSNorm then the GEMV within the W4
tolerance; against w4a16_gemv_norm_ref too. On CUDA also Llama-3-8B's decode chains (o -> gate_up, down -> qkv).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _w4_check import assert_w4_close, make  # noqa: E402

from csrc_triton.w4a16_gemv import INTERPRET_CONFIG, INTERPRET_MMA_CONFIG, w4a16_gemv, w4a16_gemv_ref  # noqa: E402
from csrc_triton.w4a16_gemv_norm import w4a16_gemv_norm, w4a16_gemv_norm_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float16, torch.bfloat16]
FMA, MMA = INTERPRET_CONFIG, INTERPRET_MMA_CONFIG  # small pinned tiles (the GPU compiles them once too)
# The interpreter turns tl.minimum of two scalars (a split's last K range) into a 1-element array that it
# then converts to an int: NumPy >= 1.25 warns about that conversion. Harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _norm_inputs(M, N, dtype, seed, device=DEVICE):
    g = torch.Generator(device).manual_seed(seed)
    res = (torch.randn(M, N, generator=g, device=device) * 2).to(dtype)
    gamma = (1 + 0.3 * torch.randn(N, generator=g, device=device)).to(dtype)
    return res, gamma


NORM_CONFIGS = [("fma", 64, FMA), ("mma", 128, MMA), ("mma split", 128, {**MMA, "SPLIT_K": 2})]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("name,G,cfg", NORM_CONFIGS, ids=[c[0] for c in NORM_CONFIGS])
def test_norm_epilogue(name, G, cfg, M, dtype):
    """h = residual + y is PyTorch's add of the plain GEMV's rounded output (exact for fp16; bf16 within the
    interpreter's truncating cast of the plain store), xg = gamma * h exactly, and the partial sums of h^2
    cover exactly the N columns (N = 200 leaves a partial row block whose wrapped rows must not count)."""
    a = make(M, 200, 256, G, dtype, seed=M * 7 + G, device=DEVICE)
    res, gamma = _norm_inputs(M, 200, dtype, seed=M)
    h, xg, part = w4a16_gemv_norm(a["x"], a["qweight"], a["scales"], a["zeros"], None, res, gamma, config=cfg)
    y = w4a16_gemv(a["x"], a["qweight"], a["scales"], a["zeros"], config=cfg)
    h_ref = (res.float() + y.float()).to(dtype)
    if dtype == torch.float16 or ON_GPU:
        assert torch.equal(h, h_ref)
    else:
        torch.testing.assert_close(h.float(), h_ref.float(), rtol=0, atol=2 ** -6 * h_ref.abs().max().item())
    assert torch.equal(xg, (gamma.float() * h.float()).to(dtype))
    block_n = cfg.get("BLOCK_N", 16 * cfg["num_warps"])
    assert part.shape == (-(-200 // block_n), 8) and part.dtype == torch.float32
    torch.testing.assert_close(part.sum(0)[:M], h.float().pow(2).sum(-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("name,G,cfg", NORM_CONFIGS, ids=[c[0] for c in NORM_CONFIGS])
def test_prenorm_chain_equals_rms_norm_then_gemv(name, G, cfg, M, dtype):
    """A producer (w4a16_gemv_norm) then a consumer with prenorm: the consumer's output is the GEMV of
    RMSNorm(h) * gamma, within the W4 tolerance plus the roundings that move (x rounded as gamma * h instead
    of as norm(h) * gamma), and equals its own reference (w4a16_gemv_ref with the same partial sums)."""
    a = make(M, 256, 256, G, dtype, seed=M + G, device=DEVICE)
    b = make(M, 96, 256, G, dtype, seed=M + G + 1, bias=True, device=DEVICE)
    res, gamma = _norm_inputs(M, 256, dtype, seed=M + 100)
    h, xg, part = w4a16_gemv_norm(a["x"], a["qweight"], a["scales"], a["zeros"], None, res, gamma, config=cfg)
    eps = 1e-5
    y = w4a16_gemv(xg, b["qweight"], b["scales"], b["zeros"], b["bias"], config=cfg, prenorm=(part, eps))
    own = w4a16_gemv_ref(xg, b["qweight"], b["scales"], b["zeros"], b["bias"], prenorm=(part, eps))
    ulp = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    torch.testing.assert_close(y.float(), own.float(), rtol=0, atol=4 * ulp * own.abs().max().item())
    hf = h.float()
    normed = ((hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).float() * gamma.float()).to(dtype)
    assert_w4_close(y, {**b, "x": normed})


def test_prenorm_and_norm_reject_bad_arguments():
    a = make(2, 64, 256, 128, torch.float16, seed=5, device=DEVICE)
    args = (a["x"], a["qweight"], a["scales"], a["zeros"])
    res, gamma = _norm_inputs(2, 64, torch.float16, seed=1)
    with pytest.raises(ValueError, match="residual must be"):
        w4a16_gemv_norm(*args, None, res[:1], gamma)
    with pytest.raises(ValueError, match="gamma must be"):
        w4a16_gemv_norm(*args, None, res, gamma.float())
    with pytest.raises(ValueError, match="partial sums must be"):
        w4a16_gemv(*args, prenorm=(torch.zeros(4, 4, device=DEVICE), 1e-5))


@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("producer,consumer", [((4096, 4096), (4096, 28672)), ((14336, 4096), (4096, 6144))],
                         ids=["o->gate_up", "down->qkv"])
def test_llama3_8b_norm_chain(producer, consumer, M, dtype):
    """The decode chain at Llama-3-8B shapes with the launcher's configs (down runs split-K: its epilogue is
    the last-arriving program's): o -> gate_up and down -> next layer's qkv."""
    a = make(M, producer[1], producer[0], 128, dtype, seed=M + producer[0], device=DEVICE)
    b = make(M, consumer[1], consumer[0], 128, dtype, seed=M + consumer[1], device=DEVICE)
    res, gamma = _norm_inputs(M, producer[1], dtype, seed=M)
    h, xg, part = w4a16_gemv_norm(a["x"], a["qweight"], a["scales"], a["zeros"], None, res, gamma)
    y = w4a16_gemv(a["x"], a["qweight"], a["scales"], a["zeros"])
    assert torch.equal(h, (res.float() + y.float()).to(dtype))
    assert torch.equal(xg, (gamma.float() * h.float()).to(dtype))
    torch.testing.assert_close(part.sum(0)[:M], h.float().pow(2).sum(-1), rtol=1e-5, atol=0)
    out = w4a16_gemv(xg, b["qweight"], b["scales"], b["zeros"], prenorm=(part, 1e-5))
    hf = h.float()
    normed = ((hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float() * gamma.float()).to(dtype)
    assert_w4_close(out, {**b, "x": normed})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,G,cfg", NORM_CONFIGS, ids=[c[0] for c in NORM_CONFIGS])
def test_matches_reference_closely(name, G, cfg, dtype):
    """The kernel (no rounding of w) and w4a16_gemv_norm_ref (w rounded to the dtype, one row block of sums) differ
    by the GEMV's rounding only, carried through the add and the product, and into the rows' sums of h^2."""
    a = make(3, 200, 256, G, dtype, seed=G + 11, bias=True, device=DEVICE)
    res, gamma = _norm_inputs(3, 200, dtype, seed=5)
    args = (a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"], res, gamma)
    h, xg, part = w4a16_gemv_norm(*args, config=cfg)
    h_ref, xg_ref, part_ref = w4a16_gemv_norm_ref(*args)
    for got, want in ((h, h_ref), (xg, xg_ref)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-2 * want.abs().max().item())
    assert part_ref.shape == (1, 8)
    torch.testing.assert_close(part.sum(0)[:3], part_ref[0, :3], rtol=2e-2, atol=0)
