"""AWQ and RTN W4 quantization (tinyvila/convert/awq.py) on tiny random LLaMA decoders.

Run: python -m pytest tests/test_awq.py -q (CPU, seconds). Checks: the search's quantizer is exactly
quant.py's; folding scales leaves the fp model unchanged; AWQ lowers the output error against RTN on
activations with outlier channels (what AWQ exists for); the `awq` subcommand writes a loadable folder.
"""

import dataclasses

import pytest
import torch

from scripts.quantize import main as quantize_main
from tinyvila import quant
from tinyvila.config import TextConfig, preset
from tinyvila.convert import awq
from tinyvila.loader import build_synthetic
from tinyvila.text import KVCache, TextModel, rope_cos_sin

TINY = TextConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=256,
                  rope_theta=10000.0, max_seq_len=64)


def tiny_model(cfg: TextConfig, seed: int = 0, outliers: bool = True) -> TextModel:
    """Random decoder; with `outliers`, a few channels of every norm are 8-20x larger, giving the
    activation outliers of real LLMs that make some weight columns salient."""
    g = torch.Generator().manual_seed(seed)
    model = TextModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if p.ndim == 2 else 0.1) + (p.ndim == 1))
        if outliers:
            for block in model.layers:
                for norm in (block.attn_norm, block.mlp_norm):
                    idx = torch.randperm(cfg.dim, generator=g)[:4]
                    norm.weight[idx] *= 8 + 12 * torch.rand(4, generator=g)
    return model.eval()


def logits(model: TextModel, tokens: torch.Tensor) -> torch.Tensor:
    cache = KVCache(model.cfg, batch=tokens.shape[0], max_seq_len=tokens.shape[1], dtype=torch.float32)
    with torch.no_grad():
        return model(model.embed(tokens), cache, 0)


def set_quantized(model: TextModel, sd: dict) -> None:
    """Load a quantize_text result into the dense model: dequantized linears, folded norms."""
    for k, v in sd.items():
        if k.endswith(".qweight"):
            p = k.removesuffix(".qweight")
            w = quant.dequantize_w4(v, sd[p + ".scales"], sd[p + ".zeros"], torch.float32)
            model.get_submodule(p.removeprefix("text.")).weight.data = w
        elif k.endswith("norm.weight"):
            model.get_submodule(k.removeprefix("text.").removesuffix(".weight")).weight.data = v.float()


@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pseudo_quantize_is_quant_py(G, dtype):
    w = torch.randn(48, 256) * 0.05
    w[5, 7] = 1.5  # an outlier inside one group
    packed = quant.quantize_w4(w, G, dtype)
    expected = quant.dequantize_w4(packed["qweight"], packed["scales"], packed["zeros"], dtype).float()
    assert torch.equal(awq.pseudo_quantize(w, G, dtype), expected)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_scale_folding_keeps_the_fp_model(n_kv_heads):
    cfg = dataclasses.replace(TINY, n_kv_heads=n_kv_heads)
    model = tiny_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    before = logits(model, tokens)
    h = model.embed(tokens)
    cos, sin = rope_cos_sin(cfg, torch.arange(tokens.shape[1]), h.dtype)
    g = torch.Generator().manual_seed(2)
    cache = KVCache(cfg, batch=tokens.shape[0], max_seq_len=tokens.shape[1], dtype=torch.float32)
    for block in model.layers:
        _, inputs = awq._capture(block, h, cos, sin, cache)
        groups = awq._groups(block, inputs, cos, sin, cache)
        assert len(groups) == (4 if n_kv_heads == cfg.n_heads else 3)  # v->wo only without GQA
        for grp in groups:
            awq.apply_scale(grp, 0.25 + 4 * torch.rand(grp.x.shape[-1], generator=g))
        h, _ = awq._capture(block, h, cos, sin, cache)
    after = logits(model, tokens)
    assert not torch.equal(model.layers[0].attn_norm.weight, tiny_model(cfg).layers[0].attn_norm.weight)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_awq_beats_rtn_on_calibration_like_data():
    cfg, G = TINY, 32
    gen = torch.Generator().manual_seed(3)
    calib = torch.randint(0, cfg.vocab_size, (8, 32), generator=gen)
    held = torch.randint(0, cfg.vocab_size, (4, 32), generator=gen)  # same distribution, unseen
    ref = logits(tiny_model(cfg), held)
    errors = {}
    for method in ("rtn", "awq"):
        model = tiny_model(cfg)
        sd = awq.quantize_text(model, method, G, torch.float16, calib if method == "awq" else None,
                                     progress=False)
        fresh = tiny_model(cfg)
        set_quantized(fresh, sd)
        errors[method] = (logits(fresh, held) - ref).pow(2).mean().item()
    assert errors["awq"] < 0.8 * errors["rtn"], errors


def test_clip_search_never_worse_than_no_clip():
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(16, 128, generator=g) * 0.05, torch.randn(200, 128, generator=g)
    w[:, 3] *= 10
    bound = awq.search_clip(w, x, 32, torch.float16)  # (16, 4, 1)
    wg = w.view(16, 4, 32)
    clipped = torch.maximum(torch.minimum(wg, bound), -bound).view(16, 128)
    err = lambda v: (x @ (awq.pseudo_quantize(v, 32, torch.float16) - w).T).pow(2).mean()  # noqa: E731
    assert (bound <= wg.abs().amax(-1, keepdim=True)).all()
    assert err(clipped) <= err(w) + 1e-9


def test_pydoc_split_is_disjoint_and_deterministic():
    calib, held = awq.pydoc_texts("calib"), awq.pydoc_texts("heldout")
    assert held and calib and not set(calib) & set(held)
    assert held == awq.pydoc_texts("heldout")
    assert 2.5 < len(calib) / len(held) < 3.5


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_awq_subcommand_writes_a_loadable_w4_folder(tmp_path, method, monkeypatch):
    from tinyvila.loader import load_model

    cfg = preset("tiny-siglip-llama")
    src = build_synthetic(tmp_path / "dense", cfg, seed=0)
    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(f"Paragraph {i}: " + "some words and more words " * 20 for i in range(20)))
    argv = ["awq", str(src), str(tmp_path / "q"), "--method", method, "--group-size", "32", "--calib", str(calib),
            "--n-samples", "4", "--seqlen", "64", "--device", "cpu"]
    assert quantize_main(argv) == 0
    q = load_model(tmp_path / "q")
    if method == "rtn":  # a model name resolves as --model resolves it (checkpoints/<name> under the search path)
        monkeypatch.setenv("TINYVILA_CHECKPOINTS", str(tmp_path))
        argv[1:3] = ["dense", str(tmp_path / "q_by_name")]
        assert quantize_main(argv) == 0 and load_model(tmp_path / "q_by_name").cfg.quant.llm == "w4a16"
    dense = load_model(src)
    assert q.cfg.quant.llm == "w4a16" and q.cfg.quant.group_size == 32
    for name, t in dense.vision.state_dict().items():  # the vision side is copied unchanged
        assert torch.equal(q.vision.state_dict()[name], t), name
    tokens = torch.randint(0, cfg.text.vocab_size, (1, 16))
    lq, ld = logits(q.text, tokens), logits(dense.text, tokens)
    assert not torch.equal(lq, ld)
    assert (lq - ld).abs().max() < 0.2 * ld.abs().max()


def test_missing_calib_file_is_an_error_even_with_rtn(tmp_path, capsys):
    """rtn reads no calibration text, but a --calib naming no file is a typo to report, not to ignore."""
    src = build_synthetic(tmp_path / "dense", preset("tiny-siglip-llama"), seed=0)
    argv = ["awq", str(src), str(tmp_path / "q"), "--method", "rtn", "--group-size", "32", "--calib",
            str(tmp_path / "no-such.txt"), "--device", "cpu"]
    assert quantize_main(argv) == 1
    assert "no-such.txt" in capsys.readouterr().err and not (tmp_path / "q").exists()
