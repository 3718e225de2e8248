"""csrc_triton.w4a16_gemm_wgmma (Gluon, sm_90 only) against the exact quantized product and the reference's bits.

Gluon kernels have no interpreter form, so these tests run on a Hopper GPU only (the Triton kernel, tested
everywhere in test_w4a16_gemm.py, is what runs elsewhere; that file also compiles this one for sm_90a on any
machine). One-hot rows of x make y a column of W, so the
in-register dequantization must give the reference's bits for every k; other cases go through the launcher
(w4a16_gemm_wgmma, i.e. w4a16_gemm's "wgmma" path) at odd shapes, both dtypes, every group size, split-K and bias.
"""

import pytest
import torch
import triton

from _w4_check import assert_w4_close, make, poisoned

TRITON_36 = triton.__version__.startswith("3.6.")
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and TRITON_36
pytestmark = [pytest.mark.gpu(capability=(9, 0)),
              pytest.mark.skipif(not TRITON_36, reason="the Gluon W4 kernel is written for Triton 3.6")]

from csrc_triton._common import dequantize_ref  # noqa: E402
from csrc_triton.w4a16_gemm import w4a16_gemm  # noqa: E402
from csrc_triton.w4a16_gemm_wgmma import TILE_TABLE, Tile, w4a16_gemm_wgmma, w4a16_gemm_wgmma_ref  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16]
# One warpgroup with one or two m64 blocks, two warpgroups with one or two; 16-, 32- and 64-row tiles; the first
# three also with the weights through shared memory and one async wgmma in flight (smem_a).
TILES = [Tile(64, 64, 16, 2, 4, 4), Tile(64, 128, 16, 1, 3, 4), Tile(32, 128, 16, 3, 4, 8), Tile(16, 256, 16, 2, 6, 8)]
TILES += [t._replace(smem_a=True, stages=min(t.stages, 3)) for t in TILES[:3]]
# Long prompts' 128-row tiles (smem_a, one m64 block a warpgroup): one and two warpgroups, K steps of 64.
TILES += [Tile(128, 64, 8, 1, 4, 4, True), Tile(128, 128, 8, 2, 3, 8, True)]
# Warp-specialised: two consumer warpgroups (one m64 block each, or two; 128-row tiles with one) and a producer warp.
TILES += [Tile(64, 128, 16, 2, 4, 8, ws=True), Tile(32, 256, 16, 3, 4, 8, ws=True), Tile(128, 128, 8, 2, 4, 8, ws=True)]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [32, 64, 128])
def test_dequantized_weights_bit_exact(G, dtype, tile):
    K = 512
    a = make(1, 192, K, G, dtype, seed=G, device="cuda")
    w = dequantize_ref(a["qweight"], a["scales"], a["zeros"]).to(dtype)  # (N, K), exact then rounded once
    for m0 in range(0, K, 128):
        x = torch.eye(K, dtype=dtype, device="cuda")[m0:m0 + 128].contiguous()
        y = w4a16_gemm(x, a["qweight"], a["scales"], a["zeros"], path="wgmma", config=tile)
        assert torch.equal(y, w[:, m0:m0 + 128].T)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_bits_exact(dtype):
    """Subnormal (fp16), tiny, large, negative and zero scales: the pair form's (q - z) s + d is still the
    reference's q s + b."""
    K, G = 256, 64
    a = make(1, 64, K, G, dtype, seed=3, device="cuda")
    tiny = 2.0 ** -20 if dtype == torch.float16 else 2.0 ** -120
    special = torch.tensor([tiny, 2.0 ** -14, 4000.0 if dtype == torch.float16 else 1e30, -0.5, 0.0, 1.0, -tiny,
                            0.001], dtype=dtype)
    a["scales"] = special.repeat(32)[: 64 * (K // G)].view(64, K // G).contiguous().cuda()
    a["zeros"] = -(torch.arange(64 * (K // G)) % 16).view(64, K // G).float().cuda() * a["scales"].float()
    x = torch.eye(K, dtype=dtype, device="cuda")[:64].contiguous()
    y = w4a16_gemm(x, a["qweight"], a["scales"], a["zeros"], path="wgmma", config=TILES[0])
    assert torch.equal(y, dequantize_ref(a["qweight"], a["scales"], a["zeros"]).to(dtype)[:, :64].T)


def test_fp16_zero_points_bit_exact():
    """llm-awq v2's fp16 zero points (not multiples of s) still give the reference's bits."""
    K = 256
    a = make(1, 64, K, 128, torch.float16, seed=5, device="cuda")
    a["zeros"] = a["zeros"].half().float()
    x = torch.eye(K, dtype=torch.float16, device="cuda")[:64].contiguous()
    y = w4a16_gemm(x, a["qweight"], a["scales"], a["zeros"], path="wgmma", config=TILES[1])
    assert torch.equal(y, dequantize_ref(a["qweight"], a["scales"], a["zeros"]).half()[:, :64].T)


@pytest.mark.parametrize("M,N,K,G,dtype,bias,tile", [
    (9, 123, 384, 128, torch.float16, True, TILES[0]),   # partial tiles in M and N
    (100, 200, 1024, 64, torch.bfloat16, True, TILES[2]),  # several row tiles, 3 splits
    (64, 6144, 4096, 128, torch.bfloat16, False, TILES[1]),
    (33, 4096, 14336, 128, torch.float16, True, TILES[3]),
    (9, 123, 384, 32, torch.bfloat16, True, TILES[4]),  # smem_a: partial tiles, 2 splits of 6 K steps of 32
    (100, 200, 1024, 64, torch.float16, False, TILES[6]),  # smem_a, two warpgroups, 3 splits
    (300, 320, 1024, 128, torch.bfloat16, True, TILES[7]),  # 128-row tiles: three, the last partial
    (257, 4096, 4096, 64, torch.float16, False, TILES[8]),  # 128-row tiles, two warpgroups, 2 splits
    (40, 1000, 2048, 64, torch.float16, True, TILES[9]),  # ws: partial tiles, 2 splits (a counter per consumer)
    (100, 520, 4096, 128, torch.bfloat16, False, TILES[10]),  # ws, two m64 blocks a consumer, 3 splits, 4 row tiles
    (300, 320, 1024, 128, torch.bfloat16, True, TILES[11]),  # ws at 128 rows (long prompts): three row tiles
    (48, 4096, 4096, 128, torch.float16, False, None),  # the launcher's tile
])
def test_matches_exact_product(M, N, K, G, dtype, bias, tile):
    a = make(M, N, K, G, dtype, seed=M, bias=bias, device="cuda")
    out = poisoned(M, N, dtype, "cuda")
    y = w4a16_gemm_wgmma(a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"], out=out, tile=tile)
    assert y.data_ptr() == out.data_ptr()
    assert_w4_close(y, a)
    ref = w4a16_gemm_wgmma_ref(**a)  # the same rounded weights, fp32 sums: equal up to summation order, which can
    # move the final rounding by one unit of the dtype (bf16: 2^-7 relative, so rtol 2e-3 failed at 64 x 6144)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, ref, rtol=2 * eps, atol=eps * ref.float().abs().max().item())
    again = w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"], path="wgmma", config=tile)
    assert torch.equal(again, y)  # split-K sums in split order; the tile counters were reset


@pytest.mark.parametrize("tile", TILES[9:11], ids=lambda t: t.name)  # (128 rows need ws or smem_a)
def test_warp_specialised_tiles_equal_the_one_partition_kernel(tile):
    """The ws form runs the same dequantization, wgmma and split order on each half of the tile: the same bits."""
    a = make(48, 1536, 4096, 128, torch.float16, seed=9, bias=True, device="cuda")
    args = (a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"])
    y = w4a16_gemm(*args, path="wgmma", config=tile)
    assert torch.equal(y, w4a16_gemm(*args, path="wgmma", config=tile._replace(ws=False)))
    assert torch.equal(y, w4a16_gemm(*args, path="wgmma", config=tile))  # the counters were reset


def test_long_prompts_take_the_table_over_dequant(monkeypatch):
    """A TILE_TABLE entry at a long prompt's bucket (M >= DEQUANT_MIN_M, where the dispatch otherwise dequantizes
    and calls cuBLAS) runs the Gluon kernel; wgmma=False keeps the dequant path. Both give the product."""
    import csrc_triton.w4a16_gemm as gemm_mod

    a = make(300, 256, 1024, 128, torch.float16, seed=11, device="cuda")
    monkeypatch.setitem(TILE_TABLE, (512, 256, 1024), TILES[8])
    built = []
    real = gemm_mod._wgmma_plan
    monkeypatch.setattr(gemm_mod, "_wgmma_plan", lambda *args: built.append(args[4]) or real(*args))
    assert_w4_close(w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"], wgmma=False), a)
    assert built == []
    assert_w4_close(w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"]), a)
    assert built == [None]  # the table's tile, not a forced one


def test_table_tiles_are_valid():
    for (bucket, N, K), tile in TILE_TABLE.items():
        assert tile.block_m >= min(bucket, 64), (bucket, N, K, tile)
        a = make(bucket, N, K, 128, torch.float16, seed=N, device="cuda")
        assert_w4_close(w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"], path="wgmma", config=tile), a)
