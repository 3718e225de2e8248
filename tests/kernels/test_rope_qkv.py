"""csrc_triton.rope_qkv against its reference (today's split / transpose / ops.rope / cache write).

Rotated q, the cached rotated k and v must equal the reference bit for bit under the interpreter (the
kernel repeats PyTorch's three roundings) and within a few roundings on the GPU (measured on the H200:
some elements an ulp or two off; see the kernel's docstring), at the given slots only: caches are poisoned with
NaN, so a write to a wrong slot or a missing write fails. CPU: the interpreter at small sizes (GQA 1, 2, 4, odd T); CUDA
also Llama-3-8B (32 heads, 8 KV heads, D 128) at decode (T=1) and prefill (T=300), and a CUDA-graph
replay whose slot tensor is advanced between replays.
"""

import pytest
import torch
from conftest import DEVICE, ON_GPU

from csrc_triton.rope_qkv import rope_qkv, rope_qkv_ref
from tinyvila import ops

CASES = [  # B, T, H, Hkv, D, S
    (1, 1, 4, 2, 16, 9), (2, 7, 4, 4, 32, 20), (1, 37, 8, 2, 64, 50), (3, 5, 6, 3, 8, 12),
] + ([(1, 1, 32, 8, 128, 1024), (1, 300, 32, 8, 128, 1024), (2, 5, 32, 8, 128, 64)] if ON_GPU else [])
DTYPES = [torch.float16, torch.bfloat16]


def tables(T, D, dtype, positions):
    """cos, sin (T, D) the way text.rope_cos_sin builds them: fp32 angles, cast once."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = positions.float()[:, None] * inv
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


def make(B, T, H, Hkv, D, S, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, T, (H + 2 * Hkv) * D, generator=g) * 3).to(DEVICE, dtype)
    slots = torch.randperm(S, generator=g)[:T].sort().values  # increasing, with gaps
    cos, sin = tables(T, D, dtype, slots + 1000)  # positions past the slots, as after pruning
    poison = torch.full((B, Hkv, S, D), float("nan"), dtype=dtype, device=DEVICE)
    return qkv, cos, sin, slots.to(DEVICE), poison


def same(a, b):
    """Bitwise equal, NaN where NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def match(kernel, ref):
    """The kernel's tensor against the reference's: bitwise under the interpreter; on the GPU NaN where
    NaN and every value within a few roundings of the dtype (2 eps relative, plus 2 eps of the largest
    magnitude for cancellations in x*cos - x'*sin). A wrong rotation, head or slot is off by O(1)."""
    if not ON_GPU:
        return same(kernel, ref)
    eps = torch.finfo(ref.dtype).eps
    a, b = kernel.float().nan_to_num(0.0), ref.float().nan_to_num(0.0)
    tol = 2 * eps * b.abs() + 2 * eps * b.abs().max()
    return torch.equal(kernel.isnan(), ref.isnan()) and bool(((a - b).abs() <= tol).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,H,Hkv,D,S", CASES)
def test_matches_reference(B, T, H, Hkv, D, S, dtype):
    qkv, cos, sin, slots, poison = make(B, T, H, Hkv, D, S, dtype, seed=B * T * D + S)
    kc, vc, kr, vr = (poison.clone() for _ in range(4))
    q = rope_qkv(qkv, cos, sin, kc, vc, slots, H, Hkv)
    q_ref = rope_qkv_ref(qkv, cos, sin, kr, vr, slots, H, Hkv)
    assert q.shape == (B, H, T, D) and q.is_contiguous() and q.dtype == dtype
    assert match(q, q_ref)
    assert match(kc, kr) and same(vc, vr)
    written = torch.zeros(S, dtype=torch.bool, device=DEVICE)
    written[slots] = True
    assert not kc[:, :, written].isnan().any() and kc[:, :, ~written].isnan().all()
    v = qkv.view(B, T, H + 2 * Hkv, D)[:, :, H + Hkv:].transpose(1, 2)  # (B, Hkv, T, D)
    assert torch.equal(vc[:, :, slots], v)  # raw v, unrotated


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_ops_rope(dtype):
    """The reference's q and k are ops.rope of the split heads, i.e. the model's current path."""
    B, T, H, Hkv, D, S = 2, 6, 4, 2, 16, 8
    qkv, cos, sin, slots, poison = make(B, T, H, Hkv, D, S, dtype, seed=1)
    kc, vc = poison.clone(), poison.clone()
    q = rope_qkv_ref(qkv, cos, sin, kc, vc, slots, H, Hkv)
    x = qkv.view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # (B, heads, T, D)
    assert torch.equal(q, ops.rope(x[:, :H], cos, sin))
    assert torch.equal(kc[:, :, slots], ops.rope(x[:, H:H + Hkv], cos, sin))
    # And rope rotates each (d, d + D/2) pair by the position's angle: norms are kept.
    pair = lambda t: t.float().view(*t.shape[:-1], 2, D // 2).pow(2).sum(-2)  # noqa: E731
    torch.testing.assert_close(pair(q), pair(x[:, :H]), rtol=2e-2, atol=2e-2)


def test_int32_slots_and_strided_qkv():
    """int32 slots; qkv a (B, T) slice of a larger buffer (rows not packed back to back)."""
    B, T, H, Hkv, D, S = 2, 4, 4, 2, 16, 10
    big, cos, sin, slots, poison = make(B, T + 3, H, Hkv, D, S, torch.float16, seed=2)
    qkv, cos, sin, slots = big[:, 1:T + 1], cos[:T], sin[:T], slots[:T]
    kc, vc, kr, vr = (poison.clone() for _ in range(4))
    q = rope_qkv(qkv, cos, sin, kc, vc, slots.to(torch.int32), H, Hkv)
    assert match(q, rope_qkv_ref(qkv, cos, sin, kr, vr, slots, H, Hkv))
    assert match(kc, kr) and same(vc, vr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_second_destination(dtype):
    """The packed decode buffer as a second cache pair (another length, its own rows) gets the same
    k, v as the full cache; the full cache is written as without it."""
    B, T, H, Hkv, D, S = 2, 1, 4, 2, 16, 12
    qkv, cos, sin, slots, poison = make(B, T, H, Hkv, D, S, dtype, seed=5)
    rows = torch.tensor([4], device=DEVICE)
    k2, v2 = (torch.full((B, Hkv, 7, D), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    kc, vc, kr, vr = (poison.clone() for _ in range(4))
    q = rope_qkv(qkv, cos, sin, kc, vc, slots, H, Hkv, second=(k2, v2, rows))
    assert match(q, rope_qkv_ref(qkv, cos, sin, kr, vr, slots, H, Hkv))
    assert match(kc, kr) and same(vc, vr)
    assert torch.equal(k2[:, :, 4], kc[:, :, slots[0]]) and torch.equal(v2[:, :, 4], vr[:, :, slots[0]])
    assert k2[:, :, [0, 1, 2, 3, 5, 6]].isnan().all() and v2[:, :, [0, 1, 2, 3, 5, 6]].isnan().all()
    k3, v3 = (torch.full_like(k2, float("nan")) for _ in range(2))
    rope_qkv_ref(qkv, cos, sin, kr.clone(), vr.clone(), slots, H, Hkv, second=(k3, v3, rows))
    assert match(k2, k3) and same(v3, v2)


@pytest.mark.parametrize("heads_per_program", [1, 2, 8])
def test_launch_shapes_agree(heads_per_program):
    """Every head grouping (1 at decode on the GPU, 4 in prefill, all heads under the interpreter;
    a group may straddle the q/k boundary or run past the last head) gives the reference's bits."""
    B, T, H, Hkv, D, S = 2, 3, 6, 3, 16, 7
    qkv, cos, sin, slots, poison = make(B, T, H, Hkv, D, S, torch.bfloat16, seed=heads_per_program)
    kc, vc, kr, vr = (poison.clone() for _ in range(4))
    q = rope_qkv(qkv, cos, sin, kc, vc, slots, H, Hkv, heads_per_program=heads_per_program)
    assert match(q, rope_qkv_ref(qkv, cos, sin, kr, vr, slots, H, Hkv))
    assert match(kc, kr) and same(vc, vr)


@pytest.mark.gpu  # CUDA graphs
def test_graph_replay_follows_device_slots():
    """Captured once; the slot tensor is advanced in place between replays (the decode graph's way)."""
    B, H, Hkv, D, S = 1, 32, 8, 128, 16
    qkv, cos, sin, _, poison = make(B, 1, H, Hkv, D, S, torch.float16, seed=4)
    kc, vc = poison.clone(), poison.clone()
    slot = torch.zeros(1, dtype=torch.long, device=DEVICE)
    rope_qkv(qkv, cos, sin, kc, vc, slot, H, Hkv)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = rope_qkv(qkv, cos, sin, kc, vc, slot, H, Hkv)
    kc.fill_(float("nan"))
    for s in (3, 4, 9):
        slot.fill_(s)
        graph.replay()
    torch.cuda.synchronize()
    kr, vr = poison.clone(), poison.clone()
    q_ref = rope_qkv_ref(qkv, cos, sin, kr, vr, torch.tensor([3], device=DEVICE), H, Hkv)
    assert match(q, q_ref)
    for s in (3, 4, 9):
        assert match(kc[:, :, s], kr[:, :, 3])
    assert kc[:, :, [0, 1, 2, 5, 6, 7, 8, 10]].isnan().all()


def test_bad_input():
    qkv, cos, sin, slots, poison = make(1, 3, 4, 2, 16, 8, torch.float16, seed=0)
    with pytest.raises(ValueError, match="head dim"):
        rope_qkv(qkv[..., :-1], cos, sin, poison, poison, slots, 4, 2)
    with pytest.raises(ValueError, match="cos"):
        rope_qkv(qkv, cos[:2], sin, poison, poison, slots, 4, 2)
    with pytest.raises(ValueError, match="k_cache"):
        rope_qkv(qkv, cos, sin, poison[:, :1], poison, slots, 4, 2)
    with pytest.raises(ValueError, match="slots"):
        rope_qkv(qkv, cos, sin, poison, poison, slots.float(), 4, 2)
    with pytest.raises(TypeError, match="fp16 or bf16"):
        rope_qkv(qkv.float(), cos.float(), sin.float(), poison.float(), poison.float(), slots, 4, 2)
