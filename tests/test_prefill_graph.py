"""First-turn prefill at a padded length, replayed from a CUDA graph (tinyvila/generate.py).

On CPU the padded forward runs eagerly (`Decoder.pad_prefill`, the code a graph captures) and is
checked against the unpadded prefill: logits, cache, bookkeeping, later turns, SparseVILA's retrieval
scores and selection (padding rows add exactly nothing), and the fallbacks to eager. The replay tests
need CUDA: graph == the same padded forward run eagerly, bit for bit (scored or not), and against the
unpadded eager prefill within twice the eager path's own fp16 rounding error.
"""

import copy
import dataclasses

import pytest
import torch

from tinyvila import generate as generation
from tinyvila import ops
from tinyvila.api import from_config
from tinyvila.config import QuantConfig, SparsityConfig, TextConfig, preset
from tinyvila.errors import ContextLimitError
from tinyvila.generate import FOLLOWUP_GRAPH_MAX, PREFILL_GRAPH_MAX, Decoder, SamplingParams, generate, prefill_bucket
from tinyvila.options import Options


def tiny(dtype="float64", device="cpu", text: TextConfig | None = None, **quant):
    cfg = preset("tiny-siglip-llama", dtype=dtype)
    if text is not None:  # the projector follows the LLM's width (VLMConfig checks they agree)
        cfg = dataclasses.replace(cfg, text=text, projector=dataclasses.replace(cfg.projector, out_dim=text.dim))
    if quant:
        cfg = dataclasses.replace(cfg, quant=QuantConfig(**quant))
    return from_config(cfg, device=device, seed=0)


def embeds(vlm, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vlm.cfg.text.vocab_size, (1, n), generator=g).to(vlm.model.device)
    return vlm.model.text.embed(ids)  # (1, n, d)


def gapped(n, device="cpu"):
    """Increasing positions with gaps, as pruned visual tokens keeping their original ones have."""
    return (torch.arange(n) * 2 + 3).to(device)


def padded(text, **kw):
    dec = Decoder(text, **kw)
    dec.pad_prefill = True
    return dec


def prefill_keys(dec):
    """The keys of `dec`'s captured prefill graphs past their "prefill" tag: (bucket, later turn,
    *Retrieval.graph_key())."""
    return [k[1:] for k in dec.graphs.entries if k[0] == "prefill"]


def test_buckets_pad_at_most_a_quarter_and_stay_few():
    buckets = sorted({prefill_bucket(T) for T in range(1, PREFILL_GRAPH_MAX + 1)})
    assert buckets[:6] == [16, 32, 48, 64, 80, 96] and buckets[-1] == PREFILL_GRAPH_MAX
    assert len(buckets) == 24
    for T in range(1, 3000):
        b = prefill_bucket(T)
        assert b >= T and b % 16 == 0
        assert b <= max(T + 15, 1.25 * T)  # multiples of 16 up to 64, then quarter octaves
    assert prefill_bucket(447) == 448  # one vila-8b image + a short question


@pytest.mark.parametrize("n,explicit", [(23, False), (23, True), (64, False), (70, True)])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-5)])
def test_padded_prefill_equals_the_unpadded_one(n, explicit, dtype, tol):
    vlm = tiny(dtype)
    text, h = vlm.model.text, embeds(vlm, n)
    pos = gapped(n) if explicit else None
    ref, pad = Decoder(text), padded(text)
    a, b = ref.prefill(h, pos), pad.prefill(h, pos)
    assert pad._pf is not None and ref._pf is None  # the padded path really ran
    torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    assert (pad.length, pad.position) == (ref.length, ref.position) == (n, int(pos[-1]) + 1 if explicit else n)
    for x, y in zip(ref.cache.k + ref.cache.v, pad.cache.k + pad.cache.v):
        torch.testing.assert_close(y[:, :, :n], x[:, :, :n], rtol=tol, atol=tol)
    # Decoding and a second (padded) turn continue as after the unpadded prefill: slots past the
    # length, where the padding rows' K/V went, are overwritten before anything reads them.
    for t in (5, 9):
        torch.testing.assert_close(pad.step(t), ref.step(t), rtol=tol, atol=tol)
    torch.testing.assert_close(pad.prefill(embeds(vlm, 9, seed=2)), ref.prefill(embeds(vlm, 9, seed=2)),
                               rtol=tol, atol=tol)
    assert (pad.length, pad.position) == (ref.length, ref.position)


def test_padding_rows_do_not_change_real_rows():
    """Garbage instead of zeros in the padding rows: the real rows' logits and K/V stay bit for bit
    (causal attention: no real row sees a later one; every other op is row-wise)."""
    vlm = tiny()
    n, Tp = 37, prefill_bucket(37)
    outs = []
    for fill in (None, 1e3):
        dec = padded(vlm.model.text)
        dec.prefill(embeds(vlm, n))  # fills the static inputs (zero padding)
        with torch.inference_mode():
            if fill is not None:
                dec._pf.h[:, n:Tp].normal_(0, fill, generator=torch.Generator().manual_seed(0))
            logits = dec._padded_forward(Tp, False)[0, -1]
        outs.append((logits, [k[:, :, :n].clone() for k in dec.cache.k + dec.cache.v], dec._pf.h[:, n:Tp].abs().sum()))
    (l0, kv0, s0), (l1, kv1, s1) = outs
    assert s0 == 0 and s1 > 0
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(kv0, kv1))


# -- SparseVILA: retrieval scoring during the first prefill -----------------------------------------
# Two retrievable runs (scored through the slot tensor), question from slot 22, 18 retrievable slots; and
# one long run (scored as a range).
SPANS_A = [("system", 0, 2, False), ("visual", 2, 12, True), ("text", 12, 14, False), ("visual", 14, 22, True),
           ("question", 22, None, False)]
SPANS_C = [("system", 0, 5, False), ("visual", 5, 250, True), ("question", 250, None, False)]
SPANS_D = [("system", 0, 5, False), ("visual", 5, 100, True), ("question", 100, None, False)]  # a long question
# system | visual | visual | retrievable text (a document) | question from slot 20
SCORED_SPANS = [("system", 0, 2, False), ("visual", 2, 9, True), ("visual", 11, 15, True),
                ("text", 15, 20, True), ("question", 20, None, False)]


def begin_scored(dec, n, spans=SCORED_SPANS):
    """Record the spans of an n-token first turn and start scoring its question -> N retrievable slots."""
    for kind, a, b, retrievable in spans:
        dec.cache.add_span(kind, a, n if b is None else b, retrievable)
    q_from = next(a for kind, a, _, _ in spans if kind == "question")
    return dec.retrieval.begin_scoring(q_from)


@pytest.mark.parametrize("n,explicit", [(23, False), (37, True), (64, False), (70, True)])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-5)])
def test_padded_scored_prefill_equals_the_unpadded_one(n, explicit, dtype, tol):
    """Scores (summed over the real question rows only), logits, the selection pack() makes from them,
    and decoding over the packed buffer: as after the unpadded eager prefill."""
    vlm = tiny(dtype)
    text, h = vlm.model.text, embeds(vlm, n)
    pos = gapped(n) if explicit else None
    ref, pad = Decoder(text), padded(text)
    assert begin_scored(ref, n) == begin_scored(pad, n) == 16
    begun = pad.retrieval.scoring.scores
    a, b = ref.prefill(h, pos), pad.prefill(h, pos)
    assert pad._pf is not None and ref._pf is None  # the padded path really ran
    torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    sr, sp = ref.retrieval.scoring, pad.retrieval.scoring
    assert sp.scores is not begun and sp.pad is None and all(sp.scored)  # its own (poisoned) buffers
    assert torch.equal(sp.idx, sr.idx)
    assert sr.scores.min() > 0
    torch.testing.assert_close(sp.scores, sr.scores, rtol=tol, atol=tol)
    rows = [d.retrieval.pack(0.3, d.length, window=2) for d in (ref, pad)]
    assert rows[0] == rows[1] == n - 16 + 5
    assert torch.equal(pad.retrieval.packed.idx, ref.retrieval.packed.idx)
    for t in (5, 9):
        torch.testing.assert_close(pad.step(t), ref.step(t), rtol=tol, atol=tol)


def test_padding_rows_add_nothing_to_the_scores():
    """Garbage instead of zeros in the padding rows (so garbage queries): the scores stay bit for bit,
    while counting those rows as real (`last` moved to the end) would change them."""
    vlm = tiny()
    n, Tp = 37, prefill_bucket(37)
    dec = padded(vlm.model.text)
    begin_scored(dec, n)
    dec.prefill(embeds(vlm, n))  # fills the static inputs (zero padding)
    sc = dec.retrieval.scoring
    want = sc.scores.clone()
    with torch.inference_mode():
        dec._pf.h[:, n:Tp].normal_(0, 1e3, generator=torch.Generator().manual_seed(0))
        dec._padded_forward(Tp, False)
        garbage = sc.scores.clone()
        dec._pf.last.fill_(Tp - 1)
        dec._padded_forward(Tp, False)
    assert torch.equal(garbage, want)
    assert not torch.allclose(sc.scores, want, rtol=1e-3, atol=0)  # the padding rows carry mass when counted


def test_fallbacks_run_eagerly(monkeypatch):
    vlm = tiny()
    text, h = vlm.model.text, embeds(vlm, 35)
    # A bucket past the cache (35 -> 48 > 40 slots) or past prefill_chunk: eager, same result.
    for kw in ({"max_seq_len": 40}, {"prefill_chunk": 32}):
        dec = padded(text, **kw)
        torch.testing.assert_close(dec.prefill(h), Decoder(text).prefill(h), rtol=1e-10, atol=1e-10)
        assert dec._pf is None
    # FastV prunes inside the pass (host decisions): eager. So is scoring whose question rows start
    # after this prefill (a later prefill would score them).
    for fastv, q_from, T in ((True, 20, 35), (False, 20, 20)):
        dec = padded(text)
        dec.cache.add_span("visual", 2, 20)
        assert (dec.fastv.begin(q_from, 0.5) if fastv else dec.retrieval.begin_scoring(q_from)) == 18
        dec.prefill(h[:, :T])
        assert dec._pf is None
    # Later turns are padded too from the second of their graph key on (the first of each runs eagerly), except
    # one that brings retrievable rows of its own (scored from a later row than its first), one past
    # FOLLOWUP_GRAPH_MAX padded rows, one whose padding would pass the cache, and, where the graph's attention is
    # the unsplit flash call (Options.split_rows_attention off), one whose padding would pass
    # FOLLOWUP_GRAPH_MAX_KEYS cached keys (here 40, as the cache's 40 slots are).
    long = embeds(vlm, 10 + FOLLOWUP_GRAPH_MAX + 1)
    cases = [({}, h[:, 10:], False, True, True), ({}, h[:, 10:], False, False, False),
             ({}, h[:, 10:], True, True, False), ({}, long[:, 10:], False, True, False),
             ({"max_seq_len": 40}, h[:, 10:], False, True, False),
             ({"keys": 40, "split": False}, h[:, 10:], False, True, False),
             ({"keys": 48, "split": False}, h[:, 10:], False, True, True), ({"keys": 40}, h[:, 10:], False, True, True)]
    for kw, later, scored, seen, padded_too in cases:
        monkeypatch.setattr(generation, "FOLLOWUP_GRAPH_MAX_KEYS", kw.pop("keys", 8192))
        vlm.model.set_options(Options(split_rows_attention=kw.pop("split", True)))
        dec, ref = padded(text, **kw), Decoder(text, **kw)
        for d in (dec, ref):
            d.prefill(long[:, :10])
            if scored:  # rows 10..19 of this turn are visual, its question starts at 20
                d.cache.add_span("visual", 10, 20)
                assert d.retrieval.begin_scoring(20) == 10
        if seen:  # as after a first turn of this key
            dec._later_seen.add(dec._graph_key(prefill_bucket(later.shape[1])))
        dec._pf = None
        torch.testing.assert_close(dec.prefill(later), ref.prefill(later), rtol=1e-10, atol=1e-10)
        assert (dec._pf is not None) == padded_too


def test_padded_prefill_validates_before_touching_state():
    vlm = tiny()
    dec = padded(vlm.model.text, max_seq_len=30)
    with pytest.raises(ContextLimitError):
        dec.prefill(embeds(vlm, 31))
    with pytest.raises(ValueError, match="dtype|float"):
        dec.prefill(embeds(vlm, 10).float())
    with pytest.raises(ValueError, match="positions"):
        dec.prefill(embeds(vlm, 10), torch.arange(9))
    assert (dec.length, dec.position) == (0, 0) and not dec.cache.k_stack.any()


@pytest.mark.parametrize("sparsity", [SparsityConfig(), SparsityConfig(prefill_keep=0.5, prefill_positions="original"),
                                      SparsityConfig(prefill_keep=0.5, decode_keep=0.3)])
def test_a_chat_with_padded_first_turns_gives_the_same_tokens(sparsity):
    vlm = tiny()
    image = torch.randint(0, 256, (64, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy()
    runs = []
    for pad in (False, True):
        vlm.stop_ids = frozenset()
        chat = vlm.chat(sampling=SamplingParams(max_new_tokens=6), sparsity=sparsity)
        chat.decoder.pad_prefill = pad
        toks = []
        for r in range(2):
            if r == 0:
                chat.add_image(image)
            "".join(chat.ask(f"question {r}"))
            toks.append((list(chat.turns[-1][2]), chat.last_logits, chat.stats.decode_rows))
        runs.append((toks, chat.decoder.position))
        assert (chat.decoder._pf is not None) == pad
    (eager, p0), (pad, p1) = runs
    assert [t for t, _, _ in eager] == [t for t, _, _ in pad] and p0 == p1
    assert [r for _, _, r in eager] == [r for _, _, r in pad]
    assert all(r > 0 for _, _, r in pad) == (sparsity.decode_keep < 1)  # really decoded over packed rows
    for (_, a, _), (_, b, _) in zip(eager, pad):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def scored_case(dec, h, pos, spans):
    """A first turn of h's rows with `spans` scored -> (logits, K/V of the real rows, scores)."""
    dec.truncate(0)
    n = h.shape[1]
    begin_scored(dec, n, spans)
    logits = dec.prefill(h, pos)
    return logits, [x[:, :, :n] for x in dec.cache.k + dec.cache.v], dec.retrieval.scoring.scores


def baked_graphs(dec, monkeypatch):
    """Make `dec` replay CPU stand-ins for its prefill graphs (`cuda_graph` on): a replay reruns the padded
    forward with the retrieval kernel's idx arguments of the capture, as a real graph replays its kernels
    with the arguments baked in at capture (a range: its slots, the key view's offset; a slot tensor: the
    graph's idx buffer, read afresh). Returns the captured buckets."""
    real, captures, active = ops.retrieval_salience, [], []

    def salience(q, k, idx, lse, out=None, **kw):
        if active:
            graph = active[-1]
            if graph.capturing:
                graph.idx.append(idx)
            else:
                idx, graph.calls = graph.idx[graph.calls], graph.calls + 1
        return real(q, k, idx, lse, out=out, **kw)

    class Graph:
        def __init__(self, Tp, later):
            self.Tp, self.later, self.idx, self.capturing = Tp, later, [], True
            active.append(self)
            self.out = dec._padded_forward(Tp, later)
            active.pop()
            self.capturing = False

        def replay(self):
            self.calls = 0
            active.append(self)
            self.out.copy_(dec._padded_forward(self.Tp, self.later))
            active.pop()
            assert self.calls == len(self.idx)

    def capture(Tp, later):
        captures.append(Tp)
        graph = Graph(Tp, later)
        return graph, graph.out

    monkeypatch.setattr(ops, "retrieval_salience", salience)
    dec.cuda_graph, dec._capture_prefill = True, capture
    return captures


# Two span layouts with the same question start (22) and retrievable count (18) as SPANS_A below, one run each.
SPANS_B = [("system", 0, 4, False), ("visual", 4, 22, True), ("question", 22, None, False)]
SPANS_B3 = [("system", 0, 3, False), ("visual", 3, 21, True), ("text", 21, 22, False), ("question", 22, None, False)]


def test_a_graph_scored_over_one_span_is_not_replayed_for_another(monkeypatch):
    """The scored graphs' key holds the span's first slot (-1: a slot tensor): the same bucket, question
    start and retrievable count with another span, or with two runs, captures its own graph; the same span
    replays. Scores, logits and selection equal the eager padded forward's bit for bit; a key without the
    span would score the captured span's slots instead."""
    vlm = tiny()
    text = vlm.model.text
    graph, eager = Decoder(text), padded(text)
    captures = baked_graphs(graph, monkeypatch)
    cases = [(25, SPANS_B, 4), (26, SPANS_B3, 3), (27, SPANS_A, -1), (28, SPANS_B, 4), (29, SPANS_A, -1),
             (30, SPANS_B3, 3)]
    for n, spans, first in cases:
        h = embeds(vlm, n, seed=n)
        (la, _, sa), (lb, _, sb) = scored_case(eager, h, None, spans), scored_case(graph, h, None, spans)
        assert graph.retrieval.scoring.span == (None if first < 0 else range(first, first + 18))
        assert torch.equal(lb, la) and torch.equal(sb, sa) and sa.min() > 0, spans
        assert graph.retrieval.pack(0.25, n) == eager.retrieval.pack(0.25, n)
        assert torch.equal(graph.retrieval.packed.idx, eager.retrieval.packed.idx)
    assert captures == [32, 32, 32]  # B, B3 and A; the later cases replay them
    assert sorted(prefill_keys(graph)) == [(32, False, 22, 18, -1), (32, False, 22, 18, 3), (32, False, 22, 18, 4)]
    assert graph.graphs.captures == 3


# -- later turns: rows at device slots (RowsIndex) ---------------------------------------------------
def later_turns(dec, vlm, turns, scored=False):
    """A first turn of 30 rows (visual slots 4..24 when `scored`), then `turns` ((T, seed, explicit) each),
    every one scored and packed when `scored` -> per later turn (logits, its K/V, scores or None, length,
    position[, the packed slots])."""
    dec.truncate(0)
    if scored:
        dec.cache.add_span("visual", 4, 24)
    dec.prefill(embeds(vlm, 30, seed=9).to(dec.cache.device, dec.cache.dtype))
    out = []
    for T, seed, explicit in turns:
        start = dec.length
        if scored:
            assert dec.retrieval.begin_scoring(start) == 20
        pos = gapped(T).to(dec.cache.device) + dec.position if explicit else None
        logits = dec.prefill(embeds(vlm, T, seed).to(dec.cache.device, dec.cache.dtype), pos)
        sc = dec.retrieval.scoring
        out.append((logits, [x[:, :, start:start + T].clone() for x in dec.cache.k + dec.cache.v],
                    None if sc is None else sc.scores.clone(), dec.length, dec.position))
        if scored:
            dec.retrieval.pack(0.3, dec.length)
            out[-1] += (dec.retrieval.packed.idx.clone(),)
            dec.retrieval.unpack()
    return out


@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-5)])
def test_padded_later_turns_equal_the_unpadded_ones(scored, dtype, tol):
    """Several later turns in a row (one bucket at three cache lengths, another at two, gapped positions):
    logits, K/V, scores (every row a question row) and selection after each, as eager. The first turn of each
    bucket runs eagerly (a capture waits for a bucket's second turn), the others padded."""
    vlm = tiny(dtype)
    text = vlm.model.text
    want, got = later_turns(Decoder(text), vlm, LATER_TURNS, scored), later_turns(pad := padded(text), vlm, LATER_TURNS,
                                                                                  scored)
    assert pad._pf is not None and int(pad._pf.start) > 30  # the later-turn form really ran
    for a, b in zip(want, got):
        assert a[3:5] == b[3:5]
        for x, y in zip(a[:3] + a[5:], b[:3] + b[5:]):
            if isinstance(x, list):
                for u, v in zip(x, y):
                    torch.testing.assert_close(v, u, rtol=tol, atol=tol)
            elif x is not None:
                torch.testing.assert_close(y, x, rtol=tol, atol=tol) if x.is_floating_point() else torch.equal(y, x)
    if scored:
        assert all(a[2].min() > 0 for a in want)


def test_one_later_turn_form_serves_every_cache_length():
    """The later-turn forward reads the cache length from the device (`start`) only: with the host's length
    (and the question's first slot, which a capture at that length saw) set to others, it gives the same
    logits, K/V and scores bit for bit (what lets one graph replay at every length), and garbage padding rows
    change nothing of the real rows."""
    vlm = tiny()
    dec = padded(vlm.model.text)
    dec.cache.add_span("visual", 4, 24)
    dec.prefill(embeds(vlm, 30, seed=9))
    assert dec.retrieval.begin_scoring(30) == 20
    dec.prefill(embeds(vlm, 7, seed=3))  # length 37: the graph key's first turn, eager
    assert dec.retrieval.begin_scoring(37) == 20
    logits = dec.prefill(embeds(vlm, 11, seed=4))  # rows 37..47, padded to 16
    sc, Tp = dec.retrieval.scoring, prefill_bucket(11)
    want = (logits, dec.cache.k_stack[:, :, :, :48].clone(), sc.scores.clone())
    with torch.inference_mode():
        for host_length, fill in ((5, None), (1000, 1e3)):
            if fill is not None:
                dec._pf.h[:, 11:Tp].normal_(0, fill, generator=torch.Generator().manual_seed(0))
            dec.length, sc.q_from, sc.pad = host_length, host_length, None
            got = (dec._padded_forward(Tp, True)[0, -1], dec.cache.k_stack[:, :, :, :48], sc.scores)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), host_length


# -- CUDA graphs -----------------------------------------------------------------------------------
# Llama-3-8B's head geometry (head_dim 128, 4 query heads per KV head, theta 5e5) at a small width.
SMALL_8B = TextConfig(vocab_size=1024, dim=512, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=1024,
                      rope_theta=500000.0, max_seq_len=1024)
QUANTS = [{}, {"llm": "w4a16", "group_size": 128}]


def count_captures(dec):
    calls = []
    capture = dec._capture_prefill
    dec._capture_prefill = lambda Tp, later: calls.append(Tp) or capture(Tp, later)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_graph_prefill_equals_the_padded_forward_bit_for_bit(quant):
    """Two buckets (the fused W4 kernel below 256 rows, dequant + cuBLAS above), each replayed twice
    with different inputs (and positions), against the same padded forward run eagerly."""
    vlm = tiny("float16", "cuda", text=SMALL_8B, **quant)
    text = vlm.model.text
    graph, eager = Decoder(text), padded(text, cuda_graph=False)
    assert graph.cuda_graph
    captures = count_captures(graph)
    for n, seed, explicit in [(23, 1, False), (300, 2, True), (29, 3, True), (290, 4, False)]:
        h, pos = embeds(vlm, n, seed), gapped(n, "cuda") if explicit else None
        for d in (graph, eager):
            d.truncate(0)
        a, b = eager.prefill(h, pos), graph.prefill(h, pos)
        assert torch.equal(b, a), f"T={n}"
        assert (graph.length, graph.position) == (eager.length, eager.position)
        for x, y in zip(eager.cache.k + eager.cache.v, graph.cache.k + graph.cache.v):
            assert torch.equal(y[:, :, :n], x[:, :, :n])
        # The graph's K/V serve the decode step (graph step vs eager step: test_decode_graph's tolerance).
        torch.testing.assert_close(graph.step(7), eager.step(7), rtol=1e-3, atol=1e-3)
    assert captures == [32, 320] and sorted(prefill_keys(graph)) == [(32, False, 0, 0, -1), (320, False, 0, 0, -1)]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_graph_prefill_is_as_accurate_as_the_eager_one(quant):
    """Against the unpadded eager prefill the GEMMs' M differs (other tiles, split-K), so the bits may
    too: the graph's error against a float64 reference is at most twice the eager fp16 error + 1e-3."""
    vlm = tiny("float16", "cuda", text=SMALL_8B, **quant)
    text = vlm.model.text
    ref_text = copy.deepcopy(text).to("cpu", torch.float64)
    graph, eager = Decoder(text), Decoder(text, cuda_graph=False)
    for n in (23, 300):
        h = embeds(vlm, n)
        for d in (graph, eager):
            d.truncate(0)
        want = Decoder(ref_text).prefill(h.cpu().double())
        a, b = eager.prefill(h).cpu().double(), graph.prefill(h).cpu().double()
        err_eager, err_graph = (a - want).abs().max().item(), (b - want).abs().max().item()
        assert err_graph <= 2 * err_eager + 1e-3, (n, err_graph, err_eager)
        assert prefill_keys(graph) and eager._pf is None


@pytest.mark.gpu
def test_graph_prefill_then_greedy_decoding_matches_eager():
    vlm = tiny("float16", "cuda", text=SMALL_8B, llm="w4a16", group_size=128)
    text, h = vlm.model.text, embeds(vlm, 200)
    outs = []
    for dec in (Decoder(text), padded(text, cuda_graph=False)):
        logits = dec.prefill(h)
        outs.append(list(generate(dec, logits, SamplingParams(max_new_tokens=20), batch=8)))
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_scored_graph_prefill_equals_the_padded_forward_bit_for_bit(quant):
    """Scored first turns replayed from graphs against the same padded forward run eagerly: logits, K/V
    and scores bit for bit, then the same selection. Two questions in a row through each scored graph
    (other inputs, lengths, positions, retrievable slots), and an unscored prefill of the same bucket. One
    retrievable run is scored as a range baked into its graph: another run with the same bucket, question
    start and count (B, B3) captures its own graph, and so do two runs (A, a slot tensor)."""
    vlm = tiny("float16", "cuda", text=SMALL_8B, **quant)
    text = vlm.model.text
    graph, eager = Decoder(text), padded(text, cuda_graph=False)
    captures = count_captures(graph)
    cases = [(25, 1, False, SPANS_A), (30, 2, True, SPANS_B), (31, 6, False, SPANS_B3), (300, 3, True, SPANS_C),
             (29, 4, False, None), (290, 5, False, SPANS_C), (27, 7, True, SPANS_B), (26, 8, False, SPANS_A)]
    for n, seed, explicit, spans in cases:
        h, pos = embeds(vlm, n, seed), gapped(n, "cuda") if explicit else None
        if spans is None:
            for d in (graph, eager):
                d.truncate(0)
            assert torch.equal(graph.prefill(h, pos), eager.prefill(h, pos))
            continue
        (la, kva, sa), (lb, kvb, sb) = scored_case(eager, h, pos, spans), scored_case(graph, h, pos, spans)
        assert torch.equal(lb, la), f"T={n}"
        assert all(torch.equal(y, x) for x, y in zip(kva, kvb))
        assert torch.equal(sb, sa) and sa.sum() > 0, f"T={n}"
        assert torch.equal(graph.retrieval.scoring.idx, eager.cache.retrievable_slots(spans[-1][1]))
        assert graph.retrieval.pack(0.25, n) == eager.retrieval.pack(0.25, n)
        assert torch.equal(graph.retrieval.packed.idx, eager.retrieval.packed.idx)
        torch.testing.assert_close(graph.step(7), eager.step(7), rtol=1e-3, atol=1e-3)
    assert captures == [32, 32, 32, 320, 32]
    assert sorted(prefill_keys(graph)) == [(32, False, 0, 0, -1), (32, False, 22, 18, -1), (32, False, 22, 18, 3),
                                             (32, False, 22, 18, 4), (320, False, 250, 245, 5)]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_scored_graph_over_a_range_equals_the_slot_tensor_graph(quant):
    """One retrievable run scored through a range (the kernel reads the keys as one block) against the same
    graphs scoring the same slots through the slot tensor (span dropped): logits, scores, selection and the
    next decode step bit for bit, in the one-block kernel (n_rep * question rows <= 256: B, B3, C) and the
    pipe kernel (D: 220 padded question rows x 4 heads, four launches)."""
    vlm = tiny("float16", "cuda", text=SMALL_8B, **quant)
    text = vlm.model.text
    runs = []
    for tensor in (False, True):
        dec, out = Decoder(text), []
        for n, seed, spans in ((30, 1, SPANS_B), (300, 2, SPANS_C), (31, 3, SPANS_B3), (28, 4, SPANS_B),
                               (300, 5, SPANS_D)):
            dec.truncate(0)
            begin_scored(dec, n, spans)
            if tensor:
                dec.retrieval.scoring.span = None
            logits = dec.prefill(embeds(vlm, n, seed))
            scores = dec.retrieval.scoring.scores.clone()
            dec.retrieval.pack(0.25, n)
            out.append((logits, scores, dec.retrieval.packed.idx.clone(), dec.step(7)))
        # a range graph per run (B, B3, C, D); the slot tensor's graphs serve B and B3 alike
        assert sorted(k[4] for k in prefill_keys(dec)) == ([-1] * 3 if tensor else [3, 4, 5, 5])
        runs.append(out)
    for i, (a, b) in enumerate(zip(*runs)):
        assert a[1].sum() > 0 and all(torch.equal(x, y) for x, y in zip(a, b)), i


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_scored_graph_prefill_is_as_accurate_as_the_eager_one(quant):
    """Against a float64 CPU reference, the graph's scores (and logits) err at most twice as much as
    the unpadded eager prefill's, plus 1e-3 of the largest score (1e-3 for the logits)."""
    vlm = tiny("float16", "cuda", text=SMALL_8B, **quant)
    text = vlm.model.text
    ref = Decoder(copy.deepcopy(text).to("cpu", torch.float64))
    graph, eager = Decoder(text), Decoder(text, cuda_graph=False)
    for n, spans in ((25, SPANS_A), (300, SPANS_C)):
        h = embeds(vlm, n)
        want_l, _, want_s = scored_case(ref, h.cpu().double(), None, spans)
        errs = []
        for d in (eager, graph):
            logits, _, scores = scored_case(d, h, None, spans)
            errs.append(((logits.cpu().double() - want_l).abs().max().item(),
                         (scores.cpu().double() - want_s).abs().max().item()))
        (eager_l, eager_s), (graph_l, graph_s) = errs
        assert graph_l <= 2 * eager_l + 1e-3, (n, graph_l, eager_l)
        assert graph_s <= 2 * eager_s + 1e-3 * want_s.abs().max().item(), (n, graph_s, eager_s)
        assert prefill_keys(graph) and eager._pf is None


# Buckets 16, 16, 16, 48, 48: the first turn of each runs eagerly on both sides, the others replay / pad.
LATER_TURNS = [(9, 1, False), (12, 2, True), (14, 3, False), (40, 4, False), (44, 5, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize("quant", QUANTS)
def test_later_turn_graphs_equal_the_padded_forward_bit_for_bit(quant, scored):
    """Later turns replayed from graphs, one bucket at three cache lengths and another bucket, against the
    same padded forward run eagerly (the same varlen attention call): logits, K/V, scores and selection bit
    for bit, one capture per bucket, then the decode step over the graph-written cache."""
    vlm = tiny("float16", "cuda", text=SMALL_8B, **quant)
    text = vlm.model.text
    graph, eager = Decoder(text), padded(text, cuda_graph=False)
    captures = count_captures(graph)
    want, got = later_turns(eager, vlm, LATER_TURNS, scored), later_turns(graph, vlm, LATER_TURNS, scored)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a[3:5] == b[3:5]
        assert torch.equal(b[0], a[0]) and all(torch.equal(y, x) for x, y in zip(a[1], b[1])), i
        assert (a[2] is None and b[2] is None) or (torch.equal(b[2], a[2]) and a[2].sum() > 0), i
        assert len(a) == 5 or torch.equal(b[5], a[5]), i
    assert captures == [32, 16, 48]
    later = sorted(k for k in prefill_keys(graph) if k[1])
    assert later == ([(16, True, 0, 20, 4), (48, True, 0, 20, 4)] if scored else [(16, True, 0, 0, -1), (48, True, 0, 0, -1)])
    torch.testing.assert_close(graph.step(7), eager.step(7), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize("quant", QUANTS)
def test_later_turn_graphs_are_as_accurate_as_the_eager_ones(quant, scored):
    """Against a float64 CPU reference the later turns' logits (and scores) from graphs err at most twice as
    much as the unpadded eager prefill's, plus 1e-3 (of the largest score)."""
    vlm = tiny("float16", "cuda", text=SMALL_8B, **quant)
    text = vlm.model.text
    ref = later_turns(Decoder(copy.deepcopy(text).to("cpu", torch.float64)), vlm, LATER_TURNS, scored)
    runs = [later_turns(d, vlm, LATER_TURNS, scored) for d in (Decoder(text, cuda_graph=False), Decoder(text))]
    for i, want in enumerate(ref):
        errs = [((r[i][0].cpu().double() - want[0]).abs().max().item(),
                 0.0 if want[2] is None else (r[i][2].cpu().double() - want[2]).abs().max().item()) for r in runs]
        (eager_l, eager_s), (graph_l, graph_s) = errs
        assert graph_l <= 2 * eager_l + 1e-3, (i, graph_l, eager_l)
        if want[2] is not None:
            assert graph_s <= 2 * eager_s + 1e-3 * want[2].abs().max().item(), (i, graph_s, eager_s)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [{}, {"llm": "w4a16", "group_size": 32}])
def test_a_sparse_chat_answers_as_with_the_eager_scored_prefill(quant):
    """A whole SparseVILA session (decode_keep < 1) on the GPU, with graphs and eagerly (the padded
    first prefill, eager decode steps): the same first-turn logits (bit for bit), selection and
    answers, over two conversations (the second replays the first's scored graph with a new image)."""
    vlm = tiny("float16", "cuda", **quant)
    vlm.stop_ids = frozenset()
    runs = []
    for graph in (False, True):
        chat = vlm.chat(sampling=SamplingParams(max_new_tokens=12), sparsity=SparsityConfig(decode_keep=0.3))
        chat.decoder.cuda_graph, chat.decoder.pad_prefill = graph, True
        out = []
        for conv in range(2):
            chat.clear()
            chat.add_image(torch.randint(0, 256, (64, 64, 3), dtype=torch.uint8,
                                         generator=torch.Generator().manual_seed(conv)).numpy())
            "".join(chat.ask(f"what is in image {conv}?"))
            out.append((list(chat.turns[-1][2]), chat.last_logits, chat.decoder.retrieval._storage.idx.clone()))
            "".join(chat.ask("and then?"))  # a later turn: its own graph, scored inside it (padded eagerly)
            out.append((list(chat.turns[-1][2]), None, chat.decoder.retrieval._storage.idx.clone()))
        runs.append(out)
        assert chat.stats.decode_rows > 0
    (first,), later = ([k for k in prefill_keys(chat.decoder) if k[1] == f] for f in (False, True))
    assert first[2] > 0 and first[3] >= 0  # one first-turn graph, scored, one image's run: a range
    assert later and all(k[2] == 0 and k[3] == first[3] for k in later)  # every row a question row
    for (ta, la, ia), (tb, lb, ib) in zip(*runs):
        assert tb == ta and torch.equal(ib, ia)
        assert la is None or torch.equal(lb, la)

