"""csrc_triton.w4a16_gemv_rope (RoPE + KV-cache write in the qkv GEMV's epilogue) against the two launches it
replaces: w4a16_gemv (same config), then csrc_triton.rope_qkv.rope_qkv on its output; and against its reference.

Bit for bit: q, the k/v caches and the second (packed) pair, at the given slots; the caches are poisoned with NaN
so a missing or misplaced write fails, and their other slots must stay NaN. Both sides store the GEMV's value
with the same cast (under the interpreter a bf16 cast truncates, on both sides). RoPE's arithmetic: under the
interpreter both run rope_qkv.rope_halves; on the GPU the epilogue runs the FMA form rope_halves compiles to in
rope_qkv (_w4a16_gemv_epilogue._rope_halves_as_rope_qkv), which the interpreter cannot check: the GPU cases below do,
at the launcher's tile and other one-tile-per-warp tiles (two 16-row tiles per warp are refused by rope_ok).
CPU: the interpreter at small shapes (H 4, Hkv 2, D 64/128, K 256/512, M 1 and 3, T 1 and 3,
fp16/bf16, bias, prenorm, second pair, split-K, 1 or 2 programs per head). CUDA: Llama-3-8B's qkv (H 32, Hkv 8,
D 128, K 4096) with the launcher's own config and with other configs rope_ok accepts, and a CUDA-graph replay with
the slot advanced. Also the decoder's wiring (Options.fused_rope_gemv in decode_step.block_fused) through ops' PyTorch
forms on CPU.
"""

import dataclasses

import pytest
import torch
from _w4_check import assert_nearly_equal, make
from conftest import DEVICE, ON_GPU

from csrc_triton import w4a16_gemv_rope as rope_mod
from csrc_triton.rope_qkv import rope_qkv
from csrc_triton.w4a16_gemv import INTERPRET_CONFIG, INTERPRET_MMA_CONFIG, gemv_config, w4a16_gemv
from csrc_triton.w4a16_gemv_rope import rope_ok, w4a16_gemv_rope, w4a16_gemv_rope_ref

MMA, FMA = INTERPRET_MMA_CONFIG, INTERPRET_CONFIG
S = 11  # cache slots
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def tables(T, D, dtype, positions):
    """cos, sin (T, D) as text.rope_cos_sin builds them: fp32 angles, cast once."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = positions.float()[:, None] * inv
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


def setup(B, T, H, Hkv, D, K, dtype, bias, prenorm, second, seed):
    """Inputs of one call: the W4 qkv weight, x (B T, K), tables, slots, and two NaN-poisoned copies of every
    cache (one per side)."""
    N = (H + 2 * Hkv) * D
    a = make(B * T, N, K, 128, dtype, seed=seed, bias=bias, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(S, generator=g)[:T].sort().values.to(DEVICE)
    cos, sin = tables(T, D, dtype, slots.cpu() + 500)
    n_pairs = 2 if second else 1
    poison = [torch.full((B, Hkv, S, D), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2 * n_pairs)]
    rows = torch.randperm(S, generator=g)[:T].to(DEVICE)  # the packed buffer's rows: any order
    pn = (torch.rand(3, 8, generator=g).to(DEVICE) * 300, 1e-5) if prenorm else None
    return a, cos, sin, slots, rows, poison, pn


def both(a, cos, sin, slots, rows, poison, pn, H, Hkv, cfg, B, T):
    """(fused outputs, reference outputs): each (q, k, v[, k2, v2])."""
    args = (a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"])
    mine = [c.clone() for c in poison]
    ref = [c.clone() for c in poison]
    sec = (mine[2], mine[3], rows) if len(poison) == 4 else None
    q = w4a16_gemv_rope(*args, cos, sin, mine[0], mine[1], slots, H, Hkv, second=sec, prenorm=pn, config=cfg)
    y = w4a16_gemv(*args, config=cfg, prenorm=pn)
    sec = (ref[2], ref[3], rows) if len(poison) == 4 else None
    q_ref = rope_qkv(y.view(B, T, -1), cos, sin, ref[0], ref[1], slots, H, Hkv, second=sec)
    return [q, *mine], [q_ref, *ref]


def assert_same(mine, ref, slots, rows):
    """Bit-identical outputs (NaN == NaN for the untouched slots) on the GPU; under the interpreter the written
    values as _w4_check.assert_nearly_equal allows (numpy's matmul may sum a row differently at another
    place in the tile, and the fused tile's row map differs from the plain GEMV's). Every target slot written,
    others not, everywhere."""
    for i, (x, r) in enumerate(zip(mine, ref)):
        assert x.shape == r.shape and x.dtype == r.dtype
        assert torch.equal(x.isnan(), r.isnan()), f"output {i}: written elements differ"
        if ON_GPU:
            ne = (x != r) & ~x.isnan()
            assert not ne.any(), f"output {i}: {int(ne.sum())} of {x.numel()} elements differ"
        else:
            w = ~x.isnan()
            assert_nearly_equal(x[w], r[w])
    assert not mine[0].isnan().any()
    for i, cache in enumerate(mine[1:]):
        at = slots if i < 2 else rows
        written = torch.zeros(cache.shape[2], dtype=torch.bool, device=cache.device)
        written[at] = True
        assert not cache[:, :, written].isnan().any(), f"cache {i}: a target slot was not written"
        assert cache[:, :, ~written].isnan().all(), f"cache {i}: a slot outside the targets was written"


CASES = [  # B, T, D, K, bias, prenorm, second, config
    (1, 1, 128, 256, True, True, False, MMA),
    (1, 1, 64, 256, False, True, True, MMA),
    (3, 1, 64, 256, True, False, True, MMA),
    (1, 3, 128, 256, True, True, True, MMA),
    (1, 1, 64, 512, True, True, True, {**MMA, "SPLIT_K": 2}),  # split-K: the last program's epilogue
    (3, 1, 128, 256, False, True, True, {**MMA, "BLOCK_N": 32, "num_warps": 2}),  # 2 warps, 2 programs a head
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,T,D,K,bias,prenorm,second,cfg", CASES)
def test_rope_epilogue_equals_gemv_then_rope_qkv(B, T, D, K, bias, prenorm, second, cfg, dtype):
    H, Hkv = 4, 2
    a, cos, sin, slots, rows, poison, pn = setup(B, T, H, Hkv, D, K, dtype, bias, prenorm, second, seed=B * 7 + D)
    mine, ref = both(a, cos, sin, slots, rows, poison, pn, H, Hkv, cfg, B, T)
    assert mine[0].shape == (B, H, T, D) and mine[0].is_contiguous()
    assert_same(mine, ref, slots, rows)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_reference_closely(dtype):
    """The kernel (no rounding of w) and w4a16_gemv_rope_ref (w rounded to the dtype, then rope_qkv_ref) differ by
    the GEMV's rounding only, carried through RoPE: q and the written cache rows close, the same slots written."""
    H, Hkv, D, B, T = 4, 2, 64, 1, 3
    a, cos, sin, slots, rows, poison, pn = setup(B, T, H, Hkv, D, 256, dtype, True, True, True, seed=17)
    args = (a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"], cos, sin)
    mine, ref = [c.clone() for c in poison], [c.clone() for c in poison]
    q = w4a16_gemv_rope(*args, mine[0], mine[1], slots, H, Hkv, second=(mine[2], mine[3], rows), prenorm=pn,
                        config=MMA)
    q_ref = w4a16_gemv_rope_ref(*args, ref[0], ref[1], slots, H, Hkv, second=(ref[2], ref[3], rows), prenorm=pn)
    for x, r in zip([q, *mine], [q_ref, *ref]):
        assert x.shape == r.shape and torch.equal(x.isnan(), r.isnan())
        w = ~r.isnan()
        torch.testing.assert_close(x[w], r[w], rtol=2e-2, atol=2e-2 * r[w].abs().max().item())


def test_rope_ok_and_rejects():
    assert rope_ok(1024, 256, 128, MMA, 128) and rope_ok(512, 256, 128, MMA, 64)
    assert not rope_ok(1024, 256, 128, FMA, 128)  # the fma kernel has no row map
    assert not rope_ok(8 * 48, 256, 128, MMA, 48)  # D / 2 = 24 is not whole half-tiles of 32 rows
    assert not rope_ok(1024, 256, 128, {**MMA, "BLOCK_N": 128}, 64)
    for bn, w in ((128, 4), (64, 2), (32, 1)):  # two 16-row tiles per warp: refused (rope_ok's docstring)
        assert not rope_ok(6144, 4096, 128, {**MMA, "BLOCK_N": bn, "num_warps": w}, 128)
    H, Hkv, D = 4, 2, 32
    a, cos, sin, slots, rows, poison, pn = setup(1, 1, H, Hkv, D, 256, torch.float16, False, False, False, seed=5)
    args = (a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"])
    with pytest.raises(ValueError, match="w4a16_gemv_rope needs"):
        w4a16_gemv_rope(*args, cos, sin, poison[0], poison[1], slots, H, Hkv, config=MMA)
    with pytest.raises(ValueError, match="rows are not B x T"):
        w4a16_gemv_rope(*args, cos.expand(2, D), sin.expand(2, D), poison[0], poison[1], slots, H, Hkv, config=MMA)
    with pytest.raises(ValueError, match="k_cache must be"):
        w4a16_gemv_rope(*args, cos, sin, poison[0][:, :1], poison[1], slots, H, Hkv, config=MMA)


@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,T,bias,second", [(1, 1, False, True), (1, 1, True, False), (2, 1, False, True),
                                              (8, 1, True, True), (2, 3, False, False)])
def test_llama3_8b_qkv(B, T, bias, second, dtype):
    """Llama-3-8B's qkv (6144 x 4096, H 32, Hkv 8, D 128) with the launcher's config: torch.equal to the GEMV
    followed by the rope_qkv kernel, prenorm on (the decode chain's form)."""
    H, Hkv, D = 32, 8, 128
    cfg = gemv_config(B * T, 6144, 4096, 128)
    assert rope_ok(6144, 4096, 128, cfg, D)
    a, cos, sin, slots, rows, poison, _ = setup(B, T, H, Hkv, D, 4096, dtype, bias, False, second, seed=B + 40)
    pn = (torch.rand(64, 8, device=DEVICE) * 50, 1e-5)
    mine, ref = both(a, cos, sin, slots, rows, poison, pn, H, Hkv, cfg, B, T)
    assert_same(mine, ref, slots, rows)


@pytest.mark.gpu  # real shapes: too slow for the interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [3, 8])
@pytest.mark.parametrize("tile", [(128, 8), (32, 2), (64, 4)], ids=lambda t: f"BN{t[0]}w{t[1]}")
def test_llama3_8b_qkv_other_configs(tile, M, dtype):
    """Llama-3-8B's qkv under other configs rope_ok accepts (one 16-row tile per warp; one or four programs a
    head) besides the launcher's BLOCK_N 64 with 4 warps, M >= 3. Two tiles per warp (BLOCK_N = 32 num_warps),
    refused by rope_ok, is where the epilogue's x1 and x2 reached RoPE through different layout conversions and
    came out 1 ulp off (fp16 and bf16 before the FMA form, 2 of 32768 bf16 values at M 8 after)."""
    H, Hkv, D = 32, 8, 128
    cfg = {"kernel": "mma", "BLOCK_N": tile[0], "num_warps": tile[1], "STAGES": 3, "SPLIT_K": 1, "GPS": 8}
    assert rope_ok(6144, 4096, 128, cfg, D)
    a, cos, sin, slots, rows, poison, _ = setup(M, 1, H, Hkv, D, 4096, dtype, False, False, True, seed=M + 60)
    pn = (torch.rand(64, 8, device=DEVICE) * 50, 1e-5)
    mine, ref = both(a, cos, sin, slots, rows, poison, pn, H, Hkv, cfg, M, 1)
    assert_same(mine, ref, slots, rows)


@pytest.mark.gpu  # CUDA graphs
def test_cuda_graph_replay_reads_the_slot():
    """Captured once, replayed with the slot and row tensors advanced in place: each replay writes its slot."""
    H, Hkv, D, dtype = 32, 8, 128, torch.float16
    a, cos, sin, slots, rows, poison, _ = setup(1, 1, H, Hkv, D, 4096, dtype, True, False, True, seed=3)
    args = (a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"])
    k, v, k2, v2 = poison
    slot, row = torch.zeros(1, dtype=torch.long, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE)
    call = lambda: w4a16_gemv_rope(*args, cos, sin, k, v, slot, H, Hkv, second=(k2, v2, row))  # noqa: E731
    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = call()
    for s in (4, 7):
        slot.fill_(s)
        row.fill_(s - 3)
        graph.replay()
    torch.cuda.synchronize()
    kr, vr, k2r, v2r = (torch.full_like(c, float("nan")) for c in poison)
    q_ref = rope_qkv(w4a16_gemv(*args).view(1, 1, -1), cos, sin, kr, vr, torch.tensor([7], device=DEVICE), H, Hkv,
                     second=(k2r, v2r, torch.tensor([4], device=DEVICE)))
    assert torch.equal(q, q_ref)
    for c, r, s in ((k, kr, 7), (v, vr, 7), (k2, k2r, 4), (v2, v2r, 4)):
        assert torch.equal(c[:, :, s], r[:, :, s])
    assert not k[:, :, 4].isnan().any() and not k2[:, :, 1].isnan().any()  # the first replay's writes stay
    assert k[:, :, 5].isnan().all() and v2[:, :, 5].isnan().all()  # (slot and row 0: the eager call's)


# -- the decoder's wiring (CPU: ops' PyTorch forms) -------------------------------------------------------------
@pytest.fixture(scope="module")
def w4_model(tmp_path_factory):
    from tinyvila.config import QuantConfig, preset
    from tinyvila.loader import build_synthetic, load_model

    cfg = dataclasses.replace(preset("tiny-siglip-llama"), quant=QuantConfig(llm="w4a16", group_size=32))
    folder = build_synthetic(tmp_path_factory.mktemp("rope") / "tiny-w4", cfg, seed=4)
    return load_model(folder, dtype=torch.float32)


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    """Wrap owner.name so that each call adds one to the returned one-element list."""
    calls, fn = [0], getattr(owner, name)

    def counted(*a, **k):
        calls[0] += 1
        return fn(*a, **k)
    monkeypatch.setattr(owner, name, counted)
    return calls


def _decode(model, fused_rope: bool, monkeypatch, steps: int = 3):
    """Prefill 10 tokens, `steps` greedy decode steps on the fused norm chain -> (logits, w4a16_linear_rope calls)."""
    from tinyvila import ops
    from tinyvila.generate import Decoder
    from tinyvila.options import Options

    model.set_options(Options(fused_norm_gemv="on", fused_rope_gemv=fused_rope))
    calls = _count_calls(monkeypatch, ops, "w4a16_linear_rope")
    text = model.text
    dec = Decoder(text, cuda_graph=False)
    logits = dec.prefill(text.embed(torch.arange(3, 13)[None]))
    calls[0] = 0
    out = []
    for _ in range(steps):
        logits = dec.step(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
        out.append(logits.reshape(-1))
    return out, calls[0]


def test_decoder_takes_the_rope_op_when_switched_on(w4_model, monkeypatch):
    """decode_step.block_fused: every layer's qkv goes through ops.w4a16_linear_rope with the step's cache
    targets, which with Options.fused_rope_gemv off falls back to the GEMV then rope_qkv; on CPU both forms are
    that pair, so the logits are the same bits."""
    plain, n_plain = _decode(w4_model, False, monkeypatch)
    fused, n_fused = _decode(w4_model, True, monkeypatch)
    assert n_plain == n_fused == 3 * w4_model.cfg.text.n_layers
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


@pytest.mark.gpu  # the fused kernel path
@pytest.mark.parametrize("name", ["tiny-siglip-llama", "tiny-clip-qwen2"])  # Qwen2: the qkv bias
def test_graph_decode_same_logits_with_rope_in_the_gemv(name, monkeypatch):
    """A W4 (G 128) fp16 decoder widened so that the qkv GEMV can end in RoPE (K 256, D 64): CUDA-graph decode
    steps give the same logits bits with Options.fused_rope_gemv on (the kernel path really taken) as off."""
    from tinyvila.options import Options, set_options

    text = _tiny_w4_text(name)
    calls = _count_calls(monkeypatch, rope_mod, "w4a16_gemv_rope")
    out = {}
    for on in (False, True):
        set_options(text, Options(fused_rope_gemv=on))
        out[on] = _graph_steps(text)
        assert (calls[0] > 0) == on
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)


def _tiny_w4_text(name: str):
    from tinyvila.api import from_config
    from tinyvila.config import QuantConfig, preset

    base = preset(name)
    cfg = dataclasses.replace(base, text=dataclasses.replace(base.text, dim=256, ffn_dim=512), vision=None,
                              projector=None, dtype="float16",
                              quant=QuantConfig(llm="w4a16", vision="none", group_size=128))
    return from_config(cfg, device=DEVICE).model.text


def _graph_steps(text, steps: int = 4) -> list[torch.Tensor]:
    from tinyvila.generate import Decoder

    dec = Decoder(text, cuda_graph=ON_GPU)
    logits = dec.prefill(text.embed(torch.arange(3, 13, device=DEVICE)[None]))
    out = []
    for _ in range(steps):
        logits = dec.step(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
        out.append(logits.reshape(-1).clone())
    return out
