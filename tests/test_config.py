"""Config: JSON round trip of every preset, derived sizes, and clear errors for bad files and values."""

import dataclasses
import json

import pytest

from tinyvila.config import (MAX_SEQ_LEN, PRESETS, RopeScaling, SparsityConfig, TextConfig, VisionConfig, VLMConfig,
                             preset)
from tinyvila.errors import CheckpointError, ConfigError, TinyVilaError


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_json(name, tmp_path):
    cfg = PRESETS[name]
    cfg.save(tmp_path)
    assert VLMConfig.load(tmp_path) == cfg


def test_vila_shapes_are_derived_from_the_config():
    cfg = preset("vila-8b")
    assert cfg.vision.n_patches == 729 and cfg.vision.head_dim == 72
    assert cfg.vision.n_run_layers == 26          # hidden_states[-2] of 27 layers
    assert cfg.image_tokens == 196                # 27x27 padded to 28x28, 2x2 merged
    assert cfg.projector.merged_dim == 4608
    assert cfg.text.head_dim == 128 and cfg.text.qkv_dim == (32 + 16) * 128
    clip = preset("tiny-clip-qwen2")
    assert clip.vision.n_tokens == clip.vision.n_patches + 1
    assert clip.image_tokens == clip.vision.n_patches  # "patch" drops CLS, mlp2x_gelu keeps the rest


def test_sparsity_keeps_are_validated():
    with pytest.raises(ValueError, match="prefill_keep"):
        SparsityConfig(prefill_keep=0.0)
    with pytest.raises(ValueError, match="decode_keep"):
        SparsityConfig(decode_keep=1.5)


def test_bad_config_files_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        VLMConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        VLMConfig.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text": {"bogus_field": 1}}))
    with pytest.raises(ValueError, match="not a valid tinyvila config"):
        VLMConfig.load(tmp_path)


def _with(section: str | None, **values) -> dict:
    d = PRESETS["tiny-siglip-llama"].to_dict()
    (d if section is None else d[section]).update(values)
    return d


NONSENSE = [  # (section, field, value, words the message must hold): each loaded before, or raised a bare error
    ("text", "norm_eps", 0.0, "text.norm_eps must be a positive finite number, got 0.0"),
    ("text", "norm_eps", float("nan"), "text.norm_eps must be a positive finite number, got nan"),
    ("text", "norm_eps", 2.0, "text.norm_eps must be in (0, 1)"),
    ("text", "rope_theta", -1.0, "text.rope_theta must be a positive"),
    ("text", "rope_scaling", {"factor": 0}, "text.rope_scaling.factor must be a positive"),
    ("text", "rope_scaling", {"low_freq_factor": 4.0}, "text.rope_scaling.high_freq_factor must be larger"),
    ("text", "max_seq_len", -1, "text.max_seq_len must be a positive integer, got -1"),
    ("text", "max_seq_len", 512.5, "text.max_seq_len must be a positive integer, got 512.5"),
    ("text", "max_seq_len", 10**12, f"text.max_seq_len must be at most {MAX_SEQ_LEN}"),
    ("text", "dim", "x", "text.dim must be a positive integer, got 'x'"),
    ("text", "n_layers", 10**6, "text.n_layers must be at most 1024"),  # building its meta model took minutes
    ("text", "vocab_size", 2**70, "text.vocab_size must be at most"),
    ("text", "dim", 66, "text.dim must be a multiple of n_heads (4)"),
    ("text", "n_kv_heads", 3, "text.n_heads (4) must be a multiple of n_kv_heads, got 3"),
    ("text", "arch", "mistral", "text.arch must be one of llama, qwen2, got 'mistral'"),
    ("text", "bogus", 1, "text.bogus: unknown field"),
    ("vision", "image_std", [0.5, 0.0, 0.5], "vision.image_std must be a list of positive finite numbers"),
    ("vision", "image_std", [0.5, 0.5], "vision.image_std must hold n_channels (3) numbers"),
    ("vision", "image_size", -64, "vision.image_size must be a positive integer, got -64"),
    ("vision", "patch_size", 128, "vision.patch_size must be at most image_size (64)"),
    ("vision", "act", "relu", "vision.act must be one of"),
    ("vision", "select_layer", -9, "vision.select_layer must be in [-4, 3]"),
    ("projector", "kind", "mlp3x", "projector.kind must be one of"),
    ("projector", "in_dim", 32, "projector.in_dim must equal vision.dim (48)"),
    ("quant", "llm", "w3a16", "quant.llm must be one of none, w4a16"),
    ("quant", "group_size", 100, "quant.group_size must be 32, 64 or 128"),
    ("sparsity", "decode_keep", "all", "sparsity.decode_keep must be a finite number"),
    (None, "template", "chatml", "template must be one of"),
    (None, "dtype", "fp16", "dtype must be one of float16, bfloat16, float32, float64"),
    (None, "tokenizer", "/etc/passwd", "tokenizer must be a file name inside the checkpoint folder"),
    (None, "tokenizer", "../other/tokenizer.json", "tokenizer must be a file name inside the checkpoint folder"),
    (None, "eos_ids", [600], "eos_ids must be ids below text.vocab_size (512)"),
    (None, "text", "llama", "text must be an object"),
    (None, "quant", [1], "quant must be an object"),
]


@pytest.mark.parametrize("section,name,value,words", NONSENSE, ids=[f"{s}.{n}={v!r}" for s, n, v, _ in NONSENSE])
def test_nonsense_values_are_refused_naming_the_field(tmp_path, section, name, value, words):
    (tmp_path / "config.json").write_text(json.dumps(_with(section, **{name: value})))
    with pytest.raises(CheckpointError) as e:
        VLMConfig.load(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and words in str(e.value)


def test_missing_text_section_is_named():
    with pytest.raises(ConfigError, match="text: missing"):
        VLMConfig.from_dict({"template": "llama_3"})


def test_dataclasses_validate_when_built_in_python():
    with pytest.raises(ConfigError, match="norm_eps"):
        TextConfig(norm_eps=-1e-5)
    with pytest.raises(ConfigError, match="image_std"):
        VisionConfig(image_std=(0.5, 0.5, 0.0))
    with pytest.raises(ConfigError, match="factor"):
        RopeScaling(factor=0.0)
    with pytest.raises(ConfigError, match="dtype"):
        dataclasses.replace(PRESETS["tiny-clip-qwen2"], dtype="fp16")
    assert ConfigError.__mro__[1:3] == (TinyVilaError, ValueError)  # generic ValueError handlers keep working


def test_integer_like_floats_are_fine_for_float_fields():
    cfg = VLMConfig.from_dict(_with("text", rope_theta=10000, norm_eps=1e-5))
    assert cfg.text.rope_theta == 10000
