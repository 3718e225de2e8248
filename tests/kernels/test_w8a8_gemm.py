"""csrc_triton.w8a8_gemm against its reference and an fp64 oracle.

On CPU the kernel runs under TRITON_INTERPRET=1 at small widths (decode M=1, odd sizes, M=729*k);
on CUDA the same cases run plus SigLIP-so400m shapes (729 x {1, 8, 64} tokens, 1152 <-> 3456/4304),
and every tile config of the sweep, TMA and pointer operands, must give bit-identical outputs.
The default kernel's epilogue in EPI_SPLIT (1, 2, 4) column sub-tiles runs with bias + residual at odd
shapes: bit-identical to the reference under the interpreter, to each other on the GPU.
The persistent variant (config PERSISTENT) runs here too: under the interpreter with small tiles,
3 programs looping over several tiles, TMA descriptors (a, b, residual, c) and the pointer fallback.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from csrc_triton.w8a8_gemm import (  # noqa: E402
    _PERSISTENT_TILES, _TILES, _config, persistent_config, w8a8_gemm, w8a8_gemm_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}  # relative to max|out|

SMALL = [(1, 40, 72), (5, 123, 217), (729, 48, 64), (2 * 729, 24, 40)]
REAL = [(729, 3456, 1152), (8 * 729, 1152, 4304), (8 * 729, 4304, 1152), (3, 1152, 1152), (64 * 729, 1152, 4304)]
SHAPES = SMALL + (REAL if ON_GPU else [])


def make(M, N, K, seed, with_bias=True, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    a_s = torch.rand(M, generator=g) * 0.02 + 1e-3  # realistic: |x| up to ~2.5
    b_s = torch.rand(N, generator=g) * 1e-3 + 1e-4
    bias = (torch.randn(N, generator=g) * 0.5).to(dtype) if with_bias else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(a), to(b), to(a_s), to(b_s), to(bias)


def oracle(a, b, a_s, b_s, bias):
    out = (a.double() @ b.double().t()) * a_s.double()[:, None] * b_s.double()[None, :]
    return out if bias is None else out + bias.double()[None, :]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matches_reference(M, N, K, dtype):
    a, b, a_s, b_s, bias = make(M, N, K, seed=M + N + K, dtype=dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: unwritten fails
    out.copy_(w8a8_gemm(a, b, a_s, b_s, bias, out_dtype=dtype))
    want = oracle(a, b, a_s, b_s, bias)
    ref_err = (w8a8_gemm_ref(a, b, a_s, b_s, bias, out_dtype=dtype).double() - want).abs().max().item()
    err = (out.double() - want).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 2 * ref_err + FLOOR[dtype] * want.abs().max().item(), (err, ref_err)


def test_no_bias_and_scale_order():
    a, b, a_s, b_s, _ = make(33, 65, 97, seed=1)
    out = w8a8_gemm(a, b, a_s, b_s, None, out_dtype=torch.float32)
    want = oracle(a, b, a_s, b_s, None)
    assert (out.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # A wrong per-token vs per-channel broadcast would be caught: swap scales -> large error.
    assert (out.double() - oracle(a, b, a_s.flip(0), b_s, None)).abs().max().item() > 1e-2


def test_strided_rows():
    """a can be a row-slice of a wider buffer (a view with stride(0) > K)."""
    a, b, a_s, b_s, bias = make(17, 32, 64, seed=2)
    wide = torch.randint(-127, 128, (17, 96), dtype=torch.int8, device=DEVICE)
    wide[:, :64] = a
    out = w8a8_gemm(wide[:, :64], b, a_s, b_s, bias)
    assert torch.equal(out, w8a8_gemm(a, b, a_s, b_s, bias))


def test_bad_input():
    a, b, a_s, b_s, bias = make(4, 8, 16, seed=3)
    with pytest.raises(TypeError, match="int8"):
        w8a8_gemm(a.float(), b, a_s, b_s, bias)
    with pytest.raises(ValueError, match="b_scale"):
        w8a8_gemm(a, b, a_s, b_s[:3], bias)
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        w8a8_gemm(a, b[:, :8], a_s, b_s, bias)


def test_residual_epilogue():
    """out = GEMM epilogue + residual, with one rounding (the ViT skip connection fused)."""
    M, N, K = 37, 72, 144
    a, b, a_s, b_s, bias = make(M, N, K, seed=4)
    res = (torch.randn(M, N) * 2).to(DEVICE, torch.float16)
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device=DEVICE)
    out.copy_(w8a8_gemm(a, b, a_s, b_s, bias, residual=res))
    want = oracle(a, b, a_s, b_s, bias) + res.double()
    ref_err = (w8a8_gemm_ref(a, b, a_s, b_s, bias, residual=res).double() - want).abs().max().item()
    err = (out.double() - want).abs().max().item()
    assert err <= 2 * ref_err + 1e-3 * want.abs().max().item(), (err, ref_err)
    # The residual really is added (not dropped): the plain GEMM differs by it.
    assert (out.double() - w8a8_gemm(a, b, a_s, b_s, bias).double()).abs().max().item() > 1.0
    with pytest.raises(ValueError, match="residual"):
        w8a8_gemm(a, b, a_s, b_s, bias, residual=res.float())
    # A residual in a transposed layout (a ViT's first layer at batch 1) gives the same result.
    res_t = res.t().contiguous().t()  # (M, N) with strides (1, M)
    assert torch.equal(w8a8_gemm(a, b, a_s, b_s, bias, residual=res_t), out)


def _configs():
    """Every tile config of the GPU sweep (both operand paths, every epilogue split); small tiles under
    the interpreter."""
    if not ON_GPU:
        return [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1, TMA=t, EPI_SPLIT=sp)
                for t in (False, True) for sp in (1, 2, 4)]
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=st, TMA=t, EPI_SPLIT=sp)
            for bm, bn, bk, w, st, sp in _TILES for t in (False, True)]


@pytest.mark.parametrize("M,N,K", [(70, 48, 96)] + ([(729, 1152, 4304), (5 * 729, 3456, 1152)] if ON_GPU else []))
def test_every_config_bit_identical(M, N, K):
    """int32 sums are exact and the epilogue is elementwise, so every tiling/operand path (TMA loads
    with zero-filled edges, pointer loads with a peeled K tail) must agree: bit for bit with the
    reference on CPU; on the GPU within one fp16 rounding (the compiler may contract the epilogue's
    multiply-add into an FMA), and >= 99% of elements bit-identical."""
    a, b, a_s, b_s, bias = make(M, N, K, seed=5)
    want = w8a8_gemm_ref(a, b, a_s, b_s, bias)
    for cfg in _configs():
        out = torch.full((M, N), float("nan"), dtype=torch.float16, device=DEVICE)
        out.copy_(w8a8_gemm(a, b, a_s, b_s, bias, config=cfg))
        if not ON_GPU:
            assert torch.equal(out, want), cfg
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3, msg=str(cfg))
        assert (out == want).float().mean().item() >= 0.99, cfg


# (M, N, K, out dtype) with bias + residual through the default kernel at every EPI_SPLIT: ragged M and N
# edges (partial sub-tiles, a sub-tile wholly past N), a K tail, M = 1; on the GPU the ViT's wo and fc2 at
# 8 images (128 x 256 tiles), wo at one image (64 x 128) and a 3-row odd-N GEMM (64 x 64).
F16, BF16 = torch.float16, torch.bfloat16
SPLIT_CASES = [(5, 123, 217, F16), (93, 100, 160, F16)] + (
    [(37, 72, 144, F16), (1, 40, 72, F16), (93, 100, 160, BF16), (37, 72, 144, BF16)] if not ON_GPU else
    [(8 * 729, 1152, 1152, F16), (8 * 729, 1152, 4304, F16), (8 * 729, 1152, 1152, BF16), (729, 1152, 1152, F16),
     (3, 200, 1152, F16)])


def _split_configs(M, N, K):
    """The launcher's tile for (M, N, K) with each EPI_SPLIT: TMA operands (where K rows are 16-byte
    aligned) at every split, pointer operands at 1 and 2 (the epilogue is the same code on both paths);
    under the interpreter 32x32 tiles (sub-tiles of 32, 16 and 8 columns)."""
    base = {k: v for k, v in _config(M, N, K, torch.device(DEVICE)).items() if k != "EPI_SPLIT"}
    return ([dict(base, EPI_SPLIT=sp, TMA=True) for sp in (1, 2, 4) if K % 16 == 0]
            + [dict(base, EPI_SPLIT=sp, TMA=False) for sp in (1, 2)])


@pytest.mark.parametrize("M,N,K,dtype", SPLIT_CASES)
def test_epilogue_split_matches_reference(M, N, K, dtype):
    """bias + residual epilogue in 1, 2 and 4 column sub-tiles: the same fp32 op order and one rounding,
    so under the interpreter fp16 is bit-identical to the reference; on the GPU (where the compiler may
    contract a multiply-add into an FMA) every split gives the same bits as the unsplit epilogue and
    >= 99% of the reference's. All within the tolerance rule against the fp64 oracle. bf16: tolerance
    only under the interpreter (it rounds fp32 -> bf16 by truncation)."""
    a, b, a_s, b_s, bias = make(M, N, K, seed=11 * M + N + K, dtype=dtype)
    res = (torch.randn(M, N) * 2).to(DEVICE, dtype)
    want = w8a8_gemm_ref(a, b, a_s, b_s, bias, out_dtype=dtype, residual=res)
    oracle_out = oracle(a, b, a_s, b_s, bias) + res.double()
    ref_err = (want.double() - oracle_out).abs().max().item()
    first = None
    for cfg in _split_configs(M, N, K):
        out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: unwritten fails
        out.copy_(w8a8_gemm(a, b, a_s, b_s, bias, out_dtype=dtype, residual=res, config=cfg))
        err = (out.double() - oracle_out).abs().max().item()
        assert err <= 2 * ref_err + FLOOR[dtype] * oracle_out.abs().max().item(), (cfg, err, ref_err)
        if not ON_GPU and dtype == torch.float16:
            assert torch.equal(out, want), cfg
        if dtype == torch.float16 or ON_GPU:
            assert (out == want).float().mean().item() >= 0.99, cfg
        first = out if first is None else first
        if ON_GPU:
            assert torch.equal(out, first), cfg  # the split changes which values are live, not the math


def test_epilogue_split_no_residual_and_bad_split():
    """Without bias or residual each split still writes every element (poisoned output) exactly; a split
    that is not 1, 2 or 4 or does not divide BLOCK_N is refused."""
    M, N, K = 45, 80, 96
    a, b, a_s, b_s, _ = make(M, N, K, seed=12)
    want = w8a8_gemm_ref(a, b, a_s, b_s, None)
    for cfg in _split_configs(M, N, K):
        out = torch.full((M, N), float("nan"), dtype=torch.float16, device=DEVICE)
        out.copy_(w8a8_gemm(a, b, a_s, b_s, None, config=cfg))
        assert torch.isfinite(out).all(), cfg
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3, msg=str(cfg))
        assert (out == want).float().mean().item() >= (0.99 if ON_GPU else 1.0), cfg
    for bad in (3, 8 * _config(M, N, K, torch.device(DEVICE))["BLOCK_N"]):
        with pytest.raises(ValueError, match="EPI_SPLIT"):
            w8a8_gemm(a, b, a_s, b_s, None, config=dict(_config(M, N, K, torch.device(DEVICE)), EPI_SPLIT=bad))


def _persistent_configs():
    """Persistent-kernel configs: small tiles and 3 programs (several tiles each) under the interpreter,
    every split of the epilogue and both operand paths; the sweep's configs on the GPU."""
    if not ON_GPU:
        return [dict(PERSISTENT=True, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1,
                     EPI_SPLIT=split, FLATTEN=False, NUM_PROGRAMS=3, TMA=tma) for split in (1, 2, 4) for tma in (True, False)]
    # The pointer form at a tile whose shared memory fits at every K (128 x 256 x 128 in 3 stages did not at K = 160).
    return [persistent_config(t) for t in _PERSISTENT_TILES] + [dict(persistent_config((128, 128, 128, 4, 2, 1, False)),
                                                                     TMA=False)]


PERSISTENT_SHAPES = [(70, 48, 96), (5, 123, 217), (1, 40, 72), (93, 72, 160)] + (
    [(729, 1152, 4304), (8 * 729, 3456, 1152), (8 * 729, 4304, 1152), (3, 1152, 1152)] if ON_GPU else [])


@pytest.mark.parametrize("M,N,K", PERSISTENT_SHAPES)
@pytest.mark.parametrize("dtype,with_bias,with_res", [(torch.float16, True, True), (torch.bfloat16, True, False),
                                                      (torch.float16, False, False), (torch.bfloat16, False, True)])
def test_persistent_matches_reference(M, N, K, dtype, with_bias, with_res):
    """Odd M/N/K (ragged tiles, pointer path where rows are not 16-byte aligned), bias, residual, fp16 and
    bf16 out: fp16 bit-identical to the reference under the interpreter (same fp32 epilogue order), on the
    GPU >= 99% bit-identical (FMA contraction); both within the tolerance rule against the fp64 oracle.
    bf16 is held to the tolerance rule only: the interpreter rounds fp32 -> bf16 by truncation."""
    a, b, a_s, b_s, bias = make(M, N, K, seed=7 * M + N + K, with_bias=with_bias, dtype=dtype)
    res = (torch.randn(M, N) * 2).to(DEVICE, dtype) if with_res else None
    want = w8a8_gemm_ref(a, b, a_s, b_s, bias, out_dtype=dtype, residual=res)
    oracle_out = oracle(a, b, a_s, b_s, bias) + (res.double() if with_res else 0)
    ref_err = (want.double() - oracle_out).abs().max().item()
    for cfg in _persistent_configs():
        out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: unwritten fails
        out.copy_(w8a8_gemm(a, b, a_s, b_s, bias, out_dtype=dtype, residual=res, config=cfg))
        if not ON_GPU and dtype == torch.float16:
            assert torch.equal(out, want), cfg
        err = (out.double() - oracle_out).abs().max().item()
        assert err <= 2 * ref_err + FLOOR[dtype] * oracle_out.abs().max().item(), (cfg, err, ref_err)
        if dtype == torch.float16 or ON_GPU:
            assert (out == want).float().mean().item() >= 0.99, cfg


def test_persistent_covers_every_tile():
    """More tiles than programs: each program must loop (a program that handled one tile only would
    leave poisoned NaN tiles), and the grouped order must cover every (pid_m, pid_n) exactly once."""
    M, N, K = 130, 100, 64  # 5 x 4 tiles of 32 over 3 programs, ragged M and N edges
    a, b, a_s, b_s, bias = make(M, N, K, seed=8)
    cfg = dict(_persistent_configs()[0], NUM_PROGRAMS=3) if not ON_GPU else dict(persistent_config(_PERSISTENT_TILES[3]))
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device=DEVICE)
    out.copy_(w8a8_gemm(a, b, a_s, b_s, bias, config=cfg))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, w8a8_gemm_ref(a, b, a_s, b_s, bias), rtol=2e-3, atol=2e-3)


def test_gluon_dispatch_off_the_gpu():
    """The Gluon kernel (csrc_triton/w8a8_gemm_wgmma.py) is sm_90-only: on any other device, and under the
    interpreter, w8a8_gemm never dispatches to it."""
    from csrc_triton.w8a8_gemm import _wgmma_ok

    a, b, *_ = make(16, 32, 64, seed=12)
    c = torch.empty(16, 32, dtype=torch.float16, device=DEVICE)
    if not ON_GPU or torch.cuda.get_device_capability() != (9, 0):
        assert not _wgmma_ok(a, b, c, None)


def test_persistent_argument_picks_the_kernel(monkeypatch):
    """persistent=False keeps the plain kernel where the persistent one runs by default: the 128 x 256 tile of 8
    SigLIP images on an H200 (its capabilities stubbed, so this runs anywhere)."""
    import csrc_triton.w8a8_gemm as wg

    monkeypatch.setattr(wg, "device_caps", lambda index: (132, 232448, 9))
    cuda = torch.device("cuda", 0)
    assert wg._auto_config(8 * 729, 1152, 1152, cuda, True)["PERSISTENT"]
    plain = wg._auto_config(8 * 729, 1152, 1152, cuda, True, persistent=False)
    assert "PERSISTENT" not in plain and (plain["BLOCK_M"], plain["BLOCK_N"]) == (128, 256)


def test_wgmma_argument_keeps_the_triton_kernels(monkeypatch):
    """A call the launcher would send to the Gluon kernel (its checks and kernel stubbed: a persistent config,
    an sm_90 answer) goes there by default and runs the persistent Triton kernel with wgmma=False."""
    import csrc_triton.w8a8_gemm as wg

    gw = pytest.importorskip("csrc_triton.w8a8_gemm_wgmma")
    calls = []
    monkeypatch.setattr(wg, "_auto_config", lambda M, N, K, device, tma, persistent=True: dict(_persistent_configs()[1]))
    monkeypatch.setattr(wg, "_wgmma_ok", lambda a, b, c, residual: True)
    monkeypatch.setattr(gw, "w8a8_gemm_wgmma", lambda *args, **kw: calls.append(kw) or kw["out"].zero_())
    a, b, a_s, b_s, bias = make(70, 48, 96, seed=13)
    assert not w8a8_gemm(a, b, a_s, b_s, bias).any()
    assert [{k: v for k, v in kw.items() if k != "out"} for kw in calls] == [{"pingpong": True}]
    out = w8a8_gemm(a, b, a_s, b_s, bias, wgmma=False)
    assert len(calls) == 1
    torch.testing.assert_close(out, w8a8_gemm_ref(a, b, a_s, b_s, bias), rtol=2e-3, atol=2e-3)
