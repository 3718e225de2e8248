"""tinyvila.quant: the packed W4 format, RTN quantization, W4A16Linear, swap_linears, and W4 checkpoints.

Run: pytest tests/test_quant.py. Everything runs on CPU through the reference path of
ops.w4a16_linear; the last test also runs the CUDA dispatch (GEMV for M <= 8, GEMM above) on a GPU.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import tinyvila
from scripts.quantize import main as quantize_main
from tinyvila import ops, quant
from tinyvila.config import QuantConfig, preset
from tinyvila.errors import CheckpointError
from tinyvila.generate import Decoder, SamplingParams
from tinyvila.loader import build_synthetic, expected_tensors, load_model, random_state_dict
from tinyvila.quant import (LLM_LINEARS, W4A16Linear, dequantize_w4, pack_int4, quantize_w4, swap_linears,
                            unpack_int4)
from tinyvila.vlm import VLM

W4 = QuantConfig(llm="w4a16", group_size=32)


def w4_cfg(name: str, group_size: int = 32):
    return dataclasses.replace(preset(name), quant=QuantConfig(llm="w4a16", group_size=group_size))


# -- format ------------------------------------------------------------------------------------------
def test_pack_unpack_round_trip_every_value_in_every_nibble():
    N, K = 48, 64
    n, k = torch.arange(N)[:, None], torch.arange(K)[None, :]
    q = (n + k // 8 + 3 * (k % 8)) % 16  # rows 0..15: every value at every nibble position i = k % 8
    q[16:] = torch.randint(0, 16, (N - 16, K), generator=torch.Generator().manual_seed(0))
    for i in range(8):
        assert set(q[:16, i::8].flatten().tolist()) == set(range(16))
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (N, K // 8)
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))


def test_pack_layout_is_the_documented_one():
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15, 0, 0, 0, 0, 0, 0, 0, 9]])
    expected = [sum(v << (4 * i) for i, v in enumerate(q[0, j:j + 8].tolist())) for j in (0, 8)]
    expected = [w - 2**32 if w >= 2**31 else w for w in expected]  # int32 two's complement
    assert pack_int4(q).tolist() == [expected]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(2, 12, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.full((2, 8), 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [32, 64, 128])
def test_quantize_error_is_at_most_half_a_step(G, dtype):
    g = torch.Generator().manual_seed(G)
    w = (torch.randn(37, 4 * G, generator=g) * 0.1 + torch.randn(37, 1, generator=g) * 0.05).to(dtype)
    p = quantize_w4(w, G, dtype=dtype)
    assert p["scales"].dtype == dtype and p["zeros"].dtype == torch.float32
    deq = dequantize_w4(p["qweight"], p["scales"], p["zeros"], torch.float32)  # before the final rounding
    s = p["scales"].float().repeat_interleave(G, 1)
    # s/2, plus the slack of a scale rounded to `dtype` (the range is 15 steps of the rounded scale).
    slack = 16 * s * torch.finfo(dtype).eps
    assert ((w.float() - deq).abs() <= s / 2 + slack).all()
    assert (unpack_int4(p["qweight"]).int().amax(1) == 15).all()  # the range is used in full


def test_quantize_rejects_bad_groups():
    with pytest.raises(ValueError, match="group size 16"):
        quantize_w4(torch.randn(4, 64), 16)
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        quantize_w4(torch.randn(4, 96), 64)


# -- W4A16Linear ---------------------------------------------------------------------------------------
def _w4_linear(N=24, K=128, G=64, bias=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = quantize_w4(torch.randn(N, K, generator=g) * 0.05, G, dtype=dtype)
    if bias:
        sd["bias"] = torch.randn(N, generator=g).to(dtype)
    with torch.device("meta"):
        lin = W4A16Linear(K, N, bias=bias, group_size=G, dtype=dtype)
    assert all(t.is_meta for t in lin.state_dict().values())
    lin.load_state_dict(sd, assign=True, strict=True)
    return lin, sd


def test_w4_linear_equals_dense_linear_on_dequantized_weight():
    lin, sd = _w4_linear()
    assert not any(t.is_meta for t in lin.state_dict().values())
    x = torch.randn(2, 5, 128)
    dense = F.linear(x, dequantize_w4(sd["qweight"], sd["scales"], sd["zeros"]), sd["bias"])
    y = lin(x)
    assert y.shape == (2, 5, 24)
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-6)
    assert (y - F.linear(x, dequantize_w4(sd["qweight"], sd["scales"] * 1.01, sd["zeros"]), sd["bias"])).abs().max() > 1e-3


def test_w4_linear_cast_keeps_zeros_fp32_and_packed_ints():
    lin, sd = _w4_linear()
    lin = lin.to(torch.float16)
    assert lin.qweight.dtype == torch.int32 and torch.equal(lin.qweight, sd["qweight"])
    assert lin.zeros.dtype == torch.float32 and torch.equal(lin.zeros, sd["zeros"])
    assert lin.scales.dtype == torch.float16 and lin.bias.dtype == torch.float16
    assert list(lin.state_dict()) == ["bias", "qweight", "scales", "zeros"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_w4_cpu_cache_is_the_dense_linear_and_dequantizes_once(dtype, monkeypatch):
    """Options.w4_cpu_cache: the dense weights are made on the first call and reused, and the linear is then bit for
    bit F.linear with them (the dense model's linear), within rounding of the fp32 reference path; a cast or new
    weights make them again."""
    lin, sd = _w4_linear(dtype=dtype)
    x = torch.randn(3, 128).to(dtype)
    plain = lin(x)
    lin.options = tinyvila.Options(w4_cpu_cache=True)
    calls = []
    real = ops.w4_reference_weight
    monkeypatch.setattr(ops, "w4_reference_weight", lambda *a: calls.append(a[-1]) or real(*a))
    dense = F.linear(x, dequantize_w4(sd["qweight"], sd["scales"], sd["zeros"]).to(dtype), sd["bias"])
    y = lin(x)
    assert torch.equal(y, dense) and torch.equal(lin(x[:1]), F.linear(x[:1], dequantize_w4(
        sd["qweight"], sd["scales"], sd["zeros"]).to(dtype), sd["bias"]))
    torch.testing.assert_close(y, plain, **({} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}))
    assert calls == [dtype]  # one dequantization for both calls
    lin.to(torch.float64)
    assert lin(x.double()).dtype == torch.float64 and calls == [dtype, torch.float64]


needs_int4_cpu = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                    reason="this torch has no packed-int4 CPU matmul (aten._weight_int4pack_mm_for_cpu)")


@needs_int4_cpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("M", [1, 3, 8, 67])
def test_w4_cpu_int4_against_fp64(M, G, dtype):
    """Options.w4_cpu_int4 (PyTorch's packed-int4 CPU matmul) against w = q * s + b and x in fp64, at odd shapes: its
    error is at most 2x that of the same computation in PyTorch at the op's precision (x, scale and zero = b + 8 s in
    bf16, fp32 sums, the product rounded to bf16, bias added in fp32), plus a floor of one ulp of the output range."""
    N, K = 208, G * (3 + 256 // G)  # 13 tiles of 16 outputs; K = 352, 448, 640
    lin, sd = _w4_linear(N, K, G, dtype=dtype, seed=M * G)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(G + M)).to(dtype)
    y = lin(x)
    assert lin._cpu_form[0] == "int4" and y.dtype == dtype and y.shape == (M, N)
    q, s, b = unpack_int4(sd["qweight"]).float(), sd["scales"].float(), sd["zeros"]
    ref = x.double() @ dequantize_w4(sd["qweight"], sd["scales"], b, torch.float64).T + sd["bias"].double()
    s16, z16 = (t.bfloat16().float().repeat_interleave(G, 1) for t in (s, b + 8 * s))
    same = (x.bfloat16().float() @ ((q - 8) * s16 + z16).T).bfloat16().float() + sd["bias"].float()
    err, err_torch = ((t.to(dtype).double() - ref).abs().max().item() for t in (y, same))
    assert err <= 2 * err_torch + torch.finfo(dtype).eps * ref.abs().max().item()


@needs_int4_cpu
def test_w4_cpu_int4_packs_once_and_again_after_load_or_cast(monkeypatch):
    """The int4 packing is made on the first call and reused; rows past ops.CPU_INT4_MAX_M, N not a multiple of 16
    and Options.w4_cpu_cache take the other paths; new weights or a cast make the packing again."""
    calls = []
    real = quant.int4pack_cpu
    monkeypatch.setattr(quant, "int4pack_cpu", lambda *a: calls.append(a[1].dtype) or real(*a))
    lin, sd = _w4_linear(48, 128, 64, dtype=torch.float16, seed=1)
    x = torch.randn(ops.CPU_INT4_MAX_M + 1, 128).half()
    y = lin(x[:2])
    assert torch.equal(lin(x[:2]), y) and calls == [torch.float16]
    for rows in (x, x[None]):  # one row past the limit: the fp32 reference, bit for bit
        assert torch.equal(lin(rows), ops.w4a16_linear(rows, lin.qweight, lin.scales, lin.zeros, lin.bias))
    assert calls == [torch.float16]
    new, sd2 = _w4_linear(48, 128, 64, dtype=torch.float16, seed=2)
    lin.load_state_dict(sd2, assign=True)
    assert torch.equal(lin(x[:2]), new(x[:2])) and calls == [torch.float16] * 3  # lin's and new's
    lin.to(torch.bfloat16)
    assert torch.equal(lin(x[:2].bfloat16()), new.to(torch.bfloat16)(x[:2].bfloat16())) and len(calls) == 5
    assert calls[-1] == torch.bfloat16
    odd, _ = _w4_linear(24, 128, 64, dtype=torch.float16)
    odd(x[:1])
    lin.options = tinyvila.Options(w4_cpu_cache=True)
    lin(x[:1].bfloat16())
    assert odd._cpu_form[0] is None and lin._cpu_form[0] == torch.bfloat16 and len(calls) == 5


def test_w4_linear_rejects_bad_shapes():
    with pytest.raises(ValueError, match="group size"):
        W4A16Linear(64, 8, group_size=100)
    with pytest.raises(ValueError, match="in_features=96"):
        W4A16Linear(96, 8, group_size=64)


# -- swap_linears ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-siglip-llama", "tiny-clip-qwen2"])
def test_swap_linears_replaces_exactly_the_llm_linears(name):
    cfg = preset(name)
    with torch.device("meta"):
        model = VLM(cfg)
    dense = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    swapped = swap_linears(model, W4)
    want = {f"text.layers.{i}.{p}" for i in range(cfg.text.n_layers) for p in LLM_LINEARS}
    assert set(swapped) == want
    modules = dict(model.named_modules())
    for n, old in dense.items():
        new = modules[n]
        if n in want:
            assert isinstance(new, W4A16Linear) and new.group_size == 32
            assert (new.in_features, new.out_features) == (old.in_features, old.out_features)
            assert (new.bias is None) == (old.bias is None)
        else:
            assert new is old  # vision, projector, lm_head untouched
    assert any("vision" in n for n in dense) and isinstance(model.text.embed, nn.Embedding)


def test_swap_linears_errors():
    with torch.device("meta"):
        model = VLM(preset("tiny-siglip-llama"))
    with pytest.raises(ValueError, match="only 'w4a16'"):
        swap_linears(model, QuantConfig())
    with pytest.raises(ValueError, match="not a multiple of group size 128"):
        swap_linears(model, QuantConfig(llm="w4a16", group_size=128))  # width 64


# -- checkpoints -----------------------------------------------------------------------------------------
def test_expected_tensors_of_a_w4_config():
    cfg = dataclasses.replace(w4_cfg("tiny-clip-qwen2"), dtype="float16")
    spec = expected_tensors(cfg)
    d, qkv = cfg.text.dim, cfg.text.qkv_dim
    assert spec["text.layers.0.attn.wqkv.qweight"] == ((qkv, d // 8), torch.int32)
    assert spec["text.layers.0.attn.wqkv.scales"] == ((qkv, d // 32), torch.float16)
    assert spec["text.layers.0.attn.wqkv.zeros"] == ((qkv, d // 32), torch.float32)
    assert spec["text.layers.0.attn.wqkv.bias"] == ((qkv,), torch.float16)
    assert "text.layers.1.mlp.w2.weight" not in spec and spec["text.embed.weight"][1] == torch.float16


def test_random_state_dict_holds_real_quantized_weights():
    cfg = w4_cfg("tiny-siglip-llama")
    sd = random_state_dict(cfg, seed=1)
    assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == expected_tensors(cfg)
    w = dequantize_w4(sd["text.layers.0.mlp.w13.qweight"], sd["text.layers.0.mlp.w13.scales"],
                      sd["text.layers.0.mlp.w13.zeros"])
    assert 0.015 < w.std().item() < 0.025  # a quantized N(0, 0.02), not random bit patterns


@pytest.fixture(scope="module")
def w4_folder(tmp_path_factory):
    return build_synthetic(tmp_path_factory.mktemp("w4") / "tiny-w4", w4_cfg("tiny-siglip-llama"), seed=0)


def test_w4_checkpoint_logits_equal_the_dequantized_dense_model(w4_folder):
    q = load_model(w4_folder, dtype=torch.float64)
    cfg = dataclasses.replace(q.cfg, quant=QuantConfig())
    sd = {}
    for k, v in q.state_dict().items():
        prefix, _, leaf = k.rpartition(".")
        if leaf == "qweight":
            sd[f"{prefix}.weight"] = dequantize_w4(v, q.state_dict()[f"{prefix}.scales"], q.state_dict()[f"{prefix}.zeros"])
        elif leaf not in ("scales", "zeros"):
            sd[k] = v
    with torch.device("meta"):
        dense = VLM(cfg)
    dense.load_state_dict(sd, assign=True, strict=True)
    ids = list(range(5, 40))
    logits = [Decoder(m.text).prefill(m.embed(ids)) for m in (q, dense.eval())]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-9, atol=1e-9)
    assert logits[0].std() > 0


def test_w4_checkpoint_chats_through_tinyvila_load(w4_folder):
    vlm = tinyvila.load(w4_folder)
    assert isinstance(vlm.model.text.layers[0].attn.wqkv, W4A16Linear)
    answers = []
    for _ in range(2):
        chat = vlm.chat(sampling=SamplingParams(max_new_tokens=6))
        answers.append("".join(chat.ask("What is in the picture?")))
        assert chat.stats.decode_tokens >= 1
    assert answers[0] == answers[1]  # greedy: deterministic


def test_w4_checkpoint_cast_on_load_and_wrong_zero_dtype_rejected(w4_folder, tmp_path):
    m = load_model(w4_folder, dtype=torch.bfloat16)
    lin = m.text.layers[1].mlp.w2
    assert (lin.scales.dtype, lin.zeros.dtype, lin.qweight.dtype) == (torch.bfloat16, torch.float32, torch.int32)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in w4_folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    sd = load_file(bad / "model.safetensors")
    sd["text.layers.1.mlp.w2.zeros"] = sd["text.layers.1.mlp.w2.zeros"].half()
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"text\.layers\.1\.mlp\.w2\.zeros: found .* float16, expected .* float32"):
        load_model(bad)


def test_quantize_cli_synthetic_w4(tmp_path):
    assert quantize_main(["synthetic", "--preset", "tiny-clip-qwen2", "--quant", "w4a16", "--group-size", "64",
                          str(tmp_path / "q")]) == 0
    m = load_model(tmp_path / "q")
    assert m.cfg.quant == QuantConfig(llm="w4a16", group_size=64)
    assert m.text.layers[0].attn.wqkv.group_size == 64 and m.text.layers[0].attn.wqkv.bias is not None


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 9])
def test_ops_dispatch_on_cuda(M):
    lin, sd = _w4_linear(N=200, K=256, G=64, dtype=torch.float16)
    lin = lin.cuda()
    x = torch.randn(1, M, 256, dtype=torch.float16, device="cuda")
    ref = F.linear(x.float(), dequantize_w4(lin.qweight, lin.scales, lin.zeros).float(), lin.bias.float())
    torch.testing.assert_close(ops.w4a16_linear(x, lin.qweight, lin.scales, lin.zeros, lin.bias).float(), ref,
                               rtol=1e-2, atol=2e-3 * ref.abs().max().item())
