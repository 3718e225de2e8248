"""tinyvila/benchmark.py: the conversation summary, its printing, first-use counting, and the cost
model (decode bytes against the model's real tensors, prefill FLOPs against chunking and perf.md)."""

import dataclasses

import pytest
import torch

from scripts.benches import cost_model as cm
from tinyvila import benchmark as bm
from tinyvila.api import Stats
from tinyvila.config import QuantConfig, preset
from tinyvila.loader import random_model


def turn(**kw) -> Stats:
    base = dict(encode_ms=5.0, prefill_ms=10.0, prefill_tokens=100, decode_ms=40.0, decode_tokens=20,
                context_tokens=120, first_token_ms=0.5)
    return Stats(**{**base, **kw})


def test_summary_sums_turns_takes_ttft_from_the_first_and_context_from_the_last():
    turns = [turn(images=1, visual_tokens=16, visual_kept=8), turn(encode_ms=0.0, context_tokens=240, decode_rows=77)]
    s = bm.summary(turns, peak_gb=1.5)
    assert s["encode_ms"] == 5.0 and s["prefill_ms"] == 20.0 and s["decode_tokens"] == 40
    assert s["e2e_ms"] == pytest.approx(5 + 20 + 80)
    assert s["ttft_ms"] == pytest.approx(5 + 10 + 0.5)  # the first answer's wait, not a sum
    assert s["decode_tok_s"] == pytest.approx(1000 * 40 / 80)
    assert s["context_tokens"] == 240 and s["decode_rows"] == 77 and s["visual"] == "8/16"
    assert s["peak_gb"] == 1.5
    with pytest.raises(ValueError):
        bm.summary([])


def test_line_and_table_print_the_same_columns():
    row = {**bm.summary([turn()]), "first_use": 3}
    text = bm.line(row)
    assert "TTFT ms 15.5" in text and "peak GB -" in text and "first-use loads 3" in text
    lines = bm.table([{"turn": "1", **row}, {"turn": "total", **row}], "turn",
                     {"extra": ("my extra", ".2f")}).splitlines()
    assert len(lines) == 3 and lines[0].split()[0] == "turn" and "TTFT ms" in lines[0]
    assert lines[2].split()[0] == "total"
    assert len({len(x) for x in lines}) == 1  # aligned


def test_first_use_counts_kernel_loads_and_autotunings_only_while_active(monkeypatch):
    knobs = pytest.importorskip("triton").knobs

    class FakeTuner:
        cache = {}

    tuner = FakeTuner()
    monkeypatch.setattr(bm, "_autotuners", lambda: [tuner])
    fire = knobs.runtime.kernel_load_end_hook
    with bm.FirstUse() as fu:
        fire(None, None, "kernel", {}, "hash")
        fire(None, None, "kernel2", {}, "hash2")
        tuner.cache[("M_KEY", 64)] = "config"
    fire(None, None, "kernel3", {}, "hash3")  # after stop(): not counted
    assert (fu.loads, fu.tunings) == (2, 1)
    assert fu._on_load not in fire.calls  # the hook is removed again


@pytest.mark.gpu
def test_first_use_sees_a_real_compilation():
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(100, device="cuda")
    with bm.FirstUse() as fu:
        _add_one[(1,)](x, 100, BLOCK=128)
    assert fu.loads >= 1
    with bm.FirstUse() as again:
        _add_one[(1,)](x, 100, BLOCK=128)  # already loaded
    assert again.loads == 0 and x[0].item() == 2


def test_recorder_reports_each_conversation_and_forgets_it():
    rec = bm.Recorder("cpu")
    rec.record(turn())
    rec.record(turn(context_tokens=260))
    total = rec.total()
    assert total["decode_tokens"] == 40 and total["context_tokens"] == 260 and total["first_use"] == 0
    text = rec.report().splitlines()
    assert [x.split()[0] for x in text] == ["turn", "1", "2", "total"]
    assert rec.turns == [] and rec.rows == []
    rec.close()


def text_bytes_per_step(model) -> int:
    """Bytes a decode step reads from the real model: every text tensor, the embedding as one row
    (plus the whole matrix again when it doubles as the lm_head)."""
    text = model.text
    total = 0
    for name, t in [*text.named_parameters(), *text.named_buffers()]:
        total += t[0].numel() * t.element_size() if name == "embed.weight" else t.numel() * t.element_size()
    if text.lm_head is None:
        total += text.embed.weight.numel() * text.embed.weight.element_size()
    return total


@pytest.mark.parametrize("name", ["tiny-siglip-llama", "tiny-clip-qwen2"])
@pytest.mark.parametrize("quant", ["none", "w4a16"])
def test_decode_weight_bytes_match_the_models_tensors(name, quant):
    cfg = preset(name, dtype="float16")
    if quant == "w4a16":
        cfg = dataclasses.replace(cfg, quant=QuantConfig(llm="w4a16", vision="none", group_size=32))
    assert cm.decode_weight_bytes(cfg) == text_bytes_per_step(random_model(cfg))
    t = cfg.text
    assert cm.kv_row_bytes(cfg) == 2 * t.n_layers * t.n_kv_heads * t.head_dim * 2


def test_vila_8b_cost_model_matches_the_reference_arithmetic():
    cfg = preset("vila-8b")
    # reference/perf.md sec. 2: 15.01 GB of bf16 weights a step; 128 KiB of KV per token.
    assert cm.decode_weight_bytes(cfg) / 1e9 == pytest.approx(15.01, abs=0.01)
    assert cm.kv_row_bytes(cfg) == 128 * 1024
    # W4 g128 with fp16 scales and fp32 zeros (6 B a group) + fp16 lm_head: 3.490 + 0.327 + 1.051 GB.
    w4 = dataclasses.replace(cfg, quant=QuantConfig(llm="w4a16", vision="w8a8"))
    assert cm.decode_weight_bytes(w4) / 1e9 == pytest.approx(4.868, abs=0.002)
    # sec. 2.3: 2048 tokens = 28.6 TFLOP of linears + 1.1 of attention.
    assert cm.prefill_flops(cfg, 2048, 0) / 1e12 == pytest.approx(28.6 + 1.1, abs=0.1)


def test_prefill_flops_add_up_over_chunks_and_decode_bytes_over_steps():
    cfg = preset("tiny-siglip-llama")
    lm_head = 2 * cfg.text.dim * cfg.text.vocab_size  # the one last-row projection each call adds
    whole = cm.prefill_flops(cfg, 300, 40)
    assert cm.prefill_flops(cfg, 100, 40) + cm.prefill_flops(cfg, 200, 140) == pytest.approx(whole + lm_head)
    W, kv = cm.decode_weight_bytes(cfg), cm.kv_row_bytes(cfg)
    dense = turn(prefill_tokens=100, context_tokens=130, decode_tokens=10)  # the cache held 120 at decode
    assert cm.decode_bytes(cfg, [dense]) == pytest.approx(9 * W + kv * sum(120 + j for j in range(1, 10)))
    sparse = dataclasses.replace(dense, decode_rows=30)  # packed rows replace the cache
    assert cm.decode_bytes(cfg, [sparse]) == pytest.approx(9 * W + kv * sum(30 + j for j in range(1, 10)))
    assert cm.conversation_flops(cfg, [dense]) == pytest.approx(cm.prefill_flops(cfg, 100, 20))
