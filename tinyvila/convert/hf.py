"""HuggingFace / VILA config and weight mapping into the tinyvila layout of docs/checkpoint_format.md.

Each part has a `*_config_from_hf` (HF config dict -> frozen config; variants the runtime does not
implement are a ValueError, never a silent guess) and a `*_weights_from_hf` (HF state dict ->
(tinyvila tensors with q/k/v and gate/up fused, HF keys accounted for), so callers can flag leftovers).
Text: LlamaForCausalLM / Qwen2ForCausalLM. Vision: SiglipVisionModel / CLIPVisionModel. Projector:
VILA's mm_projector. Tested against transformers in tests/test_text.py and tests/test_vision.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from tinyvila.config import ProjectorConfig, RopeScaling, TextConfig, VisionConfig
from tinyvila.projector import KINDS


# -- text ----------------------------------------------------------------------------------------
def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from either the v5 `rope_parameters` or the older keys."""
    rp = hf.get("rope_parameters")
    if rp is None:
        rp = dict(hf.get("rope_scaling") or {})
        rp.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rp.get("rope_type", rp.get("type", "default"))
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ValueError(f"unsupported rope type {kind!r}: only default and llama3 RoPE are implemented")
    return theta, RopeScaling(
        factor=float(rp["factor"]), low_freq_factor=float(rp["low_freq_factor"]),
        high_freq_factor=float(rp["high_freq_factor"]),
        original_max_position=int(rp["original_max_position_embeddings"]),
    )


def text_config_from_hf(hf: dict, *, max_seq_len: int | None = None) -> TextConfig:
    """TextConfig from an HF LlamaConfig / Qwen2Config dict (`config.json` of the `llm/` folder).

    max_seq_len defaults to min(max_position_embeddings, model_max_length / tokenizer_model_max_length
    where present). Variants this decoder does not implement are a ValueError, never a silent guess.
    """
    arch = hf.get("model_type")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported model_type {arch!r}: expected 'llama' or 'qwen2'")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
        raise ValueError("only SwiGLU MLPs without bias (hidden_act 'silu', mlp_bias false) are supported")
    # Llama's attention_bias also puts a bias on o_proj, which the runtime layout has no slot for.
    if arch == "llama" and hf.get("attention_bias", False):
        raise ValueError("llama attention_bias=True (bias on q/k/v/o) is not supported")
    if hf.get("use_sliding_window", False):
        raise ValueError("Qwen2 sliding-window attention is not supported")
    theta, scaling = _rope_from_hf(hf)
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // n_heads
    if max_seq_len is None:
        limits = [hf.get(k) for k in ("max_position_embeddings", "model_max_length", "tokenizer_model_max_length")]
        max_seq_len = min(int(n) for n in limits if n)
    return TextConfig(
        arch=arch, vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        ffn_dim=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, qkv_bias=arch == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), max_seq_len=max_seq_len,
        head_dim_override=None if head_dim == dim // n_heads else head_dim,
    )


def text_weights_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: TextConfig
                         ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """HF LlamaForCausalLM / Qwen2ForCausalLM state dict -> (tinyvila `text.*` tensors, HF keys used).

    q/k/v and gate/up are fused by concatenation (rows q, k, v and gate, up). The returned key set
    holds every HF key consumed or deliberately dropped (rotary `inv_freq` buffers; `lm_head.weight`
    of a tied model when it equals the embedding), so the caller can flag leftovers.
    """
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf_sd:
            raise KeyError(f"HF tensor {name!r} missing from the state dict")
        if name in used:
            raise RuntimeError(f"HF tensor {name!r} mapped twice")
        used.add(name)
        return hf_sd[name]

    out = {"text.embed.weight": take("model.embed_tokens.weight"), "text.norm.weight": take("model.norm.weight")}
    for i in range(cfg.n_layers):
        hp, tp = f"model.layers.{i}.", f"text.layers.{i}."
        qkv = [f"{hp}self_attn.{p}_proj" for p in "qkv"]
        out[tp + "attn_norm.weight"] = take(hp + "input_layernorm.weight")
        out[tp + "attn.wqkv.weight"] = torch.cat([take(n + ".weight") for n in qkv])
        if cfg.qkv_bias:
            out[tp + "attn.wqkv.bias"] = torch.cat([take(n + ".bias") for n in qkv])
        out[tp + "attn.wo.weight"] = take(hp + "self_attn.o_proj.weight")
        out[tp + "mlp_norm.weight"] = take(hp + "post_attention_layernorm.weight")
        out[tp + "mlp.w13.weight"] = torch.cat([take(hp + "mlp.gate_proj.weight"), take(hp + "mlp.up_proj.weight")])
        out[tp + "mlp.w2.weight"] = take(hp + "mlp.down_proj.weight")
        if out[tp + "attn.wqkv.weight"].shape != (cfg.qkv_dim, cfg.dim):
            raise ValueError(f"layer {i}: fused qkv has shape {tuple(out[tp + 'attn.wqkv.weight'].shape)}, "
                             f"config expects {(cfg.qkv_dim, cfg.dim)}")
    if not cfg.tie_embeddings:
        out["text.lm_head.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf_sd:
        if not torch.equal(take("lm_head.weight"), out["text.embed.weight"]):
            raise ValueError("tie_embeddings is set but lm_head.weight differs from the embedding")
    used |= {k for k in hf_sd if k.endswith("rotary_emb.inv_freq")}
    return out, used


# -- vision --------------------------------------------------------------------------------------
_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu", "quick_gelu": "quick_gelu"}
# transformers' defaults, for config.json files that omit fields equal to them.
_HF_DEFAULTS = {
    "siglip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                   layer_norm_eps=1e-6),
    "clip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5),
}


def _square(v, name: str) -> int:
    if isinstance(v, (list, tuple)):
        if len(set(v)) != 1:
            raise ValueError(f"non-square {name} {v} is not supported")
        v = v[0]
    return int(v)


def vision_config_from_hf(hf: dict, *, select_layer: int = -2, select_feature: str = "cls_patch",
                          preprocessor: dict | None = None) -> VisionConfig:
    """VisionConfig from an HF SiglipVisionConfig / CLIPVisionConfig dict (or a full siglip / clip
    config holding one under "vision_config"); normalisation from preprocessor_config.json if given."""
    model_type = hf.get("model_type", "")
    if "vision_config" in hf and model_type in ("siglip", "clip"):
        hf = hf["vision_config"] or {}
    elif model_type not in ("siglip_vision_model", "clip_vision_model"):
        raise ValueError(f"unsupported vision model_type {model_type!r} (want siglip/clip vision models)")
    kind = "siglip" if model_type.startswith("siglip") else "clip"
    h = {**_HF_DEFAULTS[kind], **hf}
    if h["hidden_act"] not in _ACTS:
        raise ValueError(f"unsupported hidden_act {h['hidden_act']!r}; known: {', '.join(_ACTS)}")
    clip = kind == "clip"
    fields = dict(
        kind=kind, image_size=_square(h["image_size"], "image_size"),
        patch_size=_square(h["patch_size"], "patch_size"), n_channels=h["num_channels"],
        dim=h["hidden_size"], n_layers=h["num_hidden_layers"], n_heads=h["num_attention_heads"],
        mlp_dim=h["intermediate_size"], act=_ACTS[h["hidden_act"]], norm_eps=h["layer_norm_eps"],
        cls_token=clip, pre_norm=clip, patch_bias=not clip,
        select_layer=select_layer, select_feature=select_feature,
    )
    if preprocessor is not None:
        # A processor that skips a step is the identity for it.
        normalize = preprocessor.get("do_normalize", True)
        fields["image_mean"] = tuple(preprocessor.get("image_mean", (0.5,) * 3)) if normalize else (0.0,) * 3
        fields["image_std"] = tuple(preprocessor.get("image_std", (0.5,) * 3)) if normalize else (1.0,) * 3
        rescale = preprocessor.get("do_rescale", True)
        fields["rescale_factor"] = preprocessor.get("rescale_factor", 1 / 255) if rescale else 1.0
    cfg = VisionConfig(**fields)
    _ = cfg.n_run_layers  # raises on an out-of-range select_layer now, not at build time
    return cfg


def _hf_prefix(hf_sd: Mapping[str, torch.Tensor]) -> str:
    """Checkpoints saved by transformers 4.x (VILA's) prefix every key with "vision_model.";
    transformers 5 saves a bare SiglipVisionModel / CLIPVisionModel without it."""
    return "vision_model." if any(k.startswith("vision_model.") for k in hf_sd) else ""


def vision_weights_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: VisionConfig
                           ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """HF vision state dict -> (tinyvila `vision.*` tensors with q/k/v fused, HF keys accounted for).

    Accounted = mapped, or deliberately dropped: layers past the selected one, post_layernorm,
    SigLIP's pooling `head`, position_ids buffers. Raises KeyError naming a missing HF tensor.
    """
    pre = _hf_prefix(hf_sd)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        key = pre + name
        try:  # one read per key: `in` on a lazy Mapping may read the tensor too
            t = hf_sd[key]
        except KeyError:
            raise KeyError(f"HF vision tensor {key!r} is missing from the checkpoint") from None
        used.add(key)
        return t

    out = {"vision.patch_embed.weight": take("embeddings.patch_embedding.weight"),
           "vision.pos_embed": take("embeddings.position_embedding.weight")}
    if cfg.patch_bias:
        out["vision.patch_embed.bias"] = take("embeddings.patch_embedding.bias")
    if cfg.cls_token:
        out["vision.cls_token"] = take("embeddings.class_embedding")
    if cfg.pre_norm:
        for p in ("weight", "bias"):
            out[f"vision.pre_norm.{p}"] = take(f"pre_layrnorm.{p}")
    for i in range(cfg.n_run_layers):
        src, dst = f"encoder.layers.{i}.", f"vision.layers.{i}."
        for p in ("weight", "bias"):
            # q, k, v stacked in that order along the output dim: one GEMM instead of three.
            out[dst + f"attn.wqkv.{p}"] = torch.cat([take(src + f"self_attn.{n}_proj.{p}") for n in "qkv"])
            for hf_name, name in (("layer_norm1", "norm1"), ("self_attn.out_proj", "attn.wo"),
                                  ("layer_norm2", "norm2"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
                out[dst + f"{name}.{p}"] = take(src + f"{hf_name}.{p}")
    dropped = re.compile(re.escape(pre) + r"(post_layernorm\.|head\.|embeddings\.position_ids$|encoder\.layers\.(\d+)\.)")
    for key in hf_sd:
        m = dropped.match(key)
        if m and (m.group(2) is None or int(m.group(2)) >= cfg.n_run_layers):
            used.add(key)
    return out, used


# -- projector (VILA mm_projector/) ------------------------------------------------------------
# VILA's MultimodalProjector holds one `layers` module: an nn.Sequential (index 0 of mlp_downsample
# is the parameter-free DownSampleBlock, GELUs have no parameters) or, for "linear", a bare Linear.
_NAMES = {
    "mlp_downsample": {"layers.1": "norm", "layers.2": "fc1", "layers.4": "fc2"},
    "mlp2x_gelu": {"layers.0": "fc1", "layers.2": "fc2"},
    "linear": {"layers": "fc1"},
}


def projector_config_from_hf(hf: dict, in_dim: int, out_dim: int) -> ProjectorConfig:
    """ProjectorConfig from VILA's mm_projector/config.json; in_dim = vision width, out_dim = LLM width."""
    kind = hf.get("mm_projector_type")
    if kind not in KINDS:
        raise ValueError(f"unsupported mm_projector_type {kind!r}; supported: {', '.join(KINDS)}")
    return ProjectorConfig(kind=kind, in_dim=in_dim, out_dim=out_dim)


def projector_weights_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: ProjectorConfig
                              ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """VILA projector state dict -> (tinyvila `projector.*` tensors, HF keys used).

    Raises KeyError naming a missing HF tensor."""
    out, used = {}, set()
    for src, dst in _NAMES[cfg.kind].items():
        for p in ("weight", "bias"):
            key = f"{src}.{p}"
            try:  # one read per key: `in` on a lazy Mapping may read the tensor too
                out[f"projector.{dst}.{p}"] = hf_sd[key]
            except KeyError:
                raise KeyError(f"HF projector tensor {key!r} is missing from the checkpoint") from None
            used.add(key)
    return out, used
