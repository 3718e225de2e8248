"""csrc_triton.w8a8_gemm_wgmma (Gluon, sm_90 only) against the reference, an fp64 oracle and the Triton kernel.

Gluon kernels have no interpreter form, so these tests run on a Hopper GPU only (skipped elsewhere: the
Triton kernel, tested everywhere in test_w8a8_gemm.py, is what runs there). Integer sums are exact, so the
two kernels may differ only where the compiler contracts an epilogue multiply-add differently.
"""

import pytest
import torch
import triton

TRITON_36 = triton.__version__.startswith("3.6.")  # the Gluon API the kernel is written against
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and TRITON_36
pytestmark = [pytest.mark.gpu(capability=(9, 0)),  # wgmma is sm_90a: Hopper only
              pytest.mark.skipif(not TRITON_36, reason="the Gluon wgmma kernel is written for Triton 3.6")]

if ON_HOPPER:
    from csrc_triton.w8a8_gemm import w8a8_gemm
    from csrc_triton.w8a8_gemm_wgmma import ok, w8a8_gemm_wgmma, w8a8_gemm_wgmma_ref

FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}  # relative to max|out|
# The kernel's forms: 256-wide tiles in column halves, 256-tall ones in row halves, the warp-specialised ping-pong.
FORMS = [dict(tile=(128, 256, 128, 8, 3)), dict(tile=(128, 256, 64, 8, 6)), dict(tile=(256, 128, 128, 8, 3)),
         dict(pingpong=True), dict(pingpong=True, tile=(128, 128, 128, 4, 5))]


def make(M, N, K, seed, dtype=torch.float16, with_bias=True, with_res=True):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8).cuda()
    b = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8).cuda()
    a_s = (torch.rand(M, generator=g) * 0.02 + 1e-3).cuda()
    b_s = (torch.rand(N, generator=g) * 1e-3 + 1e-4).cuda()
    bias = (torch.randn(N, generator=g) * 0.5).to(dtype).cuda() if with_bias else None
    res = (torch.randn(M, N, generator=g) * 2).to(dtype).cuda() if with_res else None
    return a, b, a_s, b_s, bias, res


def oracle(a, b, a_s, b_s, bias, res):
    out = (a.double() @ b.double().t()) * a_s.double()[:, None] * b_s.double()[None, :]
    out = out if bias is None else out + bias.double()[None, :]
    return out if res is None else out + res.double()


# Ragged M and N edges, a K tail (K % 128 != 0, 16-byte rows for TMA), M = 1, the ViT's shapes.
SHAPES = [(1, 40, 80), (5, 123 + 5, 208), (300, 264, 1152), (729, 1152, 4304), (8 * 729, 3456, 1152),
          (8 * 729, 1152, 4304)]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matches_reference_and_triton(M, N, K, form):
    """Within the tolerance rule of the fp64 oracle, and the Triton kernel's bits (>= 99%; integer sums are
    exact, an epilogue multiply-add may contract differently)."""
    a, b, a_s, b_s, bias, res = make(M, N, K, seed=M + N + K)
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")  # poisoned: unwritten fails
    w8a8_gemm_wgmma(a, b, a_s, b_s, bias, residual=res, out=out, **form)
    want = oracle(a, b, a_s, b_s, bias, res)
    ref = w8a8_gemm_wgmma_ref(a, b, a_s, b_s, bias, residual=res)
    ref_err = (ref.double() - want).abs().max().item()
    err = (out.double() - want).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 2 * ref_err + FLOOR[torch.float16] * want.abs().max().item(), (err, ref_err)
    tri = _triton(a, b, a_s, b_s, bias, res)
    torch.testing.assert_close(out, tri, rtol=2e-3, atol=2e-3)
    assert (out == tri).float().mean().item() >= 0.99


def _triton(a, b, a_s, b_s, bias, res):
    return w8a8_gemm(a, b, a_s, b_s, bias, residual=res, wgmma=False)


@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtypes_no_bias_no_residual(dtype, pingpong):
    M, N, K = 333, 272, 1152
    a, b, a_s, b_s, bias, _ = make(M, N, K, seed=3, dtype=dtype)
    for bias_ in (bias, None):
        out = w8a8_gemm_wgmma(a, b, a_s, b_s, bias_, out_dtype=dtype, pingpong=pingpong)
        want = oracle(a, b, a_s, b_s, bias_, None)
        ref_err = (w8a8_gemm_wgmma_ref(a, b, a_s, b_s, bias_, out_dtype=dtype).double() - want).abs().max().item()
        assert (out.double() - want).abs().max().item() <= 2 * ref_err + FLOOR[dtype] * want.abs().max().item()


def test_overlap_changes_nothing_but_time():
    """IN_FLIGHT 1 (a step's wgmmas overlapped with the next step) and 0 (waited for), the ping-pong form and
    the row-halved tile compute the same bits (integer sums are exact; the epilogue is the same expression)."""
    a, b, a_s, b_s, bias, res = make(8 * 729, 1152, 4304, seed=4)
    base = w8a8_gemm_wgmma(a, b, a_s, b_s, bias, residual=res, in_flight=1)
    assert torch.equal(base, w8a8_gemm_wgmma(a, b, a_s, b_s, bias, residual=res, in_flight=0))
    assert torch.equal(base, w8a8_gemm_wgmma(a, b, a_s, b_s, bias, residual=res, pingpong=True))
    assert torch.equal(base, w8a8_gemm_wgmma(a, b, a_s, b_s, bias, residual=res, tile=(256, 128, 128, 8, 3)))


def test_pingpong_many_tiles_per_program():
    """Enough tiles that each of a program's two consumer warpgroups takes several (the turn barriers' phases
    wrap), with a tile count that leaves the programs unevenly loaded; and one that gives some programs none
    for their second warpgroup."""
    for M, N, K in ((64 * 729 // 4, 1152, 1152), (300, 264, 1152)):
        a, b, a_s, b_s, bias, res = make(M, N, K, seed=M)
        out = w8a8_gemm_wgmma(a, b, a_s, b_s, bias, residual=res, pingpong=True)
        assert torch.equal(out, w8a8_gemm_wgmma(a, b, a_s, b_s, bias, residual=res))


def test_ok():
    """sm_90, 16-bit output, TMA-aligned operands; anything else goes to the Triton kernel."""
    a, b, *_ = make(64, 64, 80, seed=5)
    c = torch.empty(64, 64, dtype=torch.float16, device="cuda")
    assert ok(a, b, c)
    assert not ok(a, b, c.float())  # fp32 output
    wide = torch.zeros(64, 88, dtype=torch.int8, device="cuda")
    assert not ok(wide[:, :80], b, c)  # a row stride of 88 bytes: not 16-byte aligned
    assert not ok(torch.zeros(64, 96, dtype=torch.int8, device="cuda")[:, 1:81], b, c)  # a misaligned base
    assert not ok(a, b, c, torch.zeros(64, 68, dtype=torch.float16, device="cuda")[:, :64])  # residual stride 136 B


def test_dispatch_by_k(monkeypatch):
    """w8a8_gemm sends its persistent-config calls to the Gluon kernel in the form measured fastest there
    (csrc_triton/w8a8_gemm.py, _wgmma_form): ping-pong at K <= PINGPONG_MAX_K with or without a residual, the
    256 x 128 form at longer K with a residual, the Triton kernel at longer K without, and never with wgmma=False;
    same results every way."""
    import csrc_triton.w8a8_gemm_wgmma as gw

    calls = []
    real = gw.w8a8_gemm_wgmma
    monkeypatch.setattr(gw, "w8a8_gemm_wgmma", lambda *args, **kw: calls.append(kw) or real(*args, **kw))
    for K, want in ((1152, [{"pingpong": True}] * 2), (4304, [{"tile": (256, 128, 128, 8, 3), "group_m": 4}])):
        calls.clear()
        a, b, a_s, b_s, bias, res = make(8 * 729, 1152, K, seed=6)
        with_res = w8a8_gemm(a, b, a_s, b_s, bias, residual=res)
        plain = w8a8_gemm(a, b, a_s, b_s, bias)
        assert [{k: v for k, v in kw.items() if k != "out"} for kw in calls] == want
        torch.testing.assert_close(with_res, _triton(a, b, a_s, b_s, bias, res), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(plain, _triton(a, b, a_s, b_s, bias, None), rtol=2e-3, atol=2e-3)
        assert len(calls) == len(want)  # wgmma=False (_triton) never reached the Gluon kernel
