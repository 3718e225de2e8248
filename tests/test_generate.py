"""The generation contract with a mock model (no weights): sampling, stop ids, budgets, the context.

The mock "LLM" predicts token (last + 1) % V with a clear margin, so greedy output is known exactly,
and records what it was fed so cache bookkeeping can be checked.
"""

import pytest
import torch

from tinyvila.config import TextConfig
from tinyvila.errors import ArgumentError, ContextLimitError
from tinyvila.generate import Decoder, SamplingParams, generate, sample
from tinyvila.kv_cache import StepIndex
from tinyvila.options import Options

V = 32


class MockText(torch.nn.Module):
    """Embeds token t as a one-hot row; logits favour (t + 1) % V for each input row."""

    options = Options()  # what a Decoder reads of a text model's runtime options (its CUDA-graph default, argmax)

    def __init__(self, max_seq_len=64):
        super().__init__()
        self.cfg = TextConfig(vocab_size=V, dim=V, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=4,
                              max_seq_len=max_seq_len, head_dim_override=2)
        self.embed = torch.nn.Embedding(V, V)
        self.embed.weight.data = torch.eye(V)
        self.fed = []  # (start, T) of every call

    def forward(self, h, cache, start, last_only=False, retrieval=None, fastv=None):
        # A decode step passes its cache slot as a device tensor (StepIndex).
        self.fed.append((int(start.slot) if isinstance(start, StepIndex) else start, h.shape[1]))
        tokens = h[0].argmax(-1)
        logits = torch.full((1, h.shape[1], V), -5.0)
        logits[0, torch.arange(h.shape[1]), (tokens + 1) % V] = 5.0
        return logits[:, -1:] if last_only else logits


def run(params, stop_ids=(), prompt=(3, 4), max_seq_len=64):
    model = MockText(max_seq_len)
    dec = Decoder(model)
    logits = dec.prefill(model.embed(torch.tensor([list(prompt)])))
    return list(generate(dec, logits, params, frozenset(stop_ids))), dec, model


def test_greedy_follows_the_model_and_respects_max_tokens():
    out, dec, model = run(SamplingParams(max_new_tokens=6))
    assert out == [5, 6, 7, 8, 9, 10]
    # prompt (2 tokens) + 5 fed tokens: the last yielded token is not written to the cache
    assert dec.length == 7
    assert model.fed == [(0, 2)] + [(2 + i, 1) for i in range(5)]


def test_stop_id_is_yielded_and_ends_generation():
    out, dec, _ = run(SamplingParams(max_new_tokens=50), stop_ids={8})
    assert out == [5, 6, 7, 8]
    assert dec.length == 2 + 3


def test_generation_stops_when_the_cache_is_full():
    out, dec, _ = run(SamplingParams(max_new_tokens=50), max_seq_len=6)
    assert dec.length == 6 and len(out) == 5  # 2 prompt + 4 fed; the 5th token could not be fed


def test_prefill_over_the_context_raises_and_changes_nothing():
    model = MockText(max_seq_len=8)
    dec = Decoder(model)
    dec.prefill(model.embed(torch.tensor([[1, 2, 3, 4, 5]])))
    before = [k.clone() for k in dec.cache.k]
    with pytest.raises(ContextLimitError, match="context is 8"):
        dec.prefill(model.embed(torch.tensor([[1, 2, 3, 4]])))
    assert dec.length == 5 and len(model.fed) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, dec.cache.k))


def test_truncate_rewinds_and_validates():
    model = MockText()
    dec = Decoder(model)
    dec.prefill(model.embed(torch.tensor([[1, 2, 3]])))
    dec.truncate(1)
    assert dec.length == 1
    with pytest.raises(ValueError):
        dec.truncate(2)


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.randn(V)
    p = SamplingParams(temperature=1.0)
    g1, g2, g3 = (torch.Generator().manual_seed(s) for s in (1, 1, 2))
    a = [sample(logits, p, g1) for _ in range(50)]
    b = [sample(logits, p, g2) for _ in range(50)]
    c = [sample(logits, p, g3) for _ in range(50)]
    assert a == b
    assert a != c
    assert len(set(a)) > 3  # really sampling, not argmax


def test_greedy_is_argmax():
    logits = torch.randn(V)
    assert sample(logits, SamplingParams()) == int(logits.argmax())


def test_top_k_restricts_the_support():
    logits = torch.randn(V)
    allowed = set(torch.topk(logits, 3).indices.tolist())
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(temperature=5.0, top_k=3), g) for _ in range(300)}
    assert draws == allowed


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4)) + 1e-9
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.75), g) for _ in range(300)}
    assert draws == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: tokens 2.. are dropped


def test_generate_with_seed_is_deterministic():
    p = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    a, _, _ = run(p)
    b, _, _ = run(p)
    assert a == b


def test_invalid_sampling_parameters_are_rejected():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(max_new_tokens=0), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("temperature", float("nan")), ("temperature", float("inf")), ("top_k", -1),
    ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("max_new_tokens", 0),
    ("max_new_tokens", 3.0), ("max_new_tokens", True), ("seed", "7"),
])
def test_invalid_sampling_parameters_name_their_field(field, value):
    with pytest.raises(ArgumentError, match=f"SamplingParams.{field} ") as e:
        SamplingParams(**{field: value})
    assert e.value.name == field and isinstance(e.value, ValueError)
