"""csrc_triton.w4a16_gemm (prefill) against the exact quantized product and PyTorch's error.

On CPU the fused kernel runs under TRITON_INTERPRET=1 at small odd shapes (M in {9, 17, 64, 128, 255},
groups 32/64/128, fp16/bf16, with and without bias, split-K) with the tiles the launcher picks; the
dequantized weights are checked bit for bit through one-hot rows of x. On CUDA the same cases run, plus
Llama-3-8B layer shapes for every M bucket's config (CONFIG_TABLE entries and rule_config) through both
paths, both nibble unpackings, and a split-K repeatability check.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _w4_check import LLAMA3_8B, assert_w4_close, make, poisoned  # noqa: E402

from csrc_triton import w4a16_gemm as gemm_mod  # noqa: E402
from csrc_triton._common import dequantize_ref  # noqa: E402
from csrc_triton.w4a16_gemm import (CONFIG_TABLE, Config, config_ok, fit_config, m_bucket, pick_config,  # noqa: E402
                                    rule_config, scratch, w4a16_gemm, w4a16_gemm_ref)
from csrc_triton.w4a16_gemm_wgmma import (SMEM_LIMIT, TILE_TABLE, Tile, fit_tile, groups, smem_bytes,  # noqa: E402
                                          tile_ok)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float16, torch.bfloat16]
# The interpreter turns tl.minimum of two scalars (a split's last K step) into a 1-element array that it
# then converts to an int for range(): NumPy >= 1.25 warns about that conversion. Harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def run(a: dict, **kw) -> torch.Tensor:
    out = poisoned(a["x"].shape[0], a["qweight"].shape[0], a["x"].dtype, DEVICE)
    y = w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"], out=out, **kw)
    assert y.data_ptr() == out.data_ptr()
    return y


# On the GPU three lengths suffice here (each case compiles a kernel; the real-shape tests below cover
# every M bucket's tiles); the interpreter runs all five.
@pytest.mark.parametrize("M", [9, 64, 255] if ON_GPU else [9, 17, 64, 128, 255])
@pytest.mark.parametrize("G,dtype,bias", [(32, torch.float16, False), (64, torch.bfloat16, True),
                                          (128, torch.float16, True), (128, torch.bfloat16, False)])
def test_prompt_lengths(M, G, dtype, bias):
    """Short prompts through the default (launcher-picked) tiles; N = 123 and K = 384 leave partial tiles."""
    a = make(M, 123, 384, G, dtype, seed=M * 1000 + G, bias=bias, device=DEVICE)
    assert_w4_close(run(a), a)


# The dequantization forms: the interpreter runs the plain ops (0); the GPU its default (1, PTX lop3) and the 16-bit
# pairs (2), both of which must give the reference's bits.
UNPACKS = [None, 2] if ON_GPU else [None]


@pytest.mark.parametrize("unpack", UNPACKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [32, 64, 128])
def test_dequantized_weights_bit_exact(G, dtype, unpack):
    """One-hot rows of x make y a column of W: the kernel's in-register w = f * 2^11 s + (b - 2^11 s) (or the pair
    form's (q - z) s + d) must equal the reference's fp32 q * s + b rounded to x's dtype, for every k of the
    permuted K order."""
    K = 256
    a = make(1, 72, K, G, dtype, seed=G, device=DEVICE)
    x = torch.eye(K, dtype=dtype, device=DEVICE)
    y = w4a16_gemm(x, a["qweight"], a["scales"], a["zeros"], config=Config(64, 64, 16, 2, 4, 2), unpack=unpack)
    w32 = dequantize_ref(a["qweight"], a["scales"], a["zeros"])  # (N, K) fp32, exact
    if dtype == torch.bfloat16 and not ON_GPU:
        # Triton 3.6's interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even).
        w32 = (w32.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert torch.equal(y, w32.to(dtype).T)


@pytest.mark.parametrize("unpack", UNPACKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_bits_exact(dtype, unpack):
    """The in-register dequantization is exact for subnormal (fp16), tiny, large, negative and zero scales. (bf16
    subnormals are left out: the interpreter's bf16 casts flush them.)"""
    K, G = 256, 64
    a = make(1, 16, K, G, dtype, seed=3, device=DEVICE)
    tiny = 2.0 ** -20 if dtype == torch.float16 else 2.0 ** -120  # fp16: subnormal
    special = torch.tensor([tiny, 2.0 ** -14, 4000.0 if dtype == torch.float16 else 1e30, -0.5, 0.0, 1.0,
                            -tiny, 0.001], dtype=dtype)
    a["scales"] = special.repeat(8)[: 16 * (K // G)].view(16, K // G).contiguous().to(DEVICE)
    a["zeros"] = -(torch.arange(16 * (K // G)) % 16).view(16, K // G).float().to(DEVICE) * a["scales"].float()
    x = torch.eye(K, dtype=dtype, device=DEVICE)
    y = w4a16_gemm(x, a["qweight"], a["scales"], a["zeros"], config=Config(64, 64, 8, 1, 4, 2), unpack=unpack)
    w32 = dequantize_ref(a["qweight"], a["scales"], a["zeros"])
    if dtype == torch.bfloat16 and not ON_GPU:
        w32 = (w32.view(torch.int32) & ~0xFFFF).view(torch.float32)  # the interpreter's truncating cast (above)
    assert torch.equal(y, w32.to(dtype).T)


@pytest.mark.parametrize("unpack", UNPACKS)
@pytest.mark.parametrize("G", [32, 128])
@pytest.mark.parametrize("zeros", ["fp16", "any"])
def test_fp16_zero_points_bit_exact_others_bounded(zeros, G, unpack):
    """llm-awq v2's zero points are fp16 values, not exact multiples of s (the formats we build have b = -z s): the
    dequantized weights must still be the reference's bits. Any other fp32 zero point (no format we build or import)
    may be off by <= 2^-12 |s| before the rounding to fp16 (module docstring)."""
    K = 256
    a = make(1, 40, K, G, torch.float16, seed=G + len(zeros), device=DEVICE)
    s = a["scales"].float()
    if zeros == "fp16":
        a["zeros"] = a["zeros"].half().float()
        assert not torch.equal(a["zeros"] / s, torch.round(a["zeros"] / s))  # not integer zero points
    else:
        a["zeros"] = a["zeros"] + torch.rand(s.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) * s * 0.4
    x = torch.eye(K, dtype=torch.float16, device=DEVICE)
    y = w4a16_gemm(x, a["qweight"], a["scales"], a["zeros"], config=Config(64, 64, 8, 1, 4, 2),
                   unpack=unpack).float().T
    w32 = dequantize_ref(a["qweight"], a["scales"], a["zeros"])
    if zeros == "fp16":
        assert torch.equal(y, w32.half().float())
    else:
        bound = 2.0 ** -12 * s.abs().repeat_interleave(G, 1) + 2.0 ** -11 * w32.abs() + 2.0 ** -24
        assert ((y - w32).abs() <= bound).all()


@pytest.mark.parametrize("split", [2, 3, 4])
def test_split_k(split):
    """Split-K partials summed by the last split; 5 K steps over 4 splits leaves one split empty. Two calls:
    the tile counters must be back at zero after the first."""
    a = make(20, 130, 320, 64, torch.float16, seed=split, bias=True, device=DEVICE)
    cfg = Config(32, 64, 8, split, 4, 2)
    y1 = run(a, config=cfg)
    assert_w4_close(y1, a)
    assert torch.equal(run(a, config=cfg), y1)


def test_matches_reference():
    """Both round w to x's dtype and accumulate in fp32: equal up to summation order."""
    a = make(33, 64, 256, 64, torch.float16, seed=7, bias=True, device=DEVICE)
    y, ref = run(a), w4a16_gemm_ref(**a)
    torch.testing.assert_close(y, ref, rtol=2e-3, atol=1e-3 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_path_reuses_workspace(dtype):
    """The long-prompt path (dequantize into a cached workspace, then a dense matmul), forced at small
    shapes: a second, smaller weight reuses the first one's buffer."""
    a = make(37, 75, 256, 64, dtype, seed=11, bias=True, device=DEVICE)
    assert_w4_close(run(a, path="dequant"), a)
    ptr = scratch("w4_dequant", 75 * 256, dtype, torch.device(DEVICE)).data_ptr()
    b = make(37, 40, 128, 32, dtype, seed=12, device=DEVICE)
    assert_w4_close(run(b, path="dequant"), b)
    assert scratch("w4_dequant", 40 * 128, dtype, torch.device(DEVICE)).data_ptr() == ptr


def test_k_not_multiple_of_64_takes_dequant_path():
    """K = 96 (G = 32) has no 64-wide K step: the default path dequantizes; forcing the fused kernel is an error."""
    a = make(12, 24, 96, 32, torch.float16, seed=3, device=DEVICE)
    assert_w4_close(run(a), a)
    with pytest.raises(ValueError, match="K % 64"):
        run(a, path="fused")


def test_config_choice():
    """Buckets, the rule's validity, and fitting a config to K and G."""
    assert [m_bucket(m) for m in (9, 16, 17, 255, 256, 257)] == [16, 16, 32, 256, 256, 512]
    for M in (9, 40, 100, 200, 300):
        for K, N in LLAMA3_8B:
            cfg = rule_config(M, N, K)
            assert config_ok(cfg), cfg
            assert cfg.split_k == 1 or (K // (8 * cfg.block_w)) // cfg.split_k >= 4
    assert fit_config(Config(64, 128, 16, 4, 8, 3), K=576, G=64) == Config(64, 128, 8, 4, 8, 3)
    assert fit_config(Config(64, 128, 16, 64, 8, 3), K=256, G=128).split_k == 2  # at most the K steps
    assert not config_ok(Config(128, 64, 16, 1, 4, 3))  # spills (ptxas, sm_90)
    assert not config_ok(Config(64, 128, 16, 1, 4, 3))  # 128 rows need two warpgroups


def test_wgmma_tiles_and_dispatch():
    """The Gluon kernel's tile rules (w4a16_gemm_wgmma; its numerics: test_w4a16_gemm_wgmma.py on Hopper): fitting to
    K and G, the scales' shared-memory block, the table's tiles valid and within shared memory at group 128, and the
    default dispatch taking it only where it can run."""
    assert fit_tile(Tile(64, 64, 16, 3, 6, 4), K=4096, G=64) == Tile(64, 64, 8, 3, 6, 4)  # BK <= G
    assert fit_tile(Tile(64, 64, 16, 3, 6, 4), K=384, G=128).split_k == 3  # 3 K steps: 3 splits of one
    assert fit_tile(Tile(64, 64, 16, 4, 6, 4), K=640, G=128).split_k == 3  # 5 steps: 2 + 2 + 1, no empty split
    assert groups(Tile(64, 64, 16, 2, 6, 4), K=4096, G=128) == 16
    assert groups(Tile(64, 64, 8, 3, 6, 4), K=4096, G=128) == 16  # 22 steps of 64 -> 11 groups + a straddled one
    assert not tile_ok(Tile(64, 128, 16, 1, 4, 8)._replace(block_n=192)) and not tile_ok(Tile(48, 64, 16, 1, 4, 4))
    assert tile_ok(Tile(128, 128, 8, 1, 3, 8, True)) and not tile_ok(Tile(128, 128, 8, 1, 3, 8))  # 128 rows: smem_a
    assert not tile_ok(Tile(64, 256, 16, 1, 4, 16))  # four warpgroups: measured slower, not offered
    assert tile_ok(Tile(64, 128, 16, 1, 4, 8, ws=True)) and not tile_ok(Tile(64, 64, 16, 1, 4, 4, ws=True))  # ws: 8
    assert tile_ok(Tile(128, 128, 8, 1, 4, 8, ws=True)) and not tile_ok(Tile(128, 256, 8, 1, 4, 8, ws=True))
    assert not tile_ok(Tile(128, 256, 8, 1, 3, 8, True)) and not tile_ok(Tile(256, 64, 8, 1, 3, 4, True))  # spill
    for (_, _, K), tile in TILE_TABLE.items():
        assert tile_ok(tile) and smem_bytes(fit_tile(tile, K, 128), K, 128) <= SMEM_LIMIT, tile
    a = make(48, 64, 256, 128, torch.float16, seed=1, device=DEVICE)
    assert not gemm_mod.wgmma_wins(a["x"], a["qweight"], 128) or gemm_mod._wgmma.available(a["x"].device)
    if not ON_GPU:
        with pytest.raises(ValueError, match="sm_90"):
            w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"], path="wgmma")


GLUON_COMPILES = [
    (13, 256, 4096, 64, torch.float16, Tile(16, 64, 16, 4, 6, 4)),  # one warpgroup, one m64 block; bias
    (48, 512, 1024, 128, torch.bfloat16, Tile(64, 128, 16, 2, 4, 4)),  # bf16's dequantization; two m64 blocks
    (64, 512, 2048, 32, torch.float16, Tile(64, 256, 16, 1, 4, 8)),  # two warpgroups; BLOCK_W fitted to G
    (40, 384, 1024, 128, torch.float16, Tile(64, 128, 16, 2, 3, 8, smem_a=True)),  # A through shared memory, async
    (300, 256, 1024, 128, torch.float16, Tile(128, 128, 8, 2, 3, 8, smem_a=True)),  # a long prompt's 128-row tile
    (40, 512, 1024, 64, torch.bfloat16, Tile(64, 128, 16, 2, 4, 8, ws=True)),  # warp-specialised, one block each
    (48, 512, 2048, 128, torch.float16, Tile(32, 256, 16, 1, 4, 8, ws=True)),  # warp-specialised, two blocks each
    (300, 256, 1024, 128, torch.float16, Tile(128, 128, 8, 2, 4, 8, ws=True)),  # warp-specialised, 128 rows
]


@pytest.fixture(scope="module")
def gluon_compiles() -> list[dict]:
    """GLUON_COMPILES compiled for sm_90a in one child process (tests/kernels/_gluon_compile.py says why)."""
    import json
    import subprocess
    import sys

    cases = [[M, N, K, G, str(dtype).removeprefix("torch."), list(fit_tile(t, K, G))]
             for M, N, K, G, dtype, t in GLUON_COMPILES]
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(here))] + env.get("PYTHONPATH", "").split(
        os.pathsep)).rstrip(os.pathsep)  # the repository root, for csrc_triton without an install
    r = subprocess.run([sys.executable, "-m", "_gluon_compile", json.dumps(cases)], capture_output=True, text=True,
                       env=env, cwd=here, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


@pytest.mark.parametrize("case", range(len(GLUON_COMPILES)))
def test_the_gluon_kernel_compiles_for_sm90_with_the_planned_shared_memory(gluon_compiles, case):
    """Gluon has no interpreter form, but its compiler runs anywhere: compile the kernel for sm_90a (Triton's own
    ptxas, a stand-in driver) as WgmmaLaunch would launch it, so a kernel that no longer compiles fails on CPU too,
    and check its shared memory is what the launcher budgets (smem_bytes against SMEM_LIMIT)."""
    M, N, K, G, dtype, tile = GLUON_COMPILES[case]
    tile = fit_tile(tile, K, G)
    got = gluon_compiles[case]
    planned = smem_bytes(tile, K, G)
    assert planned <= SMEM_LIMIT and (planned - 24 <= got["shared"] <= planned if tile.ws else got["shared"] == planned)
    blocks, k16 = tile.block_n // (16 * tile.num_warps), 8 * tile.block_w // 16  # m64 blocks a warpgroup, k16 a step
    assert got["wgmma"] == blocks * k16 * (2 if tile.ws else 1)  # ws: each consumer warpgroup's own wgmmas


def test_bad_inputs_are_clear_errors():
    a = make(4, 16, 128, 128, torch.float16, seed=0, device=DEVICE)
    with pytest.raises(ValueError, match="x must be a 2-D float16/bfloat16"):
        w4a16_gemm(a["x"].float(), a["qweight"], a["scales"], a["zeros"])
    with pytest.raises(ValueError, match="bias must be"):
        w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"], torch.zeros(15, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        w4a16_gemm(a["x"].repeat(1, 2)[:, ::2], a["qweight"], a["scales"], a["zeros"])
    with pytest.raises(ValueError, match="path must be"):
        w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"], path="cublas")
    with pytest.raises(ValueError, match="unpack must be"):
        w4a16_gemm(a["x"], a["qweight"], a["scales"], a["zeros"], unpack=3)


# -- GPU: real shapes -------------------------------------------------------------------------------------
def _bucket_configs() -> list[tuple[int, int, int, Config]]:
    """(M, N, K, config) for every Llama-3-8B shape and M bucket the fused path serves, from CONFIG_TABLE
    or the rule, plus every table entry for other shapes; M sits inside the bucket, not on its edge."""
    cases = {}
    for bucket in (16, 32, 64, 128, 256, 512, 1024):
        if bucket // 2 + 1 >= gemm_mod.DEQUANT_MIN_M:
            break
        for K, N in LLAMA3_8B:
            cfg = CONFIG_TABLE.get((bucket, N, K)) or rule_config(bucket, N, K)
            cases[(bucket, N, K)] = cfg
    cases.update(CONFIG_TABLE)
    return [(max(9, b * 3 // 4 + 1), N, K, cfg) for (b, N, K), cfg in sorted(cases.items())]


@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("M,N,K,cfg", _bucket_configs(), ids=lambda v: v.name if isinstance(v, Config) else str(v))
def test_table_configs_at_real_shapes(M, N, K, cfg):
    a = make(M, N, K, 128, torch.float16, seed=K + N + M, device=DEVICE)
    assert_w4_close(run(a, config=cfg), a)


@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,path", [(200, None), (2048, None), (300, "dequant"), (2048, "fused")])
@pytest.mark.parametrize("K,N", LLAMA3_8B)
def test_llama3_8b_default_dispatch(K, N, M, path, dtype):
    if dtype == torch.bfloat16 and (K, N) != LLAMA3_8B[0]:
        pytest.skip("bf16 at one shape (the kernels are dtype-generic)")
    a = make(M, N, K, 128, dtype, seed=K + N + M, device=DEVICE)
    assert_w4_close(run(a, path=path), a)


@pytest.mark.gpu  # the PTX unpacking
@pytest.mark.parametrize("dtype", DTYPES)
def test_unpackings_agree(dtype):
    """Inline-PTX lop3, the 16-bit pairs and the plain ops produce the same weights, so the outputs are identical."""
    a = make(100, 520, 1536, 128, dtype, seed=5, bias=True, device=DEVICE)
    plain = run(a, unpack=0)
    assert torch.equal(plain, run(a, unpack=1))
    assert torch.equal(plain, run(a, unpack=2))


@pytest.mark.gpu  # split-K races only show on the GPU
def test_split_k_repeatable_on_gpu():
    """Many programs racing for the per-tile counters: every call must give the same bits (fixed sum order)."""
    a = make(24, 4096, 4096, 128, torch.float16, seed=9, device=DEVICE)
    cfg = Config(32, 64, 16, 8, 4, 4)
    first = run(a, config=cfg)
    assert_w4_close(first, a)
    for _ in range(20):
        assert torch.equal(run(a, config=cfg), first)


@pytest.mark.gpu  # compiles kernels
def test_warmup_then_pick_config():
    calls = gemm_mod.warmup([(256, 128)], 128, torch.float16, DEVICE, max_m=100)
    assert calls == 4  # buckets 16, 32, 64, 128
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    assert pick_config(100, 256, 128, torch.device(DEVICE)) == rule_config(100, 256, 128, n_sm)


def _sweep_configs(M: int, N: int, K: int) -> list[Config]:
    from scripts.benches.w4a16 import gemm_sweep_configs

    return gemm_sweep_configs(M, N, K)


def test_sweep_tiles_are_valid_and_correct():
    """The bench sweep's configs: the rule's pick first, all config_ok; under the interpreter each distinct
    tile shape they use (BLOCK_M, BLOCK_N, BLOCK_W) computes the right product at a small odd shape, split-K."""
    tiles = set()
    for M in (16, 32, 64, 128, 256, 512):
        for K, N in LLAMA3_8B:
            cfgs = _sweep_configs(M, N, K)
            assert cfgs[0] == rule_config(M, N, K) and all(config_ok(c) for c in cfgs) and len(cfgs) <= 72
            tiles |= {(c.block_m, c.block_n, c.block_w) for c in cfgs}
    assert len(tiles) == 24
    if ON_GPU:
        return  # the sweep itself checks each config against the dequant path before timing it
    a = make(40, 130, 256, 128, torch.float16, seed=4, bias=True, device=DEVICE)
    for bm, bn, bw in sorted(tiles):
        assert_w4_close(run(a, config=Config(bm, bn, bw, 2, 4, 2)), a)
