"""The fused norm/GEMV decode chain (tinyvila/decode_step.py: NormedRows, block_fused) against the plain decoder.

On CPU the chain runs through the PyTorch forms of ops.w4a16_linear(norm=) and ops.w4a16_linear_norm
(Options(fused_norm_gemv="on")): this checks the wiring (which norm feeds which GEMV, the first layer's plain
norm, the last layer's hand-over to the final norm) and that it replaces the per-layer norms. The
kernels themselves are tested in tests/kernels/test_w4a16_gemv.py; on a GPU the chain is the default
("auto") and the decode-graph tests run it.
"""

import dataclasses

import pytest
import torch

from tinyvila import ops
from tinyvila.config import QuantConfig, preset
from tinyvila.decode_step import use_fused
from tinyvila.generate import Decoder
from tinyvila.loader import build_synthetic, load_model
from tinyvila.options import Options, set_options


@pytest.fixture(scope="module")
def w4_model(tmp_path_factory):
    cfg = dataclasses.replace(preset("tiny-siglip-llama"), quant=QuantConfig(llm="w4a16", group_size=32))
    folder = build_synthetic(tmp_path_factory.mktemp("fused") / "tiny-w4", cfg, seed=3)
    return load_model(folder, dtype=torch.float32)


def _decode(model, mode: str, monkeypatch, dtype=torch.float32, steps: int = 4):
    """Prefill 12 tokens, then `steps` greedy decode steps -> (per-step logits, tokens, norm-launch counts)."""
    counts = {"add_rms_norm": 0, "w4a16_linear_norm": 0}
    for name in counts:
        fn = getattr(ops, name)

        def counted(*a, _fn=fn, _name=name, **k):
            counts[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(ops, name, counted)
    text = model.text.to(dtype)
    set_options(text, Options(fused_norm_gemv=mode, w4_cpu_int4=False))  # both sides on the reference linears
    dec = Decoder(text, cuda_graph=False)
    logits = dec.prefill(text.embed(torch.arange(5, 17)[None]))
    before = dict(counts)
    out, tokens = [], []
    for _ in range(steps):
        tok = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
        tokens.append(tok)
        logits = dec.step(tok)
        out.append(logits.reshape(-1).float())
    return out, tokens, {k: counts[k] - before[k] for k in counts}


def test_fused_chain_matches_plain_decode_fp32(w4_model, monkeypatch):
    plain, tok_plain, n_plain = _decode(w4_model, "off", monkeypatch)
    fused, tok_fused, n_fused = _decode(w4_model, "on", monkeypatch)
    layers, steps = w4_model.cfg.text.n_layers, 4
    assert n_plain == {"add_rms_norm": steps * (2 * layers + 1), "w4a16_linear_norm": 0}
    # Fused: the first layer's attention norm and the final norm stay; wo and w2 of every layer carry the
    # other norms, except the last w2, which hands (output, stream) to the final norm.
    assert n_fused == {"add_rms_norm": steps * 2, "w4a16_linear_norm": steps * (2 * layers - 1)}
    assert tok_fused == tok_plain
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_fused_chain_close_to_plain_decode_bf16(w4_model, monkeypatch):
    """In bf16 the chain rounds x once (gamma * h) where the plain path rounds twice (norm(h), then * gamma):
    logits agree to a few bf16 ulps of their range."""
    plain, _, _ = _decode(w4_model, "off", monkeypatch, dtype=torch.bfloat16, steps=2)
    fused, _, _ = _decode(w4_model, "on", monkeypatch, dtype=torch.bfloat16, steps=2)
    for a, b in zip(fused, plain):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 0.05 * scale
        assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.999


def test_fused_chain_only_at_decode_row_counts(w4_model):
    text = w4_model.text.to(torch.float32)
    d = text.cfg.dim
    set_options(text, Options(fused_norm_gemv="on"))
    assert use_fused(text, torch.zeros(1, 1, d)) and use_fused(text, torch.zeros(2, 4, d))
    assert not use_fused(text, torch.zeros(1, 9, d))
    assert not use_fused(text, torch.zeros(1, 1, d, dtype=torch.float64))  # norm weights in another dtype
    set_options(text, Options(fused_norm_gemv="auto"))
    assert not use_fused(text, torch.zeros(1, 1, d))  # CPU tensors keep the plain path by default
    set_options(text, Options(fused_norm_gemv="off"))
    assert not use_fused(text, torch.zeros(1, 1, d))
    with pytest.raises(ValueError, match="at most 8 rows"):
        ops.w4a16_linear(torch.zeros(9, 64), *(torch.zeros(1),) * 3, norm=(torch.zeros(1, 8), 1e-5))
