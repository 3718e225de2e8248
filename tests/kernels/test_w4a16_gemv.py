"""csrc_triton.w4a16_gemv (decode, M <= 8) against the exact quantized product and PyTorch's error.

On CPU both kernels run under TRITON_INTERPRET=1 at small odd shapes: "fma" (M in {1, 3, 8}, groups
32/64/128, fp16/bf16, bias, partial tiles, split-K) and "mma" (G = 128: row counts that are not a multiple
of the row tile, split-K ranges of unequal length, 1-8 groups per K step, 1-2 row tiles per warp), the
`kernel` choice; the PTX unpacking blocks are checked bit for bit by a small emulator. On CUDA the same cases
run with both nibble unpackings (plain shifts, and the PTX that is the GPU default), plus Llama-3-8B layer
shapes (M = 1, 2, 8, fp16/bf16) with the launcher's own configs (gemv_config), a few configs of the bench
sweep at one real shape, split-K determinism and CUDA-graph replay. The fused epilogues have their own files:
test_w4a16_gemv_norm.py, test_w4a16_gemv_silu.py, test_w4a16_gemv_rope.py.
"""

import os
import re
import struct

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _w4_check import LLAMA3_8B, assert_w4_close, make, poisoned  # noqa: E402

from csrc_triton import _w4a16_gemv_operands as operands  # noqa: E402
from csrc_triton.w4a16_gemv import (INTERPRET_CONFIG, INTERPRET_MMA_CONFIG, gemv_config,  # noqa: E402
                                    groups_per_step, w4a16_gemv, w4a16_gemv_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float16, torch.bfloat16]
FMA, MMA = INTERPRET_CONFIG, INTERPRET_MMA_CONFIG  # small pinned tiles (the GPU compiles them once too)
# Nibble unpacking: 0 = plain shifts (the interpreter's), 1 = the PTX blocks (the GPU default); both on the GPU.
UNPACKS = [0, 1] if ON_GPU else [0]
# The interpreter turns tl.minimum of two scalars (a split's last K range) into a 1-element array that it
# then converts to an int: NumPy >= 1.25 warns about that conversion. Harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def run(a: dict, **kw) -> torch.Tensor:
    out = poisoned(a["x"].shape[0], a["qweight"].shape[0], a["x"].dtype, DEVICE)
    y = w4a16_gemv(a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"], out=out, **kw)
    assert y.data_ptr() == out.data_ptr()
    return y


@pytest.mark.parametrize("unpack", UNPACKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_fma_small(M, G, dtype, unpack):
    """N = 37 leaves a partial row block; K = 384 is 3 tiles of the pinned 16-word tile."""
    a = make(M, 37, 384, G, dtype, seed=M * 1000 + G, device=DEVICE)
    assert_w4_close(run(a, config=FMA, unpack=unpack), a)


@pytest.mark.parametrize("unpack", UNPACKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,split", [(1, 1), (1, 3), (3, 2), (8, 1), (5, 4)])
def test_mma_small(M, split, dtype, unpack):
    """N = 100: a partial row tile (rows wrap, the store drops them); K = 640: 5 groups, so splits of 3 and 4
    get ranges of 2, 2, 1 and 2, 2, 1 (the last program may see a shorter range); bias on."""
    a = make(M, 100, 640, 128, dtype, seed=M * 100 + split, bias=True, device=DEVICE)
    assert_w4_close(run(a, config={**MMA, "SPLIT_K": split}, unpack=unpack), a)


@pytest.mark.parametrize("unpack", UNPACKS)
@pytest.mark.parametrize("M,N,K,gps,split,warps,block_n,dtype", [
    (1, 100, 1024, 8, 1, 1, 16, torch.float16),  # 8 groups in one step: B is fully block-diagonal
    (1, 70, 1024, 4, 2, 1, 32, torch.bfloat16),  # two 16-row tiles per warp; 2 steps per split
    (2, 50, 768, 8, 1, 2, 32, torch.float16),  # GPS capped to 8 / BM = 4, then to 2 (6 groups)
    (3, 40, 1024, 2, 3, 1, 16, torch.bfloat16),  # splits of 3, 3, 2 groups -> of 4, 4 (whole steps)
    (8, 33, 512, 8, 2, 1, 16, torch.float16),  # BM = 8: one group per step, B = x^T
    (1, 16, 1792, 8, 8, 1, 16, torch.float16),  # 14 groups: GPS 2, ranges of 2 groups
    (3, 70, 1024, 2, 2, 1, 16, torch.bfloat16),  # BM = 4: two groups of 4 columns; split-K partials
    (2, 50, 768, 8, 3, 1, 16, torch.bfloat16),  # GPS capped to 2, BM = 2, unequal split ranges
])
def test_mma_groups_per_step(M, N, K, gps, split, warps, block_n, dtype, unpack):
    """GPS groups per K step at every M bucket: GPS dots against the step's x, each keeping its group's
    columns, plus that step's x-only terms in the same columns (columns past GPS BM must add nothing)."""
    a = make(M, N, K, 128, dtype, seed=N + K + gps, bias=True, device=DEVICE)
    cfg = {"kernel": "mma", "BLOCK_N": block_n, "num_warps": warps, "STAGES": 1, "SPLIT_K": split, "GPS": gps}
    assert_w4_close(run(a, config=cfg, unpack=unpack), a)


def test_groups_per_step():
    assert [groups_per_step(8, n) for n in (32, 112, 38, 5)] == [8, 8, 2, 1]
    assert groups_per_step(6, 32) == 4  # rounded down to a power of two


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,G,split", [(1, 217, 576, 64, 1), (5, 40, 640, 128, 3), (2, 9, 32, 32, 1),
                                           (4, 37, 576, 64, 4)])
@pytest.mark.parametrize("unpack", UNPACKS)
def test_fma_odd_shapes_with_bias(M, N, K, G, split, dtype, unpack):
    """K = 576 (SmolLM2) is 72 words: a partial last tile and splits of 32, 32, 8 words; K = 640 in three
    splits: 32, 32, 16 words; N = 9 is below one row block; Qwen2-style bias."""
    a = make(M, N, K, G, dtype, seed=N + K, bias=True, device=DEVICE)
    assert_w4_close(run(a, config={**FMA, "SPLIT_K": split}, unpack=unpack), a)


@pytest.mark.parametrize("cfg", [FMA, MMA], ids=["fma", "mma"])
def test_matches_reference_closely(cfg):
    """The kernels (no rounding of w) and `_ref` (w rounded to fp16) differ by rounding only."""
    a = make(4, 64, 256, 128, torch.float16, seed=7, bias=True, device=DEVICE)
    y, ref = run(a, config=cfg), w4a16_gemv_ref(**a)
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=2e-3 * ref.abs().max().item())


def test_default_config_picks_the_mma_kernel_for_groups_of_128():
    assert gemv_config(1, 4096, 4096, 128)["kernel"] == "mma"
    assert gemv_config(1, 4096, 4096, 64)["kernel"] == "fma"
    assert gemv_config(1, 576, 576, 128)["kernel"] == "fma"  # K not a multiple of 128


def test_kernel_argument_picks_the_form():
    """kernel="fma" keeps a shape the table or the rule gives the mma kernel on the fma kernel; "mma" takes the
    tensor cores where mma_ok allows and falls back to fma elsewhere; "auto" is the table's choice."""
    table = gemv_config(1, 4096, 4096, 128)
    assert gemv_config(1, 4096, 4096, 128, kernel="auto") == gemv_config(1, 4096, 4096, 128, kernel="mma") == table
    for shape in ((1, 4096, 4096), (1, 1000, 2048), (3, 300, 256)):  # in the table, the mma rule, the rule at M 3
        assert gemv_config(*shape, 128, kernel="fma")["kernel"] == "fma"
        assert gemv_config(*shape, 128, kernel="mma")["kernel"] == "mma"
    assert gemv_config(1, 4096, 4096, 64, kernel="mma")["kernel"] == "fma"  # no mma form for groups of 64
    with pytest.raises(ValueError, match="kernel must be one of"):
        gemv_config(1, 4096, 4096, 128, kernel="tensor")


@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_kernel_argument_reaches_the_launch(kernel):
    """Without a pinned config the launcher runs the form `kernel` asks for (the interpreter's tiles on CPU): both
    give the W4 product, and the fma one equals a call pinned to the fma config."""
    a = make(2, 64, 256, 128, torch.float16, seed=13, bias=True, device=DEVICE)
    y = run(a, kernel=kernel)
    assert_w4_close(y, a)
    if kernel == "fma" and not ON_GPU:
        assert torch.equal(y, run(a, config=FMA))
    with pytest.raises(ValueError, match="kernel must be one of"):
        run(a, kernel="tensor")


# -- the PTX unpacking, emulated -----------------------------------------------------------------------------
def _f16(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits))[0]


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def _emulate(asm: str, word: int) -> dict[int, int]:
    """Runs one of _magic_asm's PTX blocks on an unsigned 32-bit word: {output index: 16-bit pattern or
    fp32 value}. Knows exactly the instructions the blocks use; anything else fails the test. The "pairs"
    blocks (word in $4) write 32-bit $0..$3, which magic_planes splits with _word_halves: the low half is
    output i, the high half output i + 4."""
    pairs = "$8" not in asm
    regs, out = {"$4" if pairs else "$8": word}, {}
    for line in asm.strip("{}\n").splitlines():
        if line.startswith(".reg"):
            continue
        if m := re.fullmatch(r"shr\.u32 (\w+), (\$?\w+), (\d+);", line):
            regs[m[1]] = regs[m[2]] >> int(m[3])
        elif m := re.fullmatch(r"lop3\.b32 (\$?\w+), (\$?\w+), (0x[0-9a-f]+), (0x[0-9a-f]+), (0x[0-9A-F]+);", line):
            a, b, c, lut = regs[m[2]], int(m[3], 16), int(m[4], 16), int(m[5], 16)
            regs[m[1]] = sum(((lut >> (((a >> i & 1) << 2) | ((b >> i & 1) << 1) | (c >> i & 1))) & 1) << i
                             for i in range(32))
            if pairs and m[1].startswith("$"):
                i = int(m[1][1:])
                assert i < 4, f"pairs block writes ${i}"
                out[i], out[i + 4] = regs[m[1]] & 0xFFFF, regs[m[1]] >> 16
        elif m := re.fullmatch(r"mov\.b32 \{(\$?\w+), (\$?\w+)\}, (\w+);", line):
            lo, hi = regs[m[3]] & 0xFFFF, regs[m[3]] >> 16
            regs[m[1]], regs[m[2]] = lo, hi
            for name, v in ((m[1], lo), (m[2], hi)):
                if name.startswith("$"):
                    out[int(name[1:])] = v
        elif m := re.fullmatch(r"cvt\.f32\.f16 \$(\d), (\w+);", line):
            out[int(m[1])] = _f16(regs[m[2]])
        else:
            raise AssertionError(f"unknown PTX line {line!r}")
    return out


@pytest.mark.parametrize("which", ["f32", "f16", "bf16"])
def test_magic_asm_bits(which):
    """Each PTX block turns nibble i of a word into exactly v_i = m_i + q_i u, as the interpreter path does."""
    asm = {"f32": operands.MAGIC_F32, "f16": operands.MAGIC_F16, "bf16": operands.MAGIC_BF16}[which].value
    u, m_odd = (0.125, 16.0) if which == "bf16" else (1 / 64, 1.0)
    gen = torch.Generator().manual_seed(0)
    words = [0, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98] + torch.randint(0, 2**32, (60,), generator=gen).tolist()
    for w in words:
        got = _emulate(asm, w)
        assert sorted(got) == list(range(8))
        for i in range(8):
            want = (16.0 if i % 2 == 0 else m_odd) + ((w >> 4 * i) & 0xF) * u
            value = got[i] if which == "f32" else (_bf16(got[i]) if which == "bf16" else _f16(got[i]))
            assert value == want, f"{which} word {w:#010x} nibble {i}: {value} != {want}"


# -- GPU: real shapes, the sweep's configs, split-K determinism, CUDA graphs ------------------------------------
@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 8])
@pytest.mark.parametrize("K,N", LLAMA3_8B)
def test_llama3_8b_shapes(K, N, M, dtype):
    """The launcher's own config (gemv_config: the table the sweep chose) at every Llama-3-8B shape."""
    a = make(M, N, K, 128, dtype, seed=K + N + M, device=DEVICE)
    assert_w4_close(run(a), a)


def _bench_module():
    from scripts.benches import w4a16

    return w4a16


def _sweep_configs() -> list[dict]:
    return _bench_module().gemv_sweep_configs(4096, 4096)


def test_sweep_tiles_from_the_flag():
    """--w4-sweep-tiles: 4-5 numbers per tile; the register cap reaches the configs, and the table's own
    config (the same tile at split 1) is timed once."""
    bench = _bench_module()
    tiles = bench.gemv_sweep_tiles("4,64,8,3;4,64,8,3,168;8,128,2,3,0")
    cfgs = bench.gemv_sweep_configs(28672, 4096, tiles=tiles)
    names = [bench.gemv_config_name(c) for c in cfgs]
    # 448 row blocks of 64 rows: k4 would be > 8 programs per SM; 224 blocks of 128 rows: k8 would
    assert names == ["mma w4 n64 g8 s3 k1", "mma w4 n64 g8 s3 k2",
                     "mma w4 n64 g8 s3 k1 r168", "mma w4 n64 g8 s3 k2 r168",
                     "mma w8 n128 g2 s3 k1", "mma w8 n128 g2 s3 k2", "mma w8 n128 g2 s3 k4"]
    assert cfgs[0] == gemv_config(1, 28672, 4096, 128)
    assert cfgs[2] == {"kernel": "mma", "BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "SPLIT_K": 1, "GPS": 8,
                       "maxnreg": 168}
    for bad in ("4,128,4,3,1", "4,128,4,3,1,0", "4,128,4"):  # the removed 5-9 number form (chains, ...); too few
        with pytest.raises(ValueError, match="warps,rows"):
            bench.gemv_sweep_tiles(bad)


@pytest.mark.gpu  # compiles each config it checks
def test_sweep_configs():
    """Configs the bench sweep times give the right answer at a real shape (M = 1, fp16, no bias): the
    launcher's pick and, for each warp count, the sweep's last config (widest tile, largest split, the register
    cap). A few, not all 33: each is a compile, and the sweep checks every config against the dequant path
    before timing it."""
    a = make(1, 4096, 4096, 128, torch.float16, seed=1, device=DEVICE)
    configs = _sweep_configs()
    last = {cfg["num_warps"]: cfg for cfg in configs}
    for cfg in [configs[0], *last.values()]:
        assert_w4_close(run(a, config=cfg), a)


@pytest.mark.gpu
def test_split_k_is_deterministic():
    a = make(1, 4096, 14336, 128, torch.float16, seed=3, device=DEVICE)
    cfg = {**gemv_config(1, 4096, 14336, 128), "SPLIT_K": 8}
    y1, y2 = run(a, config=cfg), run(a, config=cfg)
    assert torch.equal(y1, y2)
    assert_w4_close(y1, a)


@pytest.mark.gpu
def test_cuda_graph_replay():
    """One eager call (compiles, grows the split-K workspace), then capture; replays follow new inputs."""
    a = make(1, 6144, 4096, 128, torch.float16, seed=5, device=DEVICE)
    x, out = a["x"].clone(), torch.empty(1, 6144, dtype=torch.float16, device=DEVICE)
    w4a16_gemv(x, a["qweight"], a["scales"], a["zeros"], out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w4a16_gemv(x, a["qweight"], a["scales"], a["zeros"], out=out)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator(DEVICE).manual_seed(seed), device=DEVICE))
        graph.replay()
        assert_w4_close(out.clone(), {**a, "x": x})


def test_bad_inputs_are_clear_errors():
    a = make(9, 16, 128, 128, torch.float16, seed=0, device=DEVICE)
    with pytest.raises(ValueError, match="at most 8 rows"):
        w4a16_gemv(a["x"], a["qweight"], a["scales"], a["zeros"])
    x = a["x"][:1]
    with pytest.raises(ValueError, match="zeros must be float32"):
        w4a16_gemv(x, a["qweight"], a["scales"], a["zeros"].half())
    with pytest.raises(ValueError, match="scales dtype"):
        w4a16_gemv(x, a["qweight"], a["scales"].bfloat16(), a["zeros"])
    with pytest.raises(ValueError, match="group size 16"):
        w4a16_gemv(x, a["qweight"], a["scales"].repeat(1, 8), a["zeros"].repeat(1, 8))
    with pytest.raises(ValueError, match="qweight must be int32"):
        w4a16_gemv(x, a["qweight"].view(torch.float32), a["scales"], a["zeros"])
    b = make(1, 16, 192, 64, torch.float16, seed=0, device=DEVICE)
    with pytest.raises(ValueError, match="mma kernel needs G == 128"):
        w4a16_gemv(b["x"], b["qweight"], b["scales"], b["zeros"], config=MMA)
    with pytest.raises(ValueError, match="unknown config keys"):
        w4a16_gemv(x, a["qweight"], a["scales"], a["zeros"], config={**MMA, "BLOCK_W": 16})
    with pytest.raises(ValueError, match="multiple of 16 num_warps"):
        w4a16_gemv(x, a["qweight"], a["scales"], a["zeros"], config={**MMA, "BLOCK_N": 32})
    for removed in ("CHAINS", "ZSTEP", "XOP", "ADDR"):  # keys of kernel forms since removed: a clear error
        with pytest.raises(ValueError, match=f"unknown config keys \\['{removed}'\\]"):
            w4a16_gemv(x, a["qweight"], a["scales"], a["zeros"], config={**MMA, removed: 1})
    with pytest.raises(ValueError, match="TRIGGER=3"):
        w4a16_gemv(x, a["qweight"], a["scales"], a["zeros"], config={**MMA, "TRIGGER": 3})
