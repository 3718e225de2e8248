"""Prefill-salience kernel against its fp64 reference: every mode, odd N, D in {64, 72, 80}.

On a machine without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1) at small
shapes; on a GPU the same tests also run the real SigLIP / long-sequence shapes. Tolerance rule
(CONVENTIONS.md): kernel error <= 2x the error of naive PyTorch at the input dtype + a small floor.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from csrc_triton.prefill_salience import _split_head_dim, prefill_salience, prefill_salience_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# (B frames, H heads, N tokens, D, n_query): all-query (SigLIP), summary rows (CLIP CLS = 1 row,
# several summary tokens), several frames; N odd and not a multiple of any tile.
SMALL = [
    (1, 2, 197, 72, None),
    (3, 2, 123, 64, None),
    (2, 3, 217, 80, None),
    (1, 1, 729, 72, None),
    (2, 2, 197, 72, 1),
    (1, 3, 217, 80, 4),
    (1, 1, 1000, 64, 5),
    (1, 2, 5, 72, None),
]
REAL = [  # the bench shapes that fit an fp64 reference
    (1, 16, 729, 72, None),
    (8, 16, 729, 72, None),
    (64, 16, 729, 72, None),
    (1, 16, 4096, 80, None),
    (16, 16, 577, 64, 1),
]
SHAPES = SMALL + (REAL if CUDA else [])


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the launcher allocates starts as NaN, so an unwritten element fails the test."""
    empty = torch.empty

    def nan_empty(*size, **kw):
        t = empty(*size, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


def _inputs(B, H, N, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Scaled so that softmax rows are far from uniform: a salience that ignores q would fail.
    q = (2 * torch.randn(B, H, N, D, generator=g)).to(DEVICE, dtype)
    k = (2 * torch.randn(B, H, N, D, generator=g)).to(DEVICE, dtype)
    return q, k


def _naive(q, k, n_query):
    """What plain PyTorch does at the input precision: scores and softmax in q's dtype, fp32 mean."""
    M = q.shape[2] if n_query is None else n_query
    s = q[:, :, :M] @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1).float().mean(dim=(1, 2))


def _assert_within(out, q, k, n_query):
    ref = prefill_salience_ref(q.double(), k.double(), n_query=n_query)
    err = (out.double() - ref).abs().max().item()
    torch_err = (_naive(q, k, n_query).double() - ref).abs().max().item()
    floor = 1e-5 * ref.abs().max().item()
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert err <= 2 * torch_err + floor, f"kernel error {err:.3g}, naive PyTorch error {torch_err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype, poisoned):
    B, H, N, D, n_query = shape
    q, k = _inputs(B, H, N, D, dtype, seed=N + D)
    out = prefill_salience(q, k, n_query=n_query)
    _assert_within(out, q, k, n_query)
    # Every row of a softmax sums to 1, so the mean over rows and heads sums to 1 over the keys.
    torch.testing.assert_close(out.sum(-1), torch.ones(B, device=DEVICE), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tiles", [(128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 3), (32, 16, 4, 3)],
                         ids=lambda t: "r{}s{}w{}p{}".format(*t))
def test_every_tile_config(tiles, poisoned):
    """The configurations the bench sweeps give the same salience (masks at every tile edge)."""
    q, k = _inputs(2, 2, 197, 72, torch.float16, seed=7)
    _assert_within(prefill_salience(q, k, tiles=tiles), q, k, None)
    _assert_within(prefill_salience(q, k, n_query=3, tiles=tiles), q, k, 3)


@pytest.mark.parametrize("shape", [(1, 2, 197, 72, None), (2, 3, 217, 80, 4), (1, 1, 1000, 64, 5)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp32_standalone_and_fused(shape, poisoned):
    """fp32 (the tightest tolerance), standalone and the fused (LSE given) column pass with small tiles, with
    and without tile tails."""
    B, H, N, D, n_query = shape
    q, k = _inputs(B, H, N, D, torch.float32, seed=N + 2)
    _assert_within(prefill_salience(q, k, n_query=n_query), q, k, n_query)
    M = N if n_query is None else n_query
    lse = torch.logsumexp(q[:, :, :M].double() @ k.double().transpose(-1, -2) * D ** -0.5, -1).float()
    _assert_within(prefill_salience(q, k, n_query=n_query, lse=lse, tiles=(32, 16, 4, 3)), q, k, n_query)


def _extreme_inputs(D, dtype, case):
    """fp16-representable q, k whose logits leave pass 1's unshifted range in one resident block:
    "large" (one head's rows scaled x12: logits up to ~190 in log2 units, past fp32's 2^128),
    "negative" (row 5 anti-aligned with every key: logits ~ -220, all below fp32's normal range, so the
    unshifted sum is 0). Either way the unshifted result alone would be inf or -inf: the rerun must run."""
    q, k = _inputs(1, 2, 197, D, torch.float32, seed=D + 11)
    if case == "large":
        q[:, 1] *= 12
    else:
        u = torch.ones(D, device=q.device)
        k = k + 3 * u
        q[:, :, 5] = -6 * u
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("case", ["large", "negative"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [72, 80])
def test_logits_outside_the_unshifted_range(D, dtype, case, poisoned):
    """Pass 1 sums 2^logit with no running max and reruns a block with one when a row's sum leaves
    [2^-60, 2^100): both ways out give the reference salience (and sum to 1)."""
    q, k = _extreme_inputs(D, dtype, case)
    lo = (q[0, :, :, None, :].double() * k[0, :, None, :, :].double()).sum(-1) * D ** -0.5 * 1.4426950408889634
    if case == "large":
        assert lo.max() > 140  # 2^logit overflows fp32
    else:
        assert lo[:, 5].max() < -150  # the whole row underflows fp32
    out = prefill_salience(q, k)
    _assert_within(out, q, k, None)
    torch.testing.assert_close(out.sum(-1), torch.ones(1, device=DEVICE), rtol=1e-4, atol=1e-4)
    if dtype == torch.float32:  # the tightest check: fp64 reference, fp32 kernel
        torch.testing.assert_close(out.double(), prefill_salience_ref(q.double(), k.double()), rtol=1e-4, atol=1e-7)


def test_reused_lse_runs_only_the_column_pass(poisoned):
    """With the attention's own (natural-log) LSE the kernel gives the same salience."""
    q, k = _inputs(2, 3, 197, 72, torch.float16, seed=1)
    s = q.float() @ k.float().transpose(-1, -2) * 72 ** -0.5  # (B, H, N, N)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, N)
    _assert_within(prefill_salience(q, k, lse=lse), q, k, None)
    _assert_within(prefill_salience(q, k, n_query=3, lse=lse[:, :, :3].contiguous()), q, k, 3)


def test_views_of_a_fused_qkv_projection(poisoned):
    """q, k as the vision encoder makes them: strided views of one (B, T, 3, H, D) tensor."""
    B, T, H, D = 2, 123, 2, 72
    qkv = torch.randn(B, T, 3, H, D, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D), non-contiguous
    assert not q.is_contiguous()
    _assert_within(prefill_salience(q, k), q, k, None)


def test_frames_are_independent():
    q, k = _inputs(3, 2, 100, 64, torch.float16, seed=3)
    torch.testing.assert_close(prefill_salience(q, k)[1:2], prefill_salience(q[1:2], k[1:2]), rtol=1e-6, atol=1e-7)


def test_reference_agrees_with_flash_colreduce_naive():
    """Our oracle against the public kernel's own naive form (per head), averaged over heads."""
    fc = pytest.importorskip("flash_colreduce")
    q, k = _inputs(2, 3, 97, 72, torch.float32, seed=4)
    theirs = fc.naive_colreduce(q, k, "mean").mean(1)  # (B, H, N) -> (B, N)
    torch.testing.assert_close(prefill_salience_ref(q, k), theirs, rtol=1e-5, atol=1e-7)


def test_head_dim_split():
    assert [_split_head_dim(d) for d in (16, 40, 64, 72, 80, 96, 128, 200)] == [
        (16, 0), (32, 16), (64, 0), (64, 16), (64, 16), (64, 32), (128, 0), (128, 128)]


def test_bad_input_is_named():
    q, k = _inputs(1, 2, 20, 64, torch.float16, seed=5)
    with pytest.raises(ValueError, match="n_query"):
        prefill_salience(q, k, n_query=21)
    with pytest.raises(ValueError, match="agree in B, H, D"):
        prefill_salience(q, k[:, :1])
    with pytest.raises(ValueError, match="dtype"):
        prefill_salience(q, k.float())
    with pytest.raises(ValueError, match="lse must be float32"):
        prefill_salience(q, k, lse=torch.zeros(1, 2, 19, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        prefill_salience(q.transpose(2, 3), k.transpose(2, 3))
