"""scripts/profile_decode.py's settings parser (the script itself times CUDA graphs; only its CPU-side parts here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import profile_decode  # noqa: E402

from csrc_triton import w4a16_gemv  # noqa: E402


def test_gemvcfg_changes_only_the_named_fields_of_the_named_shapes():
    table = w4a16_gemv.GEMV_TABLE
    every = profile_decode.gemv_cfg_entries("all:s4")
    assert set(every) == set(profile_decode.GEMV_SHAPES.values()) <= set(table)
    for key, cfg in every.items():
        assert cfg == {**table[key], "STAGES": 4}
    one = profile_decode.gemv_cfg_entries("gate_up:n64g2s8k2w2")
    key = profile_decode.GEMV_SHAPES["gate_up"]
    assert one == {key: {**table[key], "BLOCK_N": 64, "GPS": 2, "STAGES": 8, "SPLIT_K": 2, "num_warps": 2}}


def test_gemvcfg_patch_is_undone_after_the_variant():
    key = profile_decode.GEMV_SHAPES["o"]
    before = dict(w4a16_gemv.GEMV_TABLE[key])
    with profile_decode._patch("gemvcfg=o:g4s5"):
        assert w4a16_gemv.GEMV_TABLE[key] == {**before, "GPS": 4, "STAGES": 5}
    assert w4a16_gemv.GEMV_TABLE[key] == before


@pytest.mark.parametrize("value", ["o", "o:", "x:s4", "o:q4", "o:s", "o:s4x", "all:4"])
def test_gemvcfg_rejects_malformed_settings(value):
    with pytest.raises(SystemExit, match="bad gemvcfg"):
        profile_decode.gemv_cfg_entries(value)


def test_attncfg_sets_the_named_fields_for_every_length_and_is_undone():
    from csrc_triton import decode_attention

    first = decode_attention.CONFIG_BY_LENGTH[0][1:]  # (block_n, warps, stages, programs per SM, prefetch)
    before = decode_attention.default_config
    with profile_decode._patch("attncfg=n64s2p0"):
        for max_len in (100, 8192, 200_000):
            assert decode_attention.default_config(max_len) == (64, first[1], 2, first[3], 0)
    assert decode_attention.default_config is before


@pytest.mark.parametrize("value", ["", "n", "n64x", "q4", "64"])
def test_attncfg_rejects_malformed_settings(value):
    with pytest.raises(SystemExit, match="bad attncfg"):
        profile_decode.attn_cfg(value)
