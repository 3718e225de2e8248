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
from pathlib import Path, PurePath

from .errors import CheckpointError, ConfigError, ModelNotFoundError
from .tokenizer.templates import TEMPLATES

# The largest context a config may declare. The KV cache is preallocated to it, so a typo (10**12) must not
# reach an allocation; 1<<22 (4M tokens) is 4x the longest context public models declare (1M), and already
# 512 GiB of cache at vila-8b's 128 KiB per token.
MAX_SEQ_LEN = 1 << 22
# Sizes a kernel indexes with int32, and layer counts a model is built from one by one (the deepest public
# LLMs have ~128): past these a value is a typo, and building the model alone would take hours.
MAX_SIZE, MAX_LAYERS = 1 << 31, 1024
DTYPES = ("float16", "bfloat16", "float32", "float64")  # float64: exactness tests


def _describe(t: str, positive: bool) -> str:
    """What a value of annotation `t` must be, in words (for error messages)."""
    if t.endswith(" | None"):
        return _describe(t[:-7], positive) + " or null"
    if t.startswith("tuple["):
        return "a list of " + _describe(t[6:-6], positive).removeprefix("a ").removeprefix("an ") + "s"
    pos = "positive " if positive else ""
    return {"int": f"a {pos}integer", "float": f"a {pos}finite number", "bool": "true or false",
            "str": "a string"}.get(t, "an object")


def _type_ok(v, t: str, positive: bool) -> bool:
    if t.endswith(" | None"):
        return v is None or _type_ok(v, t[:-7], positive)
    if t.startswith("tuple["):
        return isinstance(v, tuple) and all(_type_ok(x, t[6:-6], positive) for x in v)
    if t in ("int", "float"):
        kinds = int if t == "int" else (int, float)
        return (isinstance(v, kinds) and not isinstance(v, bool) and math.isfinite(v)
                and (v > 0 or not positive))
    return type(v).__name__ == t  # bool, str, and the nested config classes


def _validate(obj, positive: tuple[str, ...] = (), **choices: tuple[str, ...]) -> None:
    """Every field of the dataclass `obj` against its annotation (`positive`: and > 0), and each field named in
    `choices` among its allowed values. Raises ConfigError naming the field."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if not _type_ok(v, f.type, f.name in positive):
            raise ConfigError(f"{f.name} must be {_describe(f.type, f.name in positive)}, got {v!r}")
        limit = {"n_layers": MAX_LAYERS, "max_seq_len": MAX_SEQ_LEN}.get(f.name, MAX_SIZE)
        if f.type.startswith("int") and v is not None and abs(v) > limit:
            raise ConfigError(f"{f.name} must be at most {limit}, got {v}")
    for name, known in choices.items():
        if getattr(obj, name) not in known:
            raise ConfigError(f"{name} must be one of {', '.join(known)}, got {getattr(obj, name)!r}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


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

    def __post_init__(self):
        _validate(self, ("image_size", "patch_size", "n_channels", "dim", "n_layers", "n_heads", "mlp_dim", "norm_eps",
                         "image_std", "rescale_factor"), kind=("siglip", "clip", "dinov2"),
                  act=("gelu_tanh", "gelu", "quick_gelu"), select_feature=("cls_patch", "patch"))
        _require(self.patch_size <= self.image_size,
                 f"patch_size must be at most image_size ({self.image_size}), got {self.patch_size}")
        _require(self.dim % self.n_heads == 0, f"dim must be a multiple of n_heads ({self.n_heads}), got {self.dim}")
        _require(self.norm_eps < 1, f"norm_eps must be in (0, 1), got {self.norm_eps}")
        _require(self.rescale_factor <= 1, f"rescale_factor must be in (0, 1], got {self.rescale_factor}")
        for name in ("image_mean", "image_std"):
            _require(len(getattr(self, name)) == self.n_channels,
                     f"{name} must hold n_channels ({self.n_channels}) numbers, got {list(getattr(self, name))}")
        _require(-self.n_layers - 1 <= self.select_layer <= self.n_layers,
                 f"select_layer must be in [{-self.n_layers - 1}, {self.n_layers}], got {self.select_layer}")

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

    def __post_init__(self):
        _validate(self, ("in_dim", "out_dim", "norm_eps"), kind=("mlp_downsample", "mlp2x_gelu", "linear"))
        _require(self.norm_eps < 1, f"norm_eps must be in (0, 1), got {self.norm_eps}")

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

    def __post_init__(self):
        _validate(self, ("factor", "low_freq_factor", "high_freq_factor", "original_max_position"))
        _require(self.high_freq_factor > self.low_freq_factor,  # their difference divides the smoothing
                 f"high_freq_factor must be larger than low_freq_factor ({self.low_freq_factor}), "
                 f"got {self.high_freq_factor}")


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

    def __post_init__(self):
        _validate(self, ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "norm_eps", "rope_theta",
                         "max_seq_len", "head_dim_override"), arch=("llama", "qwen2"))
        _require(self.n_heads % self.n_kv_heads == 0,
                 f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads, got {self.n_kv_heads}")
        _require(self.head_dim_override is not None or self.dim % self.n_heads == 0,
                 f"dim must be a multiple of n_heads ({self.n_heads}) unless head_dim_override is set, got {self.dim}")
        _require(self.head_dim % 2 == 0, f"the head size must be even (RoPE rotates pairs), got {self.head_dim}")
        _require(self.norm_eps < 1, f"norm_eps must be in (0, 1), got {self.norm_eps}")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    def check_context(self, n: int | None, name: str = "max_seq_len") -> None:
        """ConfigError if a KV cache of `n` tokens runs past the declared context (RoPE positions the model never
        saw in training). The CLI checks `--max-seq-len`; benchmarks at synthetic shapes may pass more to chat()."""
        if n is not None and n > self.max_seq_len:
            raise ConfigError(f"{name} {n} is past the model's declared context of {self.max_seq_len} tokens "
                              f"(config.json text.max_seq_len); pass at most {self.max_seq_len}")

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim


@dataclass(frozen=True)
class QuantConfig:
    """How the weights in this folder are stored. "none" = fp16/bf16 dense."""

    llm: str = "none"                   # "none" | "w4a16"
    vision: str = "none"                # "none" | "w8a8"
    group_size: int = 128

    def __post_init__(self):
        _validate(self, llm=("none", "w4a16"), vision=("none", "w8a8"))
        _require(self.group_size in (32, 64, 128), f"group_size must be 32, 64 or 128, got {self.group_size!r}")


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
        _validate(self, prefill_method=("sparsevila", "random", "visionzip"),
                  prefill_positions=("contiguous", "original"))
        for name in ("prefill_keep", "decode_keep"):
            _require(0.0 < getattr(self, name) <= 1.0, f"{name} must be in (0, 1], got {getattr(self, name)}")
        _require(self.decode_window >= 0, f"decode_window must be >= 0, got {self.decode_window}")


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
        _validate(self, template=tuple(TEMPLATES), dtype=DTYPES)
        _require((self.vision is None) == (self.projector is None), "vision and projector must both be set or both be null")
        tok = PurePath(self.tokenizer)
        _require(bool(self.tokenizer) and not tok.is_absolute() and ".." not in tok.parts,
                 f"tokenizer must be a file name inside the checkpoint folder, got {self.tokenizer!r}")
        bad = [i for i in self.eos_ids if not 0 <= i < self.text.vocab_size]
        _require(not bad, f"eos_ids must be ids below text.vocab_size ({self.text.vocab_size}), got {list(self.eos_ids)}")
        if self.quant.llm == "w4a16":
            _require(self.text.dim % self.quant.group_size == 0 and self.text.ffn_dim % self.quant.group_size == 0,
                     f"quant.group_size ({self.quant.group_size}) must divide text.dim and text.ffn_dim")
        if self.vision is not None:
            self._check_vision()

    def _check_vision(self):
        _require(self.projector.in_dim == self.vision.dim,
                 f"projector.in_dim must equal vision.dim ({self.vision.dim}), got {self.projector.in_dim}")
        _require(self.projector.out_dim == self.text.dim,
                 f"projector.out_dim must equal text.dim ({self.text.dim}), got {self.projector.out_dim}")
        side = math.isqrt(self.vision.n_out_tokens)
        _require(self.projector.kind != "mlp_downsample" or side * side == self.vision.n_out_tokens,
                 f"projector.kind mlp_downsample needs a square grid of vision tokens, got {self.vision.n_out_tokens}")

    @property
    def image_tokens(self) -> int:
        """LLM tokens per image (0 for text-only models)."""
        return 0 if self.vision is None else self.projector.n_tokens(self.vision)

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VLMConfig":
        """A config from its JSON form; ConfigError names the field at fault (`text.dim`)."""
        if not isinstance(d, dict):
            raise ConfigError(f"the config must be a JSON object, got {type(d).__name__}")
        _require("text" in d, "text: missing (the LLM's section)")
        d = dict(d)
        for name, sub in (("text", TextConfig), ("vision", VisionConfig), ("projector", ProjectorConfig),
                          ("quant", QuantConfig), ("sparsity", SparsityConfig)):
            if d.get(name) is not None or name in ("quant", "sparsity") and name in d:
                d[name] = _section(sub, d[name], name)
        return _section(cls, d, "")

    def save(self, folder: str | Path) -> None:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "VLMConfig":
        """`folder`/config.json; ModelNotFoundError if it is missing, CheckpointError naming the file and the
        field if it is not a valid config."""
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no config.json; is this a tinyvila checkpoint folder?")
        try:
            return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, RecursionError, ValueError) as e:  # JSONDecodeError, ConfigError
            raise CheckpointError(f"{path}: not a valid tinyvila config: {e}; fix config.json, or rebuild the "
                                  "checkpoint with scripts/quantize.py") from None


def _section(cls, d, name: str):
    """`cls(**d)` for the JSON object of config section `name` (lists become tuples, rope_scaling a RopeScaling);
    a ConfigError names the field as `name.field`."""
    where = f"{name}." if name else ""
    if not isinstance(d, dict):
        raise ConfigError(f"{name} must be an object, got {d!r}")
    known = {f.name: f.type for f in dataclasses.fields(cls)}
    unknown = [k for k in d if k not in known]
    _require(not unknown, f"{where}{unknown[0] if unknown else ''}: unknown field (known: {', '.join(known)})")
    d = {k: tuple(v) if isinstance(v, list) and known[k].startswith("tuple") else v for k, v in d.items()}
    try:
        if isinstance(d.get("rope_scaling"), dict):
            d["rope_scaling"] = _section(RopeScaling, d["rope_scaling"], "rope_scaling")
        return cls(**d)
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None


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
    # VILA1.5-13B: the same vision side -> a Llama-2-13B LLM, vicuna_v1 template, sentencepiece. Shapes from
    # Llama-2-13B's published config (40 layers, hidden 5120, 40 heads = 40 KV heads, FFN 13824, vocab 32000,
    # 4096 context, rope_theta 1e4, RMSNorm eps 1e-5); the template and the 5120-wide projector from the reference
    # notes (VILA's conv-mode mapping; TinyChat's per-model hidden sizes).
    "vila-13b": VLMConfig(
        text=TextConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824,
                        rope_theta=10000.0, max_seq_len=4096),
        vision=SIGLIP_SO400M, projector=ProjectorConfig(out_dim=5120),
        template="vicuna_v1", tokenizer="tokenizer.model", eos_ids=(2,), dtype="float16",
    ),
    # VILA1.5-40B: the same vision side -> a Yi-34B LLM, VILA's hermes-2 (ChatML) template, sentencepiece.
    # Layers, widths, heads, FFN and vocab from the reference notes (60 layers, hidden 7168, 56 heads / 8 KV heads
    # of 128, FFN 20480, vocab 64000); rope_theta 5e6, 4096 context and eos id 2 (<|endoftext|>) from Yi-34B's
    # published config. Splits over 2, 4 or 8 ranks at W4 g128 (tinyvila/tp.py).
    "vila-40b": VLMConfig(
        text=TextConfig(vocab_size=64000, dim=7168, n_layers=60, n_heads=56, n_kv_heads=8, ffn_dim=20480,
                        rope_theta=5000000.0, max_seq_len=4096),
        vision=SIGLIP_SO400M, projector=ProjectorConfig(out_dim=7168),
        template="hermes-2", tokenizer="tokenizer.model", eos_ids=(2,), dtype="float16",
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
