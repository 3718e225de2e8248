"""tinyvila.image.preprocess against transformers' PIL image processors, and its input handling.

Run: pytest tests/test_image.py. The HF comparisons skip without transformers. Observed max abs diff
against SiglipImageProcessor / CLIPImageProcessor (PIL backend): 0.0 (bit-identical); asserted <= 1e-6.
"""

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from tinyvila.config import PRESETS, VisionConfig
from tinyvila.errors import ImageError
from tinyvila.image import normalise_pixels, preprocess, resize_uint8

SIGLIP = VisionConfig(image_size=64)
CLIP = PRESETS["tiny-clip-qwen2"].vision


def _random(h=100, w=150, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _gradient(h=90, w=70) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([255 * x / (w - 1), 255 * y / (h - 1), 255 * (x + y) / (h + w - 2)], -1).round().astype(np.uint8)


def _hf_processor(cfg: VisionConfig):
    transformers = pytest.importorskip("transformers")
    kind = "Siglip" if cfg.kind == "siglip" else "CLIP"
    # transformers 5 names the PIL backend "...Pil"; 4.x has only the PIL one under the plain name.
    cls = getattr(transformers, f"{kind}ImageProcessorPil", None) or getattr(transformers, f"{kind}ImageProcessor")
    return cls(size={"height": cfg.image_size, "width": cfg.image_size}, do_center_crop=False,
               image_mean=list(cfg.image_mean), image_std=list(cfg.image_std), resample=Image.BICUBIC)


@pytest.mark.parametrize("cfg", [SIGLIP, CLIP], ids=["siglip", "clip"])
@pytest.mark.parametrize("make", [_random, _gradient, lambda: _random(20, 33, seed=1)], ids=["random", "gradient", "upscale"])
def test_matches_hf(cfg, make):
    a = make()
    ref = _hf_processor(cfg)(images=[Image.fromarray(a)], return_tensors="pt")["pixel_values"]
    ours = preprocess(a, cfg)
    assert ours.shape == ref.shape == (1, 3, cfg.image_size, cfg.image_size)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-6


def test_value_range_and_channels():
    """SigLIP normalisation maps 0..255 to [-1, 1]; channel c of the output is channel c of the input."""
    a = np.zeros((64, 64, 3), np.uint8)
    a[..., 1] = 255
    x = preprocess(a, SIGLIP)[0]
    assert torch.allclose(x[0], torch.tensor(-1.0)) and torch.allclose(x[1], torch.tensor(1.0))
    assert x.min() >= -1 and x.max() <= 1


def test_input_kinds_agree(tmp_path):
    a = _gradient()
    path = tmp_path / "g.png"
    Image.fromarray(a).save(path)
    batch = preprocess([a, Image.fromarray(a), path, str(path)], SIGLIP)
    assert batch.shape == (4, 3, 64, 64)
    for i in range(1, 4):
        assert torch.equal(batch[i], batch[0])


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "CMYK"])
def test_modes_convert_to_rgb(mode):
    im = Image.fromarray(_random(40, 50)).convert(mode)
    assert torch.equal(preprocess(im, SIGLIP), preprocess(im.convert("RGB"), SIGLIP))


def test_grey_image_is_grey():
    x = preprocess(Image.fromarray(_random(40, 50)).convert("L"), SIGLIP)[0]
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])


def test_resize_ignores_aspect_ratio():
    cfg = dataclasses.replace(SIGLIP, image_size=32)
    assert preprocess(_random(10, 300), cfg).shape == (1, 3, 32, 32)


@pytest.mark.parametrize("bad, match", [
    (np.zeros((8, 8, 3), np.float32), "dtype float32"),
    (np.zeros((8, 8), np.uint8), r"shape \(8, 8\)"),
    (np.zeros((8, 8, 4), np.uint8), r"shape \(8, 8, 4\)"),
    (np.zeros((0, 8, 3), np.uint8), r"shape \(0, 8, 3\)"),
    (42, "got int"),
])
def test_bad_arrays(bad, match):
    with pytest.raises(ImageError, match=match):
        preprocess(bad, SIGLIP)


def test_bad_item_in_list_is_named():
    with pytest.raises(ImageError, match=r"images\[1\]"):
        preprocess([_random(), np.zeros((4, 4), np.uint8)], SIGLIP)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jpg"
    with pytest.raises(ImageError, match="nope.jpg: image file not found"):
        preprocess(path, SIGLIP)


def test_unreadable_file(tmp_path):
    path = tmp_path / "fake.png"
    path.write_bytes(b"this is not an image")
    with pytest.raises(ImageError, match="fake.png: cannot read image"):
        preprocess(str(path), SIGLIP)


def test_truncated_file(tmp_path):
    path = tmp_path / "cut.png"
    Image.fromarray(_random()).save(path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ImageError, match="cut.png"):
        preprocess(path, SIGLIP)


def test_empty_list_and_error_class():
    with pytest.raises(ValueError, match="empty list"):  # ImageError is also a ValueError
        preprocess([], SIGLIP)


def _hf_numpy(a: np.ndarray, cfg: VisionConfig) -> np.ndarray:
    """HF's numpy arithmetic on one HxWx3 uint8 image: PIL bicubic resize, rescale in float64, cast to float32,
    (x - mean) / std in float32 -> (C, S, S)."""
    im = Image.fromarray(a).resize((cfg.image_size, cfg.image_size), resample=Image.BICUBIC)
    x = (np.asarray(im).astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    mean, std = np.asarray(cfg.image_mean, dtype=np.float32), np.asarray(cfg.image_std, dtype=np.float32)
    return ((x - mean) / std).transpose(2, 0, 1)


@pytest.mark.parametrize("cfg", [SIGLIP, CLIP], ids=["siglip", "clip"])
def test_uint8_path_is_hf_numpy_bit_for_bit(cfg):
    """resize_uint8 then normalise_pixels (what preprocess is; on the GPU as well where there is one) gives
    HF's numpy arithmetic bit for bit, for one image and a list."""
    images = [_random(), _gradient(), _random(20, 33, seed=1)]
    for x in (images[0], images):
        u8 = resize_uint8(x, cfg)
        n = len(x) if isinstance(x, list) else 1
        assert u8.dtype == torch.uint8 and u8.shape == (n, cfg.image_size, cfg.image_size, 3)
        want = torch.from_numpy(np.stack([_hf_numpy(a, cfg) for a in (x if isinstance(x, list) else [x])]))
        got = preprocess(x, cfg)
        assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, want)
        if torch.cuda.is_available():
            assert torch.equal(normalise_pixels(u8.cuda(), cfg).cpu(), want)


def test_normalise_pixels_rejects_other_input():
    with pytest.raises(ImageError, match="uint8 from resize_uint8"):
        normalise_pixels(torch.zeros(1, 3, 8, 8), SIGLIP)
    with pytest.raises(ImageError, match="uint8 from resize_uint8"):
        normalise_pixels(torch.zeros(1, 8, 8, 4, dtype=torch.uint8), SIGLIP)
