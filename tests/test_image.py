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
from tinyvila import image
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
    batch = preprocess([a, Image.fromarray(a), path, str(path), path.read_bytes()], SIGLIP)
    assert batch.shape == (5, 3, 64, 64)
    for i in range(1, 5):
        assert torch.equal(batch[i], batch[0])


def test_file_bytes_get_the_file_checks(tmp_path):
    """An image file's contents (bytes) go through the same format allow-list and pixel limit as its path."""
    path = tmp_path / "x.tga"
    Image.fromarray(_random(32, 32)).save(path, format="TGA")
    with pytest.raises(ImageError, match=r"image \(\d+ bytes\): cannot read image \(not a JPEG, PNG"):
        preprocess(path.read_bytes(), SIGLIP)
    Image.fromarray(_random(40, 40)).save(path.with_suffix(".png"))
    with pytest.raises(ImageError, match=r"image \(\d+ bytes\): 40x40 is .* over the limit"):
        preprocess(path.with_suffix(".png").read_bytes(), SIGLIP, max_pixels=1000)
    with pytest.raises(ImageError, match=r"image \(3 bytes\): cannot read image"):
        preprocess(b"abc", SIGLIP)


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
    (np.full((8, 8, 3), 1.5, np.float32), r"float image must hold finite values in \[0, 1\], got 1.5..1.5"),
    (np.full((8, 8, 3), np.nan, np.float32), "finite values"),
    (np.zeros((8, 8, 3), np.int64), "dtype int64"),
    (np.full((8, 8, 3), 70000, np.int32), "values 70000..70000"),
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


# -- untrusted files and unusual pixel types ---------------------------------------------------------
def _save(tmp_path, a: np.ndarray, name: str, **kw):
    path = tmp_path / name
    Image.fromarray(a).save(path, **kw)
    return path


def test_pixel_limit_refuses_a_huge_png_before_decoding(tmp_path, monkeypatch):
    path = _save(tmp_path, np.zeros((300, 400, 3), np.uint8), "big.png")
    with pytest.raises(ImageError, match="big.png: 400x300 .* over the limit .*MAX_PIXELS"):
        preprocess(path, SIGLIP, max_pixels=100_000)
    monkeypatch.setattr(image, "MAX_PIXELS", 100_000)
    with pytest.raises(ImageError, match="big.png"):
        preprocess(path, SIGLIP)
    assert preprocess(path, SIGLIP, max_pixels=120_000).shape == (1, 3, 64, 64)


def test_a_huge_jpeg_is_decoded_downscaled(tmp_path, monkeypatch):
    path = _save(tmp_path, _gradient(800, 1200), "big.jpg", quality=95)
    decoded = []
    real = image._to_rgb
    monkeypatch.setattr(image, "_to_rgb", lambda im, what: decoded.append(im.size) or real(im, what))
    small = preprocess(path, SIGLIP, max_pixels=1200 * 800 // 16)
    assert decoded == [(300, 200)]  # decoded at 1/4 scale (DCT scaling), not in full
    full = preprocess(path, SIGLIP)
    assert decoded[-1] == (1200, 800) and (small - full).abs().max() < 0.1  # the same picture


def test_pillow_decompression_bomb_is_an_image_error(tmp_path, monkeypatch):
    path = _save(tmp_path, np.zeros((100, 100, 3), np.uint8), "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow raises past twice this
    with pytest.raises(ImageError, match="bomb.png: refused by Pillow's decompression-bomb limit"):
        preprocess(path, SIGLIP)


def test_closed_pil_image_is_an_image_error():
    im = Image.fromarray(_random())
    im.close()
    with pytest.raises(ImageError, match="image: cannot read the PIL image.*closed"):
        preprocess(im, SIGLIP)


@pytest.mark.parametrize("fmt", ["EPS", "ICO", "TGA"])
def test_formats_outside_the_allow_list_are_refused(tmp_path, fmt):
    path = tmp_path / f"x.{fmt.lower()}"
    Image.fromarray(_random(32, 32)).save(path, format=fmt)
    with pytest.raises(ImageError, match=f"x.{fmt.lower()}: cannot read image \\(not a JPEG, PNG"):
        preprocess(path, SIGLIP)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF", "PPM"])
def test_allowed_formats_load(tmp_path, fmt):
    path = tmp_path / f"x.{fmt.lower()}"
    Image.fromarray(_random(32, 32)).save(path, format=fmt)
    assert preprocess(path, SIGLIP).shape == (1, 3, 64, 64)


def test_16_bit_png_is_scaled_not_clipped(tmp_path):
    grey = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)  # 0..65520
    path = _save(tmp_path, grey, "deep.png")
    assert Image.open(path).mode == "I;16"
    got = resize_uint8(path, SIGLIP)[0, :, :, 0].numpy()
    want = resize_uint8(np.repeat(np.rint(grey / 257).astype(np.uint8)[..., None], 3, -1), SIGLIP)[0, :, :, 0].numpy()
    assert np.array_equal(got, want) and got.min() < 10 and got.max() > 240  # not all white


@pytest.mark.parametrize("mode", ["I", "F"])
def test_wide_pil_modes_are_scaled(mode):
    ramp = np.linspace(0, 1, 64 * 64).reshape(64, 64)
    a = (ramp * 65535).astype(np.int32) if mode == "I" else ramp.astype(np.float32)
    got = resize_uint8(Image.fromarray(a), SIGLIP)[0, :, :, 0].numpy()
    want = resize_uint8(np.repeat(np.rint(ramp * 255).astype(np.uint8)[..., None], 3, -1), SIGLIP)[0, :, :, 0].numpy()
    assert np.abs(got.astype(int) - want).max() <= 1 and got.max() > 240


@pytest.mark.parametrize("dtype", [np.uint16, np.float32, np.float64])
def test_uint16_and_float_arrays_are_scaled(dtype):
    a8 = _random()
    a = (a8.astype(np.uint16) * 257) if dtype == np.uint16 else (a8 / 255).astype(dtype)
    assert torch.equal(resize_uint8(a, SIGLIP), resize_uint8(a8, SIGLIP))


def test_exif_rotation_is_applied(tmp_path):
    a = _gradient(40, 80)  # landscape as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view": the camera was held upright
    path = _save(tmp_path, a, "phone.jpg", exif=exif, quality=95)
    seen = image.load_image(path)
    assert seen.size == (40, 80)  # portrait, as the photo is meant to be seen
    stored = Image.open(path).convert("RGB")  # the pixels as stored, no orientation applied
    assert np.array_equal(np.asarray(seen), np.asarray(stored.transpose(Image.Transpose.ROTATE_270)))
