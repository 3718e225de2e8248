"""Prefill pruning on tiny synthetic checkpoints: dense equality at keep 1.0, the kept set is the
top-k of the reference salience, positions (contiguous and original), the peers, CLI and stats.

The salience oracle here is computed independently: materialised softmax in fp64, mean over rows
and heads, patches summed into merged tokens by an explicit loop over VILA's (column-pair-major) grid.
"""

from pathlib import Path

import pytest
import torch

import tinyvila
from tinyvila import chat as cli
from tinyvila import ops, sparsity
from tinyvila.config import SparsityConfig
from tinyvila.generate import Decoder, SamplingParams
from tinyvila.image import preprocess
from tinyvila.kv_cache import StepIndex
from tinyvila.loader import build_synthetic
from tinyvila.tokenizer import IMAGE_TOKEN, conversation_ids

DEMO_IMAGE = Path(tinyvila.__file__).parent / "assets" / "demo.png"


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "siglip"
    build_synthetic(path, "tiny-siglip-llama", seed=0)
    return tinyvila.load(path, dtype=torch.float64)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "clip"
    build_synthetic(path, "tiny-clip-qwen2", seed=1)
    return tinyvila.load(path, dtype=torch.float64)


def _pixels(model, n=2, seed=0):
    s = model.cfg.vision.image_size
    return torch.randn(n, 3, s, s, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _oracle_grid_salience(model, pixels, layer=-1):
    """(B, N') salience per projector token, from scratch."""
    enc, cfg = model.vision, model.cfg.vision
    _, (q, k, _) = enc.run_layers(enc.embed(pixels), qk_layer=layer % cfg.n_run_layers)
    p = torch.softmax(q @ k.transpose(-1, -2) * cfg.head_dim ** -0.5, dim=-1)  # (B, H, T, T)
    rows = p[:, :, :1] if cfg.cls_token else p
    s = rows.mean(dim=(1, 2))  # (B, T)
    if cfg.n_out_tokens < cfg.n_tokens:
        s = s[:, 1:]
    if model.cfg.projector.kind != "mlp_downsample":
        return s
    g = cfg.grid
    h = (g + 1) // 2
    out = torch.zeros(s.shape[0], h * h, dtype=s.dtype)
    for i in range(h):
        for j in range(h):
            for r, c in ((2 * i, 2 * j), (2 * i, 2 * j + 1), (2 * i + 1, 2 * j), (2 * i + 1, 2 * j + 1)):
                if r < g and c < g:  # padding cells count 0
                    out[:, j * h + i] += s[:, r * g + c]
    return out


def _answer(vlm, sp, question="What is in the picture?", n=6):
    chat = vlm.chat(sparsity=sp, sampling=SamplingParams(max_new_tokens=n))
    chat.add_image(DEMO_IMAGE)
    "".join(chat.ask(question))
    return chat, list(chat.turns[-1][2])


def test_keep_one_is_exactly_the_dense_path(siglip, monkeypatch):
    dense, dense_tokens = _answer(siglip, SparsityConfig())

    def no_kernel(*a, **kw):
        raise AssertionError("prefill_keep=1.0 must not compute salience")

    monkeypatch.setattr(ops, "prefill_salience", no_kernel)
    for sp in (SparsityConfig(prefill_keep=1.0, prefill_positions="original"),
               SparsityConfig(prefill_keep=1.0, prefill_method="visionzip")):
        chat, tokens = _answer(siglip, sp)
        assert tokens == dense_tokens
        assert torch.equal(chat.last_logits, dense.last_logits)
        assert chat.stats.visual_kept == chat.stats.visual_tokens == siglip.cfg.image_tokens


@pytest.mark.parametrize("keep", [0.4, 0.75, 0.01])
def test_kept_set_is_the_top_k_of_the_reference_salience(siglip, keep):
    model = siglip.model
    px = _pixels(model)
    n = model.cfg.image_tokens
    k = max(1, round(keep * n))
    with torch.no_grad():
        out, idx = model.encode_images(px, SparsityConfig(prefill_keep=keep), with_index=True)
        dense = model.encode_images(px)  # (B, N', d)
    want = _oracle_grid_salience(model, px).topk(k, dim=-1).indices.sort(-1).values
    assert idx.shape == (2, k) and torch.equal(idx, want)
    # The kept tokens are exactly the dense tokens at those places, in original order.
    torch.testing.assert_close(out, dense.gather(1, idx[..., None].expand(-1, -1, dense.shape[-1])),
                               rtol=1e-12, atol=1e-12)


def test_clip_salience_uses_the_cls_row(clip):
    model = clip.model
    px = _pixels(model, seed=1)
    with torch.no_grad():
        _, idx = model.encode_images(px, SparsityConfig(prefill_keep=0.3), with_index=True)
    k = round(0.3 * model.cfg.image_tokens)
    assert torch.equal(idx, _oracle_grid_salience(model, px).topk(k, dim=-1).indices.sort(-1).values)


def test_salience_layer_is_configurable(siglip):
    model = siglip.model
    px = _pixels(model, seed=2)
    with torch.no_grad():
        _, idx = model.encode_images(px, SparsityConfig(prefill_keep=0.5, salience_layer=0), with_index=True)
    assert torch.equal(idx, _oracle_grid_salience(model, px, layer=0).topk(8, dim=-1).indices.sort(-1).values)
    with pytest.raises(ValueError, match="salience_layer 5 out of range"):
        model.encode_images(px, SparsityConfig(prefill_keep=0.5, salience_layer=5))


def test_contiguous_positions_give_a_shorter_dense_sequence(siglip):
    chat, _ = _answer(siglip, SparsityConfig(prefill_keep=0.25), n=3)
    k = round(0.25 * siglip.cfg.image_tokens)
    assert chat.stats.visual_kept == k and chat.stats.visual_tokens == siglip.cfg.image_tokens
    assert f"visual {k}/{siglip.cfg.image_tokens} kept" in chat.stats.line()
    assert chat.decoder.position == chat.decoder.length  # no gaps


def test_original_positions_are_used_and_text_continues_after_the_full_image(siglip, monkeypatch):
    seen = []
    forward = type(siglip.model.text).forward

    def spy(self, h, cache, start, *, last_only=False, positions=None, **sparse):
        if isinstance(start, StepIndex):  # decode steps carry their RoPE position on the device
            positions = start.pos
        seen.append(None if positions is None else positions.tolist())
        return forward(self, h, cache, start, last_only=last_only, positions=positions, **sparse)

    monkeypatch.setattr(type(siglip.model.text), "forward", spy)
    sp = SparsityConfig(prefill_keep=0.25, prefill_positions="original")
    chat = siglip.chat(sparsity=sp, sampling=SamplingParams(max_new_tokens=3))
    chat.add_image(DEMO_IMAGE)
    idx = chat.image_index[0][0].tolist()
    "".join(chat.ask("What is in the picture?"))
    n, k = siglip.cfg.image_tokens, len(idx)
    ids = conversation_ids(siglip.tokenizer, siglip.template, [("What is in the picture?", 1, None)])
    s = ids.index(IMAGE_TOKEN)
    # Text before the image, the kept tokens at their grid offsets, text after as if nothing was cut.
    prompt_pos = seen[0]
    assert prompt_pos == list(range(s)) + [s + j for j in idx] + list(range(s + n, s + n + len(ids) - s - 1))
    # Decode steps go on from the prompt's last position, not from the cache length.
    assert seen[1] == [prompt_pos[-1] + 1] and seen[2] == [prompt_pos[-1] + 2]
    assert chat.decoder.position - chat.decoder.length == n - k
    # The same embeddings at the same positions in a fresh cache give the session's logits.
    with torch.no_grad():
        emb = siglip.model.encode_images(preprocess(DEMO_IMAGE, siglip.model.cfg.vision), sp)
    logits = Decoder(siglip.model.text).prefill(siglip.model.embed(ids, emb), torch.tensor(prompt_pos))
    torch.testing.assert_close(logits, chat.last_logits, rtol=0, atol=1e-12)


def test_decoder_truncate_restores_logical_positions(siglip):
    dec = Decoder(siglip.model.text)
    d = siglip.cfg.text.dim
    h = torch.randn(1, 5, d, dtype=torch.float64)
    dec.prefill(h[:, :2])
    dec.prefill(h, torch.tensor([2, 3, 7, 9, 10]))
    dec.prefill(h[:, :2])
    assert (dec.length, dec.position) == (9, 13)
    dec.truncate(8)
    assert (dec.length, dec.position) == (8, 12)
    dec.truncate(4)  # inside the explicit span: new tokens run on after the last kept one (3)
    assert (dec.length, dec.position) == (4, 4)
    dec.truncate(1)
    assert (dec.length, dec.position) == (1, 1)


def test_random_peer_is_seeded_and_counts(siglip):
    model = siglip.model
    px = _pixels(model, n=3)
    with torch.no_grad():
        runs = [model.encode_images(px, SparsityConfig(prefill_keep=0.5, prefill_method="random", seed=s),
                                    with_index=True)[1] for s in (0, 0, 1)]
    assert runs[0].shape == (3, 8) and torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    for row in runs[0]:
        assert row.tolist() == sorted(set(row.tolist())) and 0 <= row.min() and row.max() < 16


def test_visionzip_peer_keeps_dominant_tokens_and_merges_the_rest(siglip):
    model = siglip.model
    px = _pixels(model, n=2, seed=3)
    k = 8
    with torch.no_grad():
        out, idx = model.encode_images(px, SparsityConfig(prefill_keep=0.5, prefill_method="visionzip"),
                                       with_index=True)
        dense = model.encode_images(px)
    n_ctx = max(1, round(k * sparsity.VISIONZIP_CONTEXT_FRAC))
    sal = _oracle_grid_salience(model, px)
    assert out.shape == (2, k, model.cfg.text.dim) and idx.shape == (2, k)
    for b in range(2):
        dom = set(sal[b].topk(k - n_ctx).indices.tolist())
        assert dom <= set(idx[b].tolist()) and idx[b].tolist() == sorted(idx[b].tolist())
        is_dom = torch.tensor([i in dom for i in idx[b].tolist()])
        # Dominant tokens pass through unchanged; contextual ones are new (merged) tokens.
        torch.testing.assert_close(out[b, is_dom], dense[b, idx[b][is_dom]], rtol=1e-12, atol=1e-12)
        assert int((~is_dom).sum()) == n_ctx
        assert not torch.allclose(out[b, ~is_dom], dense[b, idx[b][~is_dom]])


def test_keep_count_rule():
    assert [sparsity.keep_count(196, f) for f in (1.0, 0.4, 0.25, 0.001)] == [196, 78, 49, 1]


def test_cli_prefill_keep(tmp_path, capsys):
    path = tmp_path / "tiny"
    build_synthetic(path, "tiny-siglip-llama", seed=0)
    rc = cli.main(["--model", str(path), "--image", str(DEMO_IMAGE), "-p", "Hi?", "--max-new-tokens", "2",
                   "--prefill-keep", "0.5", "--prefill-method", "visionzip", "--prefill-positions", "original"])
    assert rc == 0 and "visual 8/16 kept" in capsys.readouterr().err
    assert cli.main(["--model", str(path), "--prefill-keep", "0", "-p", "x"]) == 1
    assert "prefill_keep must be in (0, 1]" in capsys.readouterr().err
