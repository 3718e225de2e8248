"""Model configuration: frozen dataclasses saved as `config.json` beside the weights.

A checkpoint folder is described completely by its `VLMConfig`; nothing is ever inferred from a
folder or file name. Sizes that follow from others (729 patches, 196 merged tokens, head_dim) are
derived properties, never stored twice. `PRESETS` holds the real shapes of the VILA models we
target and tiny shapes for tests and the demo.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class VisionConfig:
    """ViT in the SigLIP form (no CLS, tanh-GELU) or the CLIP form (CLS token, pre-LN, quick-GELU)."""

    kind: str = "siglip"                # "siglip" | "clip": only sets defaults elsewhere, fields decide
    image_size: int = 384
    patch_size: int = 14
    n_channels: int = 3
    dim: int = 1152
    n_layers: int = 27                  # layers of the original model (HF num_hidden_layers)
    n_heads: int = 16
    mlp_dim: int = 4304
    act: str = "gelu_tanh"              # "gelu_tanh" | "gelu" (erf) | "quick_gelu"
    norm_eps: float = 1e-6
    cls_token: bool = False             # CLIP: a learned class token is prepended
    pre_norm: bool = False              # CLIP: LayerNorm on the embeddings before the encoder
    patch_bias: bool = True             # SigLIP's patch conv has a bias, CLIP's has none
    select_layer: int = -2              # hidden_states[select_layer]; 0 = embeddings
    select_feature: str = "cls_patch"   # "cls_patch" keeps every token, "patch" drops the CLS token
    layer_scale: bool = False           # DINOv2: per-channel LayerScale (ls1, ls2) on both residual branches
    post_norm: bool = False             # DINOv2: final LayerNorm on the selected features (HF last_hidden_state)
    # Preprocessing (from the checkpoint's preprocessor_config.json).
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def grid(self) -> int:
        """Patches per side: the conv has no padding, so trailing pixels are never seen."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.grid * self.grid

    @property
    def n_tokens(self) -> int:
        """Tokens the encoder runs on (patches, plus CLS when present)."""
        return self.n_patches + int(self.cls_token)

    @property
    def n_out_tokens(self) -> int:
        """Tokens handed to the projector after feature selection."""
        drop_cls = self.cls_token and self.select_feature == "patch"
        return self.n_tokens - int(drop_cls)

    @property
    def n_run_layers(self) -> int:
        """Encoder layers that must run to produce hidden_states[select_layer]."""
        n = self.select_layer if self.select_layer >= 0 else self.n_layers + 1 + self.select_layer
        if not 0 <= n <= self.n_layers:
            raise ValueError(f"select_layer {self.select_layer} out of range for {self.n_layers} layers")
        return n


@dataclass(frozen=True)
class ProjectorConfig:
    """Vision-to-language projector: `mlp_downsample` (VILA1.5), `mlp2x_gelu` (LLaVA) or `linear`."""

    kind: str = "mlp_downsample"
    in_dim: int = 1152                  # vision width
    out_dim: int = 4096                 # LLM width
    norm_eps: float = 1e-5              # LayerNorm of mlp_downsample (torch default)

    def n_tokens(self, vision: VisionConfig) -> int:
        """LLM tokens per image."""
        if self.kind == "mlp_downsample":
            side = math.isqrt(vision.n_out_tokens)
            if side * side != vision.n_out_tokens:
                raise ValueError("mlp_downsample needs a square token grid (no CLS)")
            return ((side + 1) // 2) ** 2
        return vision.n_out_tokens

    @property
    def merged_dim(self) -> int:
        return 4 * self.in_dim if self.kind == "mlp_downsample" else self.in_dim


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class TextConfig:
    """LLaMA-style decoder; Qwen2 differs only by `qkv_bias`."""

    arch: str = "llama"                 # "llama" | "qwen2"
    vocab_size: int = 128257
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 4096             # the declared context: the KV cache is preallocated to it
    head_dim_override: int | None = None

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim


@dataclass(frozen=True)
class QuantConfig:
    """How the weights in this folder are stored. "none" = fp16/bf16 dense."""

    llm: str = "none"                   # "none" | "w4a16"
    vision: str = "none"                # "none" | "w8a8"
    group_size: int = 128


@dataclass(frozen=True)
class SparsityConfig:
    """SparseVILA keeps: 1.0 = keep everything (exactly the dense path)."""

    prefill_keep: float = 1.0
    decode_keep: float = 1.0
    # Prefill pruning (tinyvila/sparsity.py): how tokens are chosen ("sparsevila" = top salience,
    # "random" = seeded uniform, "visionzip" = dominant + merged contextual tokens), which encoder
    # layer's attention gives salience (index into the executed layers, -1 = the last), and the
    # RoPE positions kept tokens take ("contiguous", or "original" with gaps where tokens were cut).
    prefill_method: str = "sparsevila"
    salience_layer: int = -1
    prefill_positions: str = "contiguous"
    seed: int = 0
    # Decode retrieval over retrievable TEXT spans (documents): a selected token also keeps the
    # decode_window tokens after it, which copying heads need (docs/sparsity.md; 0 = token-level).
    # Visual spans are always selected token by token, as in the paper.
    decode_window: int = 8

    def __post_init__(self):
        for name in ("prefill_keep", "decode_keep"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.prefill_method not in ("sparsevila", "random", "visionzip"):
            raise ValueError(f"prefill_method must be sparsevila, random or visionzip, got {self.prefill_method!r}")
        if self.prefill_positions not in ("contiguous", "original"):
            raise ValueError(f"prefill_positions must be contiguous or original, got {self.prefill_positions!r}")
        if self.decode_window < 0:
            raise ValueError(f"decode_window must be >= 0, got {self.decode_window}")


@dataclass(frozen=True)
class VLMConfig:
    """A whole checkpoint: vision encoder + projector (absent for text-only models) + LLM."""

    text: TextConfig
    vision: VisionConfig | None = None
    projector: ProjectorConfig | None = None
    quant: QuantConfig = field(default_factory=QuantConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    template: str = "llama_3"           # chat template name, see tokenizer.TEMPLATES
    dtype: str = "float16"              # compute/storage dtype of floating weights
    tokenizer: str = "tokenizer.json"   # file in the folder: tokenizer.json or tokenizer.model
    eos_ids: tuple[int, ...] = ()       # stop ids beside the template's stop tokens (generation_config)
    synthetic: bool = False             # random weights: the CLI says so

    def __post_init__(self):
        if (self.vision is None) != (self.projector is None):
            raise ValueError("vision and projector must both be set or both be None")

    @property
    def image_tokens(self) -> int:
        """LLM tokens per image (0 for text-only models)."""
        return 0 if self.vision is None else self.projector.n_tokens(self.vision)

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VLMConfig":
        d = dict(d)
        text = dict(d.pop("text"))
        if text.get("rope_scaling") is not None:
            text["rope_scaling"] = RopeScaling(**text["rope_scaling"])
        vision = d.pop("vision", None)
        if vision is not None:
            vision = {k: tuple(v) if isinstance(v, list) else v for k, v in vision.items()}
            vision = VisionConfig(**vision)
        projector = d.pop("projector", None)
        return cls(
            text=TextConfig(**text),
            vision=vision,
            projector=None if projector is None else ProjectorConfig(**projector),
            quant=QuantConfig(**d.pop("quant", {})),
            sparsity=SparsityConfig(**d.pop("sparsity", {})),
            eos_ids=tuple(d.pop("eos_ids", ())),
            **d,
        )

    def save(self, folder: str | Path) -> None:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "VLMConfig":
        path = Path(folder) / "config.json"
        try:
            d = json.loads(path.read_text())
            return cls.from_dict(d)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no config.json; is this a tinyvila checkpoint folder?") from None
        except (json.JSONDecodeError, TypeError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a valid tinyvila config ({e}); rebuild it with scripts/quantize.py") from None


# -- presets -------------------------------------------------------------------------------------
SIGLIP_SO400M = VisionConfig()
LLAMA3_8B = TextConfig()
SHEARED_LLAMA_2_7B = TextConfig(
    vocab_size=32000, dim=2560, n_layers=32, n_heads=20, n_kv_heads=20, ffn_dim=6912,
    rope_theta=10000.0, max_seq_len=4096,
)

PRESETS: dict[str, VLMConfig] = {
    # Llama-3-VILA1.5-8B: SigLIP-so400m (layer -2) -> mlp_downsample -> Llama-3-8B, llama_3 template.
    "vila-8b": VLMConfig(
        text=LLAMA3_8B, vision=SIGLIP_SO400M, projector=ProjectorConfig(out_dim=4096),
        template="llama_3", eos_ids=(128001,), dtype="float16",
    ),
    # VILA1.5-3B: the same vision side -> Sheared-LLaMA-2.7B, vicuna_v1 template, sentencepiece.
    "vila-3b": VLMConfig(
        text=SHEARED_LLAMA_2_7B, vision=SIGLIP_SO400M, projector=ProjectorConfig(out_dim=2560),
        template="vicuna_v1", tokenizer="tokenizer.model", eos_ids=(2,), dtype="float16",
    ),
    # Tiny shapes for tests and the offline demo (random weights). 64 px / 8 px patches = 8x8 grid.
    "tiny-siglip-llama": VLMConfig(
        text=TextConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                        rope_theta=10000.0, max_seq_len=512),
        vision=VisionConfig(image_size=64, patch_size=8, dim=48, n_layers=3, n_heads=4, mlp_dim=96),
        projector=ProjectorConfig(in_dim=48, out_dim=64),
        template="llama_3", dtype="float32",
    ),
    "tiny-clip-qwen2": VLMConfig(
        text=TextConfig(arch="qwen2", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=1,
                        ffn_dim=128, rope_theta=1e6, qkv_bias=True, tie_embeddings=True, max_seq_len=512),
        vision=VisionConfig(kind="clip", image_size=56, patch_size=8, dim=48, n_layers=3, n_heads=4,
                            mlp_dim=96, act="quick_gelu", norm_eps=1e-5, cls_token=True, pre_norm=True,
                            patch_bias=False, select_feature="patch",
                            image_mean=(0.48145466, 0.4578275, 0.40821073),
                            image_std=(0.26862954, 0.26130258, 0.27577711)),
        projector=ProjectorConfig(kind="mlp2x_gelu", in_dim=48, out_dim=64),
        template="hermes-2", dtype="float32",
    ),
}


def preset(name: str, **overrides) -> VLMConfig:
    """A preset by name, with top-level fields replaced (e.g. `dtype="float32"`)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return dataclasses.replace(PRESETS[name], **overrides)
