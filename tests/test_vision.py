"""VisionEncoder against transformers' SiglipVisionModel / CLIPVisionModel on tiny random weights.

Run: python -m pytest tests/test_vision.py. Skipped without transformers. The oracle is HF's
`hidden_states[select_layer]`; weights go through `vision_weights_from_hf`, so the importer is
tested by the same comparisons.
"""

import copy
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tinyvila.convert.hf import vision_config_from_hf, vision_weights_from_hf  # noqa: E402
from tinyvila.vision import VisionEncoder  # noqa: E402
from _counting import CountingReads  # noqa: E402

TINY = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, patch_size=8)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """HF init leaves biases zero and norms at one, which would hide mapping mistakes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm_weight = "norm" in name and name.endswith("weight")
            p.copy_(1 + 0.2 * noise if is_norm_weight else 0.15 * noise)
    return model.eval()


@pytest.fixture(scope="module")
def siglip():
    # 60 px / 8 px patches: a 7x7 grid whose last 4 pixel rows/cols are never seen, as in so400m.
    cfg = transformers.SiglipVisionConfig(image_size=60, **TINY)
    return _randomize(transformers.SiglipVisionModel(cfg), 0)


@pytest.fixture(scope="module")
def clip():
    cfg = transformers.CLIPVisionConfig(image_size=56, **TINY)
    return _randomize(transformers.CLIPVisionModel(cfg), 1)


def _hf_sd(model, prefixed: bool) -> dict:
    """transformers 5 saves without a prefix; VILA's 4.x-era checkpoints use "vision_model." and may
    carry the position_ids buffer."""
    sd = dict(model.state_dict())
    if not prefixed:
        return sd
    sd = {"vision_model." + k: v for k, v in sd.items()}
    sd["vision_model.embeddings.position_ids"] = torch.arange(model.embeddings.position_embedding.num_embeddings)[None]
    return sd


def _ours(model, select_layer, select_feature="cls_patch", dtype=torch.float32, prefixed=False):
    cfg = vision_config_from_hf(model.config.to_dict(), select_layer=select_layer, select_feature=select_feature)
    sd, _ = vision_weights_from_hf(_hf_sd(model, prefixed), cfg)
    with torch.device("meta"):
        enc = VisionEncoder(cfg)
    enc.load_state_dict({k.removeprefix("vision."): v.to(dtype) for k, v in sd.items()}, strict=True, assign=True)
    return enc


def _pixels(model, seed=0, dtype=torch.float32):
    s = model.config.image_size
    return torch.randn(2, 3, s, s, generator=torch.Generator().manual_seed(seed)).to(dtype)


@torch.no_grad()
def _hf_out(model, pixels, select_layer):
    return model(pixel_values=pixels, output_hidden_states=True).hidden_states[select_layer]


@pytest.mark.parametrize("select_layer", [-1, -2, 1, 0])
@pytest.mark.parametrize("name", ["siglip", "clip"])
def test_matches_hf_fp32(name, select_layer, request):
    hf = request.getfixturevalue(name)
    enc = _ours(hf, select_layer)
    px = _pixels(hf)
    ref = _hf_out(hf, px, select_layer)
    with torch.no_grad():
        out = enc(px)
    assert out.shape == (2, enc.cfg.n_out_tokens, 48) == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, patch, size", [("siglip", 14, 61), ("siglip", 7, 28), ("clip", 14, 56), ("siglip", 8, 60)])
def test_patch_embedding_is_the_convolution(kind, patch, size, monkeypatch):
    """embed() computes the checkpoint's Conv2d (kernel = stride = patch) as one GEMM over the cut-out
    patches: the same hidden_states[0] as the convolution itself, in float64, whether the patch's C P P
    pixels are a multiple of 8 (192 at 8) or are zero-padded to one (588 at 14, 147 at 7), and when
    the image leaves pixels past the last whole patch (61 px at 14: 4 patches, 5 pixels dropped).
    Buffers from torch.empty start as NaN, so unwritten (unpadded) patch columns would show."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    Config = transformers.SiglipVisionConfig if kind == "siglip" else transformers.CLIPVisionConfig
    hf = _randomize((transformers.SiglipVisionModel if kind == "siglip" else transformers.CLIPVisionModel)(
        Config(**{**TINY, "patch_size": patch}, image_size=size)), 3)
    enc = _ours(hf, -1, dtype=torch.float64)
    px = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ref = _conv_embed(enc, px)
    with torch.no_grad():
        out = enc.embed(px)
    assert out.shape == ref.shape == (2, enc.cfg.n_tokens, 48)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def _conv_embed(enc, px):
    """hidden_states[0] through the checkpoint's own convolution (the reference for embed)."""
    with torch.no_grad():
        conv = torch.nn.functional.conv2d(px, enc.patch_embed.weight, enc.patch_embed.bias,
                                          stride=enc.patch_embed.stride)
        ref = conv.flatten(2).transpose(1, 2)  # (B, G*G, D)
        if enc.cls_token is not None:
            ref = torch.cat([enc.cls_token.expand(px.shape[0], 1, -1), ref], dim=1)
        ref = ref + enc.pos_embed
        return ref if enc.pre_norm is None else enc.pre_norm(ref)


def test_padded_patch_weight_is_built_once_and_follows_the_weight(siglip):
    """embed's (D, C P P) padded weight is built on the first call and reused, and rebuilt whenever the weight
    changes: edited in place, reloaded, cast. A differentiable call builds its own (autograd through the pad)."""
    enc = _ours(siglip, -1, dtype=torch.float64)
    px = torch.randn(2, 3, 60, 60, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        enc.embed(px)
        first = enc._patch_weight()
        assert enc._patch_weight() is first  # reused
        enc.patch_embed.weight.mul_(2)  # in place: same storage, new version
        torch.testing.assert_close(enc.embed(px), _conv_embed(enc, px), rtol=1e-12, atol=1e-12)
        assert enc._patch_weight() is not first
        other = _ours(siglip, -1, dtype=torch.float64)
        enc.load_state_dict(other.state_dict())  # reloaded
        torch.testing.assert_close(enc.embed(px), _conv_embed(other, px), rtol=1e-12, atol=1e-12)
        enc.float()  # cast: new storage and dtype
        torch.testing.assert_close(enc.embed(px.float()), _conv_embed(enc, px.float()), rtol=1e-5, atol=1e-5)
    cached = enc._patch_w
    enc.patch_embed.weight.requires_grad_(True)
    out = enc.embed(px.float())
    assert out.requires_grad and enc._patch_w is cached  # built apart, the cache untouched


def test_wrong_image_size_is_named(siglip):
    """Pixels that do not give the encoder's patch grid fail with the size it takes, not a broadcast error."""
    enc = _ours(siglip, -1)
    for shape in [(2, 3, 52, 60), (2, 1, 60, 60), (3, 60, 60)]:
        with pytest.raises(ValueError, match=r"takes \(B, 3, 60, 60\) images \(49 patches of 8x8"):
            enc.embed(torch.zeros(shape))
    assert enc.embed(torch.zeros(2, 3, 63, 56)).shape == (2, 49, 48)  # 7 x 7 whole patches: accepted


@pytest.mark.parametrize("prefixed", [False, True])
def test_clip_patch_drops_cls(clip, prefixed):
    enc = _ours(clip, -2, select_feature="patch", prefixed=prefixed)
    px = _pixels(clip, seed=1)
    ref = _hf_out(clip, px, -2)[:, 1:]
    with torch.no_grad():
        out = enc(px)
    assert out.shape == (2, 49, 48)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["siglip", "clip"])
def test_fp16_error_within_3x_hf(name, request):
    hf = request.getfixturevalue(name)
    hf16 = copy.deepcopy(hf).half()
    enc = _ours(hf, -2, dtype=torch.float16)
    px = _pixels(hf, seed=2)
    ref = _hf_out(hf, px, -2)
    hf_err = (_hf_out(hf16, px.half(), -2).float() - ref).abs().max()
    with torch.no_grad():
        our_err = (enc(px.half()).float() - ref).abs().max()
    assert hf_err > 0  # fp16 really ran in fp16
    assert our_err <= 3 * hf_err + 1e-3, (our_err, hf_err)


@pytest.mark.parametrize("name", ["siglip", "clip"])
def test_layers_past_selected_not_built(name, request):
    hf = request.getfixturevalue(name)
    enc = _ours(hf, 1)
    assert len(enc.layers) == 1
    assert not any(k.startswith("layers.1.") for k in enc.state_dict())
    sd, used = vision_weights_from_hf(_hf_sd(hf, False), enc.cfg)
    assert not any(k.startswith("vision.layers.1.") for k in sd)
    assert {k for k in _hf_sd(hf, False) if k.startswith("encoder.layers.2.")} <= used  # dropped


@pytest.mark.parametrize("prefixed", [False, True])
@pytest.mark.parametrize("name", ["siglip", "clip"])
@pytest.mark.parametrize("select_layer", [-2, 1])
def test_mapping_accounts_every_key_once(name, select_layer, prefixed, request):
    hf = request.getfixturevalue(name)
    hf_sd = _hf_sd(hf, prefixed)
    cfg = vision_config_from_hf(hf.config.to_dict(), select_layer=select_layer)
    counted = CountingReads(hf_sd)
    sd, used = vision_weights_from_hf(counted, cfg)
    assert used == set(hf_sd)
    assert max(counted.reads.values()) == 1 and set(counted.reads) <= used
    # Every kept HF element lands in exactly one output tensor: no duplicates, no omissions.
    drop = re.compile(r"(vision_model\.)?(post_layernorm|head|embeddings\.position_ids)")
    late = re.compile(r"(vision_model\.)?encoder\.layers\.(\d+)\.")
    kept = [k for k in hf_sd if not drop.match(k)
            and not (late.match(k) and int(late.match(k).group(2)) >= cfg.n_run_layers)]
    assert sum(v.numel() for v in sd.values()) == sum(hf_sd[k].numel() for k in kept)
    with torch.device("meta"):
        expected = set(VisionEncoder(cfg).state_dict())
    assert {k.removeprefix("vision.") for k in sd} == expected


def test_missing_key_is_named(siglip):
    hf_sd = _hf_sd(siglip, True)
    del hf_sd["vision_model.encoder.layers.0.self_attn.k_proj.bias"]
    cfg = vision_config_from_hf(siglip.config.to_dict())
    with pytest.raises(KeyError, match=r"vision_model\.encoder\.layers\.0\.self_attn\.k_proj\.bias"):
        vision_weights_from_hf(hf_sd, cfg)


@pytest.mark.parametrize("name", ["siglip", "clip"])
def test_qk_of_a_layer(name, request):
    hf = request.getfixturevalue(name)
    enc = _ours(hf, -1)
    px = _pixels(hf, seed=3)
    with torch.no_grad():
        hs = hf(pixel_values=px, output_hidden_states=True).hidden_states
        x, (q, k, _) = enc.run_layers(enc.embed(px), qk_layer=1)
        layer = hf.encoder.layers[1]
        h = layer.layer_norm1(hs[1])
        ref_q = layer.self_attn.q_proj(h).view(2, -1, 4, 12).transpose(1, 2)  # (B, H, T, Dh)
        ref_k = layer.self_attn.k_proj(h).view(2, -1, 4, 12).transpose(1, 2)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, ref_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, hs[-1], rtol=1e-5, atol=1e-5)


def test_config_from_hf_forms():
    sig = transformers.SiglipConfig(vision_config=dict(image_size=384, patch_size=14, hidden_size=1152,
                                                       intermediate_size=4304, num_hidden_layers=27,
                                                       num_attention_heads=16)).to_dict()
    pre = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 0.00392156862745098}
    cfg = vision_config_from_hf(sig, preprocessor=pre)
    assert (cfg.kind, cfg.dim, cfg.n_heads, cfg.head_dim, cfg.mlp_dim) == ("siglip", 1152, 16, 72, 4304)
    assert (cfg.grid, cfg.n_out_tokens, cfg.n_run_layers, cfg.act) == (27, 729, 26, "gelu_tanh")
    assert (cfg.cls_token, cfg.pre_norm, cfg.patch_bias, cfg.norm_eps) == (False, False, True, 1e-6)
    clip = vision_config_from_hf({"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
                                 select_feature="patch",
                                 preprocessor={"image_mean": [0.48145466, 0.4578275, 0.40821073],
                                               "image_std": [0.26862954, 0.26130258, 0.27577711],
                                               "do_rescale": False})
    assert (clip.kind, clip.cls_token, clip.pre_norm, clip.patch_bias, clip.act) == ("clip", True, True, False,
                                                                                      "quick_gelu")
    assert (clip.n_tokens, clip.n_out_tokens, clip.rescale_factor) == (577, 576, 1.0)
    assert clip.image_mean == (0.48145466, 0.4578275, 0.40821073)
    with pytest.raises(ValueError, match="hidden_act"):
        vision_config_from_hf({"model_type": "siglip_vision_model", "hidden_act": "relu"})
    with pytest.raises(ValueError, match="select_layer"):
        vision_config_from_hf({"model_type": "siglip_vision_model", "num_hidden_layers": 3}, select_layer=-5)
