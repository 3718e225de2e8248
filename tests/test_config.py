"""Config: JSON round trip of every preset, derived sizes, and clear errors for bad files."""

import json

import pytest

from tinyvila.config import PRESETS, SparsityConfig, VLMConfig, preset


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
