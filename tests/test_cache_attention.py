"""Causal GQA attention of new rows over a KV cache (tinyvila.ops.attention / attention_lse): the CUDA paths
against the fp32 reference (`ops._attention_lse_ref`), on CPU the reference path against an independent
materialised softmax.

On CUDA, rows over a cache prefix take one call of PyTorch's flash kernel with its causal mask aligned
bottom-right and the KV heads as they are (ops._attention_lse_flash); a square first turn of at least
ops.SDPA_SQUARE_MIN_T rows takes SDPA with K/V expanded. The cases below are views of a larger cache, as
text.Attention passes them, with GQA groups of 1, 4 and 7, fp16 and bf16. Rows at device slots (a later turn's
graph) take the varlen form of that kernel over the whole cache layer (ops.attention_rows).
"""

import pytest
import torch

from tinyvila import ops
from tinyvila.kv_cache import RowsIndex
from tinyvila.options import Options

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # output atol vs fp32 (unit-variance V)


def _cache(H, Hkv, T, q_start, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    cap = q_start + T + 37  # slots past the used ones exist and must not be read
    kc = torch.randn(1, Hkv, cap, D, generator=g).to(device, dtype)
    vc = torch.randn(1, Hkv, cap, D, generator=g).to(device, dtype)
    q = (2 * torch.randn(1, H, T, D, generator=g)).to(device, dtype)
    kc[:, :, q_start + T:] = float("nan")  # poison: a read past the last row shows in the output
    vc[:, :, q_start + T:] = float("nan")
    return q, kc[:, :, :q_start + T], vc[:, :, :q_start + T]


def _materialised(q, k, v, q_start):
    """Softmax attention written out in fp64: row t sees keys 0..q_start + t."""
    n_rep = q.shape[1] // k.shape[1]
    kd, vd = (x.double().repeat_interleave(n_rep, 1) for x in (k, v))
    s = q.double() @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    T, S = q.shape[2], k.shape[2]
    s = s.masked_fill(torch.arange(S)[None, :] > torch.arange(q_start, q_start + T)[:, None], float("-inf"))
    return torch.softmax(s, -1) @ vd, torch.logsumexp(s, -1)


@pytest.mark.parametrize("T,q_start", [(1, 0), (5, 0), (3, 11), (9, 40)])
def test_cpu_reference_paths(T, q_start):
    q, k, v = _cache(8, 2, T, q_start, 16, torch.float32, "cpu")
    o_ref, lse_ref = _materialised(q, k, v, q_start)
    o, lse = ops.attention_lse(q, k, v, q_start)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.attention(q, k, v, causal=True, q_start=q_start).double(), o_ref,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.gpu  # PyTorch's flash kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv", [(32, 8), (14, 2), (8, 8)])
@pytest.mark.parametrize("T,q_start", [(1, 0), (1, 700), (17, 0), (17, 1000), (46, 515), (64, 8192), (130, 4000),
                                       (450, 0), (1100, 0), (1024, 3000)])
def test_cuda_matches_reference(dtype, H, Hkv, T, q_start):
    q, k, v = _cache(H, Hkv, T, q_start, 128, dtype, "cuda")
    o_ref, lse_ref = ops._attention_lse_ref(q.float(), k.float(), v.float(), q_start)
    o, lse = ops.attention_lse(q, k, v, q_start)
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), o_ref, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-5)
    o_plain = ops.attention(q, k, v, causal=True, q_start=q_start)  # SDPA for the long square case
    torch.testing.assert_close(o_plain.float(), o_ref, atol=TOL[dtype], rtol=0)
    if q_start > 0 or T < ops.SDPA_SQUARE_MIN_T:  # the same flash call: the same bits
        assert torch.equal(o_plain, o)


@pytest.mark.gpu  # PyTorch's flash kernel
def test_cuda_flash_refuses_a_misaligned_cache():
    q, k, v = _cache(8, 2, 4, 10, 64, torch.float16, "cuda")
    with pytest.raises(ValueError, match="attention over a cache"):
        ops._attention_lse_flash(q, k[:, :, :-1], v[:, :, :-1], 10)


# -- rows at device slots (a later turn's CUDA graph: kv_cache.RowsIndex, ops.attention_rows) ---------------------
def _rows(start: int, T: int, S: int, device) -> RowsIndex:
    """The RowsIndex of T rows at slot `start` of an S-slot cache, as generate.Decoder builds it."""
    st = torch.tensor([start], device=device)
    two = torch.arange(2, device=device)
    return RowsIndex(st, torch.arange(T, device=device) + st, (st + T).int(), (two * T).int(), (two * S).int())


def _whole_cache(H, Hkv, T, start, D, dtype, device, seed=0):
    """q, and a whole cache layer (1, Hkv, S, D) whose slots past start + T are NaN (read one and it shows)."""
    q, k, v = _cache(H, Hkv, T, start, D, dtype, device, seed)
    return q, k._base if k._base is not None else k, v._base if v._base is not None else v


@pytest.mark.parametrize("T,start", [(4, 0), (5, 11), (16, 40)])
def test_cpu_rows_at_device_slots(T, start):
    q, kc, vc = _whole_cache(8, 2, T, start, 16, torch.float32, "cpu")
    assert kc.shape[2] > start + T and kc[:, :, start + T:].isnan().all()
    o_ref, lse_ref = _materialised(q, kc[:, :, :start + T], vc[:, :, :start + T], start)
    o, lse = ops.attention_rows(q, kc, vc, _rows(start, T, kc.shape[2], "cpu"), lse=True)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)
    o2, none = ops.attention_rows(q, kc, vc, _rows(start, T, kc.shape[2], "cpu"))  # without the LSE: SDPA
    assert none is None
    torch.testing.assert_close(o2.double(), o_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu  # csrc_triton.rows_attention (split) and PyTorch's varlen flash kernel
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv", [(32, 8), (14, 2)])
@pytest.mark.parametrize("T,start", [(16, 30), (48, 515), (64, 8192), (256, 4000)])
def test_cuda_rows_at_device_slots_match_reference(split, dtype, H, Hkv, T, start):
    """Each form over the whole cache (NaN past the used slots) against the fp32 reference over the used keys,
    and against the batch flash call of the eager path; then replayed from one CUDA graph at two starts."""
    opts = Options(split_rows_attention=split)
    q, kc, vc = _whole_cache(H, Hkv, T, start, 128, dtype, "cuda")
    S = kc.shape[2]
    o_ref, lse_ref = ops._attention_lse_ref(q.float(), kc[:, :, :start + T].float(), vc[:, :, :start + T].float(), start)
    o, lse = ops.attention_rows(q, kc, vc, _rows(start, T, S, "cuda"), lse=True, opts=opts)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), o_ref, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-5)
    o_batch, _ = ops.attention_lse(q, kc[:, :, :start + T], vc[:, :, :start + T], start)
    torch.testing.assert_close(o.float(), o_batch.float(), atol=TOL[dtype], rtol=0)
    # One graph, two starts: the start is read from device memory at replay.
    rows = _rows(start, T, S, "cuda")
    kc2 = torch.nan_to_num(kc, nan=0.0)  # the second start reads slots poisoned for the first (37 spare slots)
    vc2 = torch.nan_to_num(vc, nan=0.0)
    graph = torch.cuda.CUDAGraph()
    ops.attention_rows(q, kc2, vc2, rows, lse=True, opts=opts)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        out, out_lse = ops.attention_rows(q, kc2, vc2, rows, lse=True, opts=opts)
    for s in (start, start + 20):  # the second reads 20 slots past the first's keys
        rows.start.fill_(s)
        rows.slots.copy_(torch.arange(T, device="cuda") + s)
        rows.keys.fill_(s + T)
        graph.replay()
        want, want_lse = ops._attention_lse_ref(q.float(), kc2[:, :, :s + T].float(), vc2[:, :, :s + T].float(), s)
        torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=0)
        torch.testing.assert_close(out_lse, want_lse, atol=1e-4, rtol=1e-5)
