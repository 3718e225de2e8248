"""Prefill-salience launcher: per-call plans (_PLANS) and the direct compiled-kernel launch.

Plans must not change a result: a sequence of calls over shapes, dtypes and modes gives bit-identical
output whether each call built its plan fresh or found it cached. The direct launch must pass the
compiled kernel exactly what Triton's dispatch passes: on CPU Triton's dispatch runs against a stub
driver and compiled kernels whose launcher records its arguments; on CUDA the real kernels run with and
without the direct launch, under CUDA-graph capture too, and must agree bit for bit.
"""

import pytest
import torch

import csrc_triton.prefill_salience as km
from csrc_triton.launch import Plans
from csrc_triton.prefill_salience import prefill_salience

from triton_stub import check_direct_launch, record_launches  # shared with test_launch.py

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture
def fresh_plans(monkeypatch):
    """An empty plan table for the test, the module's own restored afterwards."""
    monkeypatch.setattr(km, "_PLANS", Plans())
    return km._PLANS


def _qk(B, H, N, D, dtype, seed, offset=0):
    """q, k of (B, H, N, D); offset > 0: views `offset` elements into a buffer (2-byte aligned for fp16)."""
    g = torch.Generator().manual_seed(seed)
    n = B * H * N * D
    buf = (2 * torch.randn(2 * n + 2 * offset, generator=g)).to(DEVICE, dtype)
    return buf[offset:offset + n].view(B, H, N, D), buf[n + 2 * offset:].view(B, H, N, D)


def _lse(q, k, M):
    s = q[:, :, :M].double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.logsumexp(s, -1).float()  # (B, H, M)


def _sequence():
    """(name, thunk) calls that differ in every part of the plan key: shape, dtype, strides, n_query,
    the caller's LSE (unit-stride and not), tiles, scale."""
    q1, k1 = _qk(1, 2, 197, 72, torch.float16, 1)
    q2, k2 = _qk(2, 3, 123, 64, torch.bfloat16, 2)
    q3, k3 = _qk(1, 2, 100, 80, torch.float32, 3)
    qkv = torch.randn(2, 57, 3, 2, 72, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.float16)
    qv, kv, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, D) views of a fused projection
    lse1 = _lse(q1, k1, 197)
    lse_strided = torch.empty(1, 2, 197, 2, device=DEVICE)[..., 0].copy_(lse1)  # stride 2 along rows
    return [  # each thunk takes the launcher's `direct` argument
        ("fp16", lambda direct=True: prefill_salience(q1, k1, direct=direct)),
        ("bf16", lambda direct=True: prefill_salience(q2, k2, direct=direct)),
        ("fp32", lambda direct=True: prefill_salience(q3, k3, direct=direct)),
        ("qkv views", lambda direct=True: prefill_salience(qv, kv, direct=direct)),
        ("qkv views copied", lambda direct=True: prefill_salience(qv.contiguous(), kv.contiguous(),
                                                                  direct=direct)),  # strides alone differ
        ("n_query 3", lambda direct=True: prefill_salience(q1, k1, n_query=3, direct=direct)),
        ("lse", lambda direct=True: prefill_salience(q1, k1, lse=lse1, direct=direct)),
        ("lse strided", lambda direct=True: prefill_salience(q1, k1, lse=lse_strided, direct=direct)),
        ("tiles", lambda direct=True: prefill_salience(q1, k1, tiles=(32, 16, 4, 3), direct=direct)),
        ("scale", lambda direct=True: prefill_salience(q3, k3, scale=0.05, direct=direct)),
    ]


def test_cached_plans_give_identical_results(fresh_plans):
    """Each call of the sequence, cold (its plan built) and then twice more interleaved with the others
    (its plan found): bit-identical outputs, and one plan per distinct call."""
    calls = _sequence()
    cold = {}
    for name, call in calls:
        fresh_plans.clear()
        cold[name] = call()
    fresh_plans.clear()
    for _ in range(2):
        for name, call in calls:
            out = call()
            assert torch.equal(out, cold[name]), name
    assert len(fresh_plans) == len(calls)
    assert all(torch.isfinite(o).all() for o in cold.values())


def test_plans_follow_the_module_switches(fresh_plans, monkeypatch):
    """DEFAULT_TILES (and the other switches in the key) changed after a call take effect on the next."""
    q, k = _qk(1, 2, 150, 64, torch.float16, 5)
    prefill_salience(q, k)
    monkeypatch.setattr(km, "DEFAULT_TILES", (32, 16, 4, 3))
    out = prefill_salience(q, k)
    assert len(fresh_plans) == 2
    assert [p.pass2.meta["BLOCK_R"] for p in fresh_plans.values()] == [128, 32]
    assert torch.equal(out, prefill_salience(q, k, tiles=(32, 16, 4, 3)))


def test_bad_calls_are_not_cached(fresh_plans):
    q, k = _qk(1, 2, 20, 64, torch.float16, 6)
    for _ in range(2):
        with pytest.raises(ValueError, match="n_query"):
            prefill_salience(q, k, n_query=21)
    assert not fresh_plans


def test_plan_table_is_bounded(fresh_plans):
    fresh_plans.limit = 2
    q, k = _qk(1, 1, 40, 64, torch.float16, 7)
    outs = [prefill_salience(q, k, n_query=m) for m in (1, 2, 3, 1)]
    assert len(fresh_plans) <= 2
    assert torch.equal(outs[0], outs[3])


# --- the direct launch against Triton's dispatch, on CPU with a recording stub driver -------------------


@pytest.mark.cpu_only  # replaces the CUDA driver with a stub
def test_direct_launch_passes_what_triton_binds(fresh_plans, monkeypatch):
    """Per call of the sequence (plus a 2-byte-aligned q): launched through Triton's dispatch (direct=False),
    then twice with direct=True: the direct launches carry the same grid, stream, kernel and arguments
    (constexprs in parameter order) as Triton's, and only a new alignment goes through dispatch again."""
    launches = record_launches(monkeypatch, {km: ("_row_lse_kernel", "_prefill_salience_kernel")})
    calls = _sequence()
    q, k = _qk(1, 2, 197, 72, torch.float16, 1, offset=1)
    assert q.data_ptr() % 16 != 0
    calls.append(("fp16 unaligned", lambda direct=True: prefill_salience(q, k, direct=direct)))
    for name, call in calls:
        assert check_direct_launch(launches, call, name) in (1, 2), name
    # One plan (the fp16 call's) has two compiled kernels: 16-byte aligned q and the unaligned view.
    assert sorted(len(p.pass2.compiled) for p in fresh_plans.values()) == [1] * (len(calls) - 2) + [2]


@pytest.mark.cpu_only  # replaces the CUDA driver with a stub
def test_launch_hooks_take_triton_dispatch(fresh_plans, monkeypatch):
    """With a launch hook (what a profiler installs) every launch goes through Triton's dispatch."""
    from triton import knobs

    launches = record_launches(monkeypatch, {km: ("_row_lse_kernel", "_prefill_salience_kernel")})
    q, k = _qk(1, 2, 64, 64, torch.float16, 8)
    prefill_salience(q, k)
    hook, seen = knobs.runtime.launch_enter_hook, (lambda metadata: None)
    hook.add(seen)
    try:
        del launches[:]
        prefill_salience(q, k)
    finally:
        hook.remove(seen)
    assert [v for _, v, *_ in launches] == ["triton", "triton"]


# --- on CUDA: the real kernels with and without the direct launch ---------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 16, 729, 72), (8, 16, 729, 72), (1, 16, 4096, 80)],
                         ids=lambda s: "x".join(map(str, s)))
def test_direct_launch_is_bit_identical(shape, fresh_plans):
    """The sequence, SigLIP-sized shapes and a 2-byte-aligned q (its own compiled kernel): identical outputs
    through Triton's dispatch and the direct launch, in sequence, twice."""
    q, k = _qk(*shape, torch.float16, 9)
    qu, ku = _qk(*shape, torch.float16, 9, offset=1)
    calls = _sequence() + [("shape", lambda direct=True: prefill_salience(q, k, direct=direct)),
                           ("unaligned", lambda direct=True: prefill_salience(qu, ku, direct=direct))]
    ref = {name: call(direct=False) for name, call in calls}
    for _ in range(3):
        for name, call in calls:
            assert torch.equal(call(), ref[name]), name


@pytest.mark.gpu
def test_direct_launch_skips_triton_dispatch(fresh_plans, monkeypatch):
    """After the first call, a call makes no Triton dispatch at all (JITFunction.run would raise)."""
    q, k = _qk(1, 16, 729, 72, torch.float16, 10)
    first = prefill_salience(q, k)

    def no_dispatch(*args, **kwargs):
        raise AssertionError("Triton dispatch on a planned call")

    for fn in (km._row_lse_kernel, km._prefill_salience_kernel):
        monkeypatch.setattr(fn, "run", no_dispatch)
    assert torch.equal(prefill_salience(q, k), first)
    with pytest.raises(AssertionError, match="dispatch"):
        prefill_salience(q, k, direct=False)


@pytest.mark.gpu  # CUDA graphs
def test_direct_launch_in_a_cuda_graph(fresh_plans):
    """Captured (as the encoder and the bench's graph column run it) and replayed: the eager result."""
    q, k = _qk(1, 16, 729, 72, torch.float16, 11)
    lse = _lse(q, k, 729)
    eager = (prefill_salience(q, k), prefill_salience(q, k, lse=lse))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = (prefill_salience(q, k), prefill_salience(q, k, lse=lse))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1])
