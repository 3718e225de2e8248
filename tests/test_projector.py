"""Projector against VILA's own mlp_downsample math (its flat_square reshape sequence, restated here).

Run: python -m pytest tests/test_projector.py. `vila_flat_square` below repeats the view/permute
steps of VILA's DownSampleBlock (NVlabs/VILA llava/model/multimodal_projector/base_projector.py),
and `_vila_layers` builds the `layers` Sequential VILA saves, so the importer's names are tested too.
"""

import math

import pytest
import torch
from torch import nn

from tinyvila.config import ProjectorConfig, VisionConfig
from tinyvila.convert.hf import projector_config_from_hf, projector_weights_from_hf
from tinyvila.projector import Projector
from _counting import CountingReads  # noqa: E402

D, d = 8, 16


def vila_flat_square(feats: torch.Tensor) -> torch.Tensor:
    """VILA's DownSampleBlock: (n, N, c) -> (n, N', 4c). Dim 1 of the grid is rows, dim 2 columns."""
    n, N, c = feats.shape
    s = int(N ** 0.5)
    x = feats.reshape(n, s, s, c)
    if x.shape[1] % 2 == 1:
        x = torch.concat([x, torch.zeros((n, 1, x.shape[2], c), dtype=x.dtype)], dim=1)
    if x.shape[2] % 2 == 1:
        x = torch.concat([x, torch.zeros((n, x.shape[1], 1, c), dtype=x.dtype)], dim=2)
    n, w, h, c = x.shape
    x = x.view(n, w, h // 2, c * 2)
    x = x.permute(0, 2, 1, 3).contiguous()
    x = x.view(n, h // 2, w // 2, c * 4)
    return x.reshape(n, -1, c * 4)


def _vision(side: int) -> VisionConfig:
    return VisionConfig(image_size=side * 2, patch_size=2, dim=D, n_layers=1, n_heads=2, mlp_dim=16)


def _vila_layers(kind: str, seed: int) -> nn.Module:
    """A module whose state dict has VILA's MultimodalProjector names, with random weights."""
    torch.manual_seed(seed)
    m = nn.Module()
    if kind == "mlp_downsample":  # index 0 is the parameter-free DownSampleBlock
        m.layers = nn.Sequential(nn.Identity(), nn.LayerNorm(4 * D), nn.Linear(4 * D, d), nn.GELU(), nn.Linear(d, d))
        with torch.no_grad():
            m.layers[1].weight.normal_(1.0, 0.2)
            m.layers[1].bias.normal_(0.0, 0.2)
    elif kind == "mlp2x_gelu":
        m.layers = nn.Sequential(nn.Linear(D, d), nn.GELU(), nn.Linear(d, d))
    else:
        m.layers = nn.Linear(D, d)
    return m.eval()


def _ours(kind: str, side: int, hf_sd: dict) -> Projector:
    cfg = projector_config_from_hf({"mm_projector_type": kind, "model_type": "v2l_projector"}, D, d)
    sd, used = projector_weights_from_hf(hf_sd, cfg)
    assert used == set(hf_sd)
    with torch.device("meta"):
        proj = Projector(cfg, _vision(side))
    proj.load_state_dict({k.removeprefix("projector."): v for k, v in sd.items()}, strict=True, assign=True)
    return proj


@pytest.mark.parametrize("side", [7, 5, 8, 1])
def test_merge_matches_vila_flat_square(side):
    proj = _ours("mlp_downsample", side, _vila_layers("mlp_downsample", 0).state_dict())
    feats = torch.randn(3, side * side, D)
    out = proj.merge(feats)
    ref = vila_flat_square(feats)
    assert out.shape == (3, proj.n_out, 4 * D) == ref.shape
    assert proj.n_out == ((side + 1) // 2) ** 2
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("side", [5, 4])
def test_merge_token_order_explicit(side):
    """Integer grid, value 10*row + col + 1 (so 0 marks padding): merged token t = j*h + i holds
    [x(2i,2j), x(2i,2j+1), x(2i+1,2j), x(2i+1,2j+1)]."""
    proj = _ours("mlp_downsample", side, _vila_layers("mlp_downsample", 0).state_dict())
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    grid = (10 * rows + cols + 1).float().reshape(1, side * side, 1).expand(1, -1, D)  # (1, N, D)
    out = proj.merge(grid)
    h = math.ceil(side / 2)
    for t in range(h * h):
        j, i = divmod(t, h)
        expect = [10 * r + c + 1 if r < side and c < side else 0
                  for r, c in ((2 * i, 2 * j), (2 * i, 2 * j + 1), (2 * i + 1, 2 * j), (2 * i + 1, 2 * j + 1))]
        got = out[0, t].view(4, D)
        assert torch.equal(got, torch.tensor(expect, dtype=torch.float32)[:, None].expand(4, D)), (t, got[:, 0])


@pytest.mark.parametrize("side", [7, 8])
def test_mlp_downsample_matches_vila(side):
    vila = _vila_layers("mlp_downsample", 1)
    proj = _ours("mlp_downsample", side, vila.state_dict())
    feats = torch.randn(2, side * side, D)
    with torch.no_grad():
        ref = vila.layers[1:](vila_flat_square(feats))
        out = proj(feats)
    assert out.shape == (2, ((side + 1) // 2) ** 2, d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # mlp on a subset of merged tokens (SparseVILA prunes between merge and mlp) equals the subset.
    keep = torch.tensor([0, 3, proj.n_out - 1])
    with torch.no_grad():
        torch.testing.assert_close(proj.mlp(proj.merge(feats)[:, keep]), ref[:, keep], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["mlp2x_gelu", "linear"])
def test_other_kinds_match_vila(kind):
    vila = _vila_layers(kind, 2)
    proj = _ours(kind, 7, vila.state_dict())
    feats = torch.randn(2, 49, D)
    with torch.no_grad():
        torch.testing.assert_close(proj(feats), vila.layers(feats), rtol=1e-5, atol=1e-6)
    assert torch.equal(proj.merge(feats), feats)
    assert (proj.norm is None) and ((proj.fc2 is None) == (kind == "linear"))


@pytest.mark.parametrize("kind", ["mlp_downsample", "mlp2x_gelu", "linear"])
def test_weight_names_and_missing_key(kind):
    hf_sd = dict(_vila_layers(kind, 3).state_dict())
    cfg = ProjectorConfig(kind=kind, in_dim=D, out_dim=d)
    counted = CountingReads(hf_sd)
    sd, used = projector_weights_from_hf(counted, cfg)
    assert used == set(hf_sd) == set(counted.reads) and max(counted.reads.values()) == 1
    assert len(sd) == len(hf_sd)
    with torch.device("meta"):
        assert {k.removeprefix("projector.") for k in sd} == set(Projector(cfg, _vision(7)).state_dict())
    missing = sorted(hf_sd)[-1]
    del hf_sd[missing]
    with pytest.raises(KeyError, match=missing.replace(".", r"\.")):
        projector_weights_from_hf(hf_sd, cfg)


def test_config_and_errors():
    cfg = projector_config_from_hf({"mm_projector_type": "mlp_downsample"}, 1152, 4096)
    assert (cfg.kind, cfg.merged_dim, cfg.n_tokens(VisionConfig())) == ("mlp_downsample", 4608, 196)
    with pytest.raises(ValueError, match="mm_projector_type"):
        projector_config_from_hf({"mm_projector_type": "mlp_downsample_3x3_fix"}, 8, 16)
    proj = _ours("mlp_downsample", 5, _vila_layers("mlp_downsample", 0).state_dict())
    with pytest.raises(ValueError, match="25 tokens"):
        proj.merge(torch.randn(1, 16, D))
    clip_cls = VisionConfig(image_size=16, patch_size=2, dim=D, n_layers=1, n_heads=2, mlp_dim=16, cls_token=True)
    with pytest.raises(ValueError, match="square"), torch.device("meta"):
        Projector(ProjectorConfig(in_dim=D, out_dim=d), clip_cls)
