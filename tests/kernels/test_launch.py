"""The prefill launchers' plans and direct launches (csrc_triton/launch.py): add_rms_norm, silu_mul, rope_qkv,
w4a16_gemm (fused and dequant paths), w4a16_dequant, retrieval_salience (gather, pipe; span and slots), kv_pack
(a K/V pair; one tensor with an int64 slot tensor).

On CPU, Triton's dispatch runs against a stub driver whose compiled kernels record their launches
(triton_stub.py, beside this file): after a call's first launch every launch is direct and carries exactly what
Triton's dispatch passes (grid, stream, kernel, arguments). On CUDA the real kernels run with and without
the direct launch, also under CUDA-graph capture, and must agree bit for bit, with no Triton dispatch
once planned. Bad calls raise on every call and leave no plan.
"""

import pytest
import torch

import csrc_triton.add_rms_norm as rms_mod
import csrc_triton.kv_pack as pack_mod
import csrc_triton.retrieval_salience as ret_mod
import csrc_triton.rope_qkv as rope_mod
import csrc_triton.silu_mul as silu_mod
import csrc_triton.w4a16_dequant as deq_mod
import csrc_triton.w4a16_gemm as gemm_mod
from csrc_triton.launch import Plans

from triton_stub import check_direct_launch, record_launches

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
KERNELS = {rms_mod: ["_add_rms_norm_kernel"], silu_mod: ["_silu_mul_kernel"], rope_mod: ["_rope_qkv_kernel"],
           gemm_mod: ["_w4a16_gemm_kernel"], deq_mod: ["_w4a16_dequant_kernel"],
           ret_mod: ["_retrieval_salience_kernel", "_retrieval_salience_pipe_kernel"], pack_mod: ["_kv_pack_kernel"]}


@pytest.fixture
def fresh_plans(monkeypatch):
    """Empty plan tables for the test, the modules' own restored afterwards."""
    tables = {}
    for mod in KERNELS:
        tables[mod] = Plans()
        monkeypatch.setattr(mod, "_PLANS", tables[mod])
    return tables


def _w4(N, K, G, g):
    qweight = torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32, generator=g).to(DEVICE)
    scales = (torch.rand(N, K // G, generator=g) / 32 + 1e-3).half().to(DEVICE)
    zeros = (-8 * scales.float()).contiguous()
    return qweight, scales, zeros


def _calls():
    """(name, thunk) per launcher and mode, small shapes; every thunk returns its outputs."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.float16):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    x, r, w = rnd(2, 5, 64), rnd(2, 5, 64), rnd(64)
    xt = rnd(64, 10).T  # (10, 64) with a non-unit last stride: the launcher copies it
    gate_up = rnd(3, 80)
    B, T, H, HKV, D, S = 1, 5, 4, 2, 16, 12
    qkv = rnd(B, T, (H + 2 * HKV) * D)
    cos, sin = rnd(T, D), rnd(T, D)
    caches = [rnd(B, HKV, S, D) for _ in range(4)]
    slots, slots2 = torch.arange(2, 2 + T, device=DEVICE), torch.arange(T, device=DEVICE, dtype=torch.int32)
    xm = rnd(5, 128)
    qw, sc, zr = _w4(64, 128, 32, g)
    bias = rnd(64)
    q, k, lse = rnd(1, 4, 3, 16), rnd(1, 2, 20, 16), torch.randn(1, 4, 3, generator=g).to(DEVICE) + 5
    idx = torch.tensor([7, 1, 19, 4, 4, 11], device=DEVICE)
    acc = torch.zeros(1, 2, 10, device=DEVICE)
    kv_src = [rnd(2, 1, HKV, S, D) for _ in range(2)]  # (layers, B, Hkv, S, D)
    kv_idx = torch.tensor([[0, 3, 4, 9, 11], [1, 2, 5, 6, 7]], device=DEVICE, dtype=torch.int32).expand(2, 1, 2, 5)

    def pack(src, slots, direct):
        dst = tuple(torch.zeros(2, 1, HKV, 8, D, device=DEVICE, dtype=torch.float16) for _ in src)
        return pack_mod.kv_pack(src if len(src) == 2 else src[0], slots, dst if len(dst) == 2 else dst[0],
                                direct=direct)

    def rope(second=None, direct=True):
        for c in caches:
            c.zero_()
        out = rope_mod.rope_qkv(qkv, cos, sin, caches[0], caches[1], slots, H, HKV, second=second, direct=direct)
        return (out, *(c.clone() for c in caches))

    return [  # each thunk takes the launchers' `direct` argument
        ("add_rms_norm", lambda direct=True: rms_mod.add_rms_norm(x, r, w, 1e-5, direct=direct)),
        ("add_rms_norm no residual", lambda direct=True: rms_mod.add_rms_norm(x, None, w, 1e-6, direct=direct)),
        ("add_rms_norm strided", lambda direct=True: rms_mod.add_rms_norm(xt, None, w, 1e-6, direct=direct)),
        ("silu_mul", lambda direct=True: silu_mod.silu_mul(gate_up, direct=direct)),
        ("silu_mul block", lambda direct=True: silu_mod.silu_mul(gate_up, block=16, direct=direct)),
        ("rope_qkv", rope),
        ("rope_qkv second", lambda direct=True: rope((caches[2], caches[3], slots2), direct)),
        ("w4a16_gemm", lambda direct=True: gemm_mod.w4a16_gemm(xm, qw, sc, zr, direct=direct)),
        ("w4a16_gemm bias split", lambda direct=True: gemm_mod.w4a16_gemm(
            xm, qw, sc, zr, bias, config=gemm_mod.Config(16, 64, 8, 2, 4, 1), direct=direct)),
        ("w4a16_gemm dequant", lambda direct=True: gemm_mod.w4a16_gemm(xm, qw, sc, zr, bias, path="dequant",
                                                                        direct=direct)),
        ("w4a16_dequant", lambda direct=True: deq_mod.w4a16_dequant(qw, sc, zr, direct=direct)),
        ("kv_pack pair", lambda direct=True: pack(tuple(kv_src), kv_idx.contiguous(), direct)),
        ("kv_pack one, int64 slots", lambda direct=True: pack(kv_src[:1], kv_idx.long(), direct)),
        ("retrieval span", lambda direct=True: ret_mod.retrieval_salience(q, k, range(3, 13), lse, direct=direct)),
        ("retrieval slots", lambda direct=True: ret_mod.retrieval_salience(q, k, idx, lse, direct=direct)),
        ("retrieval accumulate", lambda direct=True: ret_mod.retrieval_salience(q, k, range(5, 15), lse,
                                                                                 out=acc.clone(), direct=direct)),
        ("retrieval pipe chunks", lambda direct=True: ret_mod.retrieval_salience(q, k, idx, lse, impl="pipe",
                                                                                  block_m=2, direct=direct)),
    ]


# --- CPU: the direct launch against Triton's dispatch, with a recording stub driver ---------------------


@pytest.mark.cpu_only  # replaces the CUDA driver with a stub
def test_direct_launch_passes_what_triton_binds(fresh_plans, monkeypatch):
    """Per call: launched through Triton's dispatch (direct=False), then twice with direct=True: the first goes
    through dispatch (compiles), the second is direct and carries the same grid, stream, kernel and arguments."""
    launches = record_launches(monkeypatch, KERNELS)
    for name, call in _calls():
        assert check_direct_launch(launches, call, name) >= 1, name
    assert len(launches) == 4  # the pipe call: two question chunks, two launches each call


@pytest.mark.cpu_only  # replaces the CUDA driver with a stub
def test_launch_hooks_take_triton_dispatch(fresh_plans, monkeypatch):
    """With a launch hook (what a profiler installs) every launch goes through Triton's dispatch."""
    from triton import knobs

    launches = record_launches(monkeypatch, KERNELS)
    calls = dict(_calls())
    calls["silu_mul"]()
    hook, seen = knobs.runtime.launch_enter_hook, (lambda metadata: None)
    hook.add(seen)
    try:
        del launches[:]
        calls["silu_mul"]()
    finally:
        hook.remove(seen)
    calls["silu_mul"]()
    assert [v for _, v, *_ in launches] == ["triton", "direct"]


def test_cached_plans_give_identical_results(fresh_plans):
    """Each call cold (its plans built) and then twice more interleaved with the others (plans found):
    identical outputs; one plan per distinct call and launcher."""
    calls = _calls()
    cold = {}
    for name, call in calls:
        for table in fresh_plans.values():
            table.clear()
        cold[name] = call()
    for _ in range(2):
        for name, call in calls:
            out = call()
            out, ref = (out, cold[name]) if isinstance(out, tuple) else ((out,), (cold[name],))
            assert all(torch.equal(a, b) for a, b in zip(out, ref)), name
    assert {mod.__name__.split(".")[-1]: len(t) for mod, t in fresh_plans.items()} == {
        "add_rms_norm": 3, "silu_mul": 2, "rope_qkv": 2, "w4a16_gemm": 3, "w4a16_dequant": 2, "retrieval_salience": 4,
        "kv_pack": 2}


def test_bad_calls_raise_every_time(fresh_plans):
    """A bad call raises its error on every call and leaves no plan; a good call of the same launcher after
    it still works."""
    x, w = torch.randn(3, 64, device=DEVICE).half(), torch.randn(32, device=DEVICE).half()
    q, k, lse = (torch.randn(1, 4, 3, 16, device=DEVICE).half(), torch.randn(1, 2, 20, 16, device=DEVICE).half(),
                 torch.randn(1, 4, 3, device=DEVICE))
    qw, sc, zr = _w4(64, 128, 32, torch.Generator().manual_seed(1))
    for _ in range(2):
        with pytest.raises(ValueError, match="weight must be"):
            rms_mod.add_rms_norm(x, None, w, 1e-5)
        with pytest.raises(ValueError, match="even"):
            silu_mod.silu_mul(torch.randn(2, 7, device=DEVICE).half())
        with pytest.raises(ValueError, match="range idx"):
            ret_mod.retrieval_salience(q, k, range(10, 30), lse)
        with pytest.raises(ValueError, match="out must be"):
            gemm_mod.w4a16_gemm(torch.randn(5, 128, device=DEVICE).half(), qw, sc, zr,
                                out=torch.empty(5, 32, device=DEVICE).half())
        with pytest.raises(ValueError, match="idx"):
            pack_mod.kv_pack(torch.zeros(1, 2, 8, 16, device=DEVICE), torch.zeros(1, 3, 4, dtype=torch.int32,
                             device=DEVICE), torch.empty(1, 2, 4, 16, device=DEVICE))
    assert not any(fresh_plans.values())
    assert rms_mod.add_rms_norm(x, None, w.repeat(2), 1e-5)[0].shape == (3, 64)


def test_plans_follow_the_module_switches(fresh_plans, monkeypatch):
    """A module switch changed after a call (DEFAULT_IMPL, DEQUANT_MIN_M) takes effect on the next call."""
    q, k, lse = (torch.randn(1, 4, 3, 16, device=DEVICE).half(), torch.randn(1, 2, 20, 16, device=DEVICE).half(),
                 torch.randn(1, 4, 3, device=DEVICE))
    gather = ret_mod.retrieval_salience(q, k, range(2, 18), lse, tiles=1)  # tiles: kept on CUDA at once
    monkeypatch.setattr(ret_mod, "DEFAULT_IMPL", "pipe")
    pipe = ret_mod.retrieval_salience(q, k, range(2, 18), lse, tiles=1)
    plans = list(fresh_plans[ret_mod].values())
    assert [p.launches[0][2].fn.__name__ for p in plans] == ["_retrieval_salience_kernel",
                                                              "_retrieval_salience_pipe_kernel"]
    assert torch.allclose(gather, pipe, rtol=1e-3, atol=1e-5)


def test_plan_table_is_bounded(fresh_plans, monkeypatch):
    monkeypatch.setattr(silu_mod, "_PLANS", Plans(limit=2))
    gate_up = torch.randn(3, 8, device=DEVICE).half()
    outs = [silu_mod.silu_mul(gate_up[:m]) for m in (1, 2, 3, 1)]
    assert len(silu_mod._PLANS) <= 2
    assert torch.equal(outs[0], outs[3])


# --- CUDA: the real kernels with and without the direct launch ------------------------------------------


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.gpu
def test_direct_launch_is_bit_identical(fresh_plans):
    """Every call through Triton's dispatch and then through the direct launch, three times in sequence:
    identical outputs."""
    calls = _calls()
    for _, call in calls:  # retrieval's first call on a device learns its programs per SM (_RESIDENT)
        call()
    ref = {name: _flat(call(direct=False)) for name, call in calls}
    for _ in range(3):
        for name, call in calls:
            assert all(torch.equal(a, b) for a, b in zip(_flat(call()), ref[name])), name


@pytest.mark.gpu
def test_direct_launch_skips_triton_dispatch(fresh_plans, monkeypatch):
    """After the first call, a call makes no Triton dispatch at all (JITFunction.run would raise)."""
    calls = _calls()
    for _, call in calls:  # retrieval's first call on a device learns its programs per SM and is not kept
        call()
    first = {name: _flat(call()) for name, call in calls}

    def no_dispatch(*args, **kwargs):
        raise AssertionError("Triton dispatch on a planned call")

    for mod, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(getattr(mod, name), "run", no_dispatch)
    for name, call in calls:
        assert all(torch.equal(a, b) for a, b in zip(_flat(call()), first[name])), name
    with pytest.raises(AssertionError, match="dispatch"):
        calls[0][1](direct=False)


@pytest.mark.gpu  # CUDA graphs
def test_direct_launch_in_a_cuda_graph(fresh_plans):
    """Captured (as the prefill and decode graphs run them) and replayed: the eager results."""
    calls = [c for c in _calls() if c[0] in ("add_rms_norm", "silu_mul", "w4a16_gemm bias split", "w4a16_gemm",
                                             "retrieval span", "retrieval slots")]
    for _, call in calls:  # workspaces grown, kernels compiled and plans kept before capture
        call()
    eager = {name: _flat(call()) for name, call in calls}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {name: _flat(call()) for name, call in calls}
    graph.replay()
    torch.cuda.synchronize()
    for name, _ in calls:
        assert all(torch.equal(a, b) for a, b in zip(outs[name], eager[name])), name
