"""Image preprocessing: files, PIL images or arrays -> normalised (N, C, S, S) float32 pixels.

Follows VILA1.5's `image_aspect_ratio: resize` path exactly: PIL `convert("RGB")`, bicubic resize to
S x S ignoring the aspect ratio with PIL (as HF's SiglipImageProcessor / CLIPImageProcessor do with
their PIL backend), x * rescale_factor, then (x - mean) / std. Arithmetic follows HF's numpy code
(rescale in float64, cast to float32, normalise in float32) so pixels match it bit for bit.
Video frames are images: pass a list. `preprocess` does it all on the CPU; `resize_uint8` stops before the
rescale and `normalise_pixels` finishes on any device with the same arithmetic (the runtime uploads uint8
pixels and normalises them on the GPU: a quarter of the bytes, and no float32 copy on the CPU).
Files are untrusted input: an allow-list of formats, a pixel limit checked before decoding (huge JPEGs decoded
downscaled), EXIF rotation applied as a camera user expects, 16-bit and float pixels scaled, not clipped.
"""

from __future__ import annotations

import functools
import io
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .config import VisionConfig
from .errors import ImageError

ImageInput = Image.Image | str | os.PathLike | bytes | np.ndarray  # bytes: an image file's contents

# Files are decoded in full up to this many pixels (64 Mi, 192 MiB as RGB: past any camera photo, so preprocessing
# stays HF's to the bit). A larger JPEG is decoded at 1/2, 1/4 or 1/8 scale (DCT scaling, `Image.draft`) to fit;
# any other larger image is refused. Set it, or pass max_pixels=, to change it.
MAX_PIXELS = 64 * 2**20
# Formats a file may be in: the ones cameras and datasets use. Pillow knows more (EPS runs Ghostscript, say).
FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "PPM")  # JPEG includes MPO (phone photos)
_DRAFT = ("JPEG", "MPO")  # the formats whose decoder can downscale while decoding


def load_image(image: ImageInput, what: str = "image", max_pixels: int | None = None) -> Image.Image:
    """One image input -> an RGB PIL image, EXIF orientation applied. `what` names the argument in errors;
    `max_pixels` (default MAX_PIXELS) bounds what a file may decode to.

    Alpha is dropped, not composited (PIL `convert("RGB")`), because VILA converts before HF sees it.
    16-bit images are scaled to 8 bits (x / 257); float images and arrays must hold values in [0, 1].
    """
    if isinstance(image, Image.Image):
        try:
            return _to_rgb(ImageOps.exif_transpose(image), what)
        except (ValueError, OSError) as e:  # a closed image, a lazily opened file that is gone or corrupt
            raise ImageError(f"{what}: cannot read the PIL image ({e}); pass an open image or a file path") from None
    limit = MAX_PIXELS if max_pixels is None else max_pixels
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise ImageError(f"{path}: image file not found")
        return _open_file(path, str(path), limit)
    if isinstance(image, (bytes, bytearray, memoryview)):  # a file's contents: the same format and pixel checks
        return _open_file(io.BytesIO(image), f"{what} ({len(image)} bytes)", limit)
    if isinstance(image, np.ndarray):
        return _from_array(image, what)
    raise ImageError(f"{what}: expected a PIL image, a file path, a file's bytes or an HxWx3 uint8 array, got "
                     f"{type(image).__name__}")


def _open_file(path: Path | io.BytesIO, name: str, max_pixels: int) -> Image.Image:
    """An image file (a path, or its contents) -> RGB, through the format allow-list and the pixel limit; errors name
    it as `name`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies below
            im = Image.open(path, formats=FORMATS)
        with im:
            _fit(im, name, max_pixels)
            return _to_rgb(ImageOps.exif_transpose(im), name)  # forces the full decode while the file is open
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(f"{name}: refused by Pillow's decompression-bomb limit ({e})") from None
    except UnidentifiedImageError:
        raise ImageError(f"{name}: cannot read image (not a {', '.join(FORMATS)} file, or corrupt)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ImageError(f"{name}: cannot read image ({e})") from None


def _fit(im: Image.Image, name: str, max_pixels: int) -> None:
    """Sets up `im` (opened, not decoded) to decode to at most max_pixels, or raises ImageError."""
    w, h = im.size
    if w * h > max_pixels and im.format in _DRAFT:
        scale = next((s for s in (2, 4, 8) if (w // s) * (h // s) <= max_pixels), 8)
        im.draft("RGB", (w // scale, h // scale))
    if im.size[0] * im.size[1] > max_pixels:
        raise ImageError(f"{name}: {w}x{h} is {w * h / 2**20:.0f} Mi pixels, over the limit of {max_pixels / 2**20:.0f} "
                         "Mi (tinyvila.image.MAX_PIXELS); downscale the image, or raise the limit")


def _to_rgb(im: Image.Image, what: str) -> Image.Image:
    """Any PIL mode -> RGB; 16-bit and float greyscale are scaled to 8 bits, not clipped."""
    if im.mode.startswith("I") or im.mode == "F":
        return Image.fromarray(_to_uint8(np.asarray(im), what)).convert("RGB")
    return im.convert("RGB")


def _to_uint8(a: np.ndarray, what: str) -> np.ndarray:
    """uint8 as is; uint16 (and 16-bit values held in int32, as PIL's mode I) x / 257; floats in [0, 1] x * 255."""
    if a.dtype == np.uint8:
        return a
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or a.min(initial=0) < 0 or a.max(initial=0) > 1:
            raise ImageError(f"{what}: a float image must hold finite values in [0, 1], got "
                             f"{a.min()}..{a.max()}; scale it to [0, 1] or pass uint8")
        return np.rint(a * 255).astype(np.uint8)
    if a.dtype in (np.uint16, np.int32) and a.min(initial=0) >= 0 and a.max(initial=0) <= 65535:
        return ((a.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)  # round(x * 255 / 65535)
    raise ImageError(f"{what}: pixels must be uint8 (0..255), uint16 (0..65535) or float (0..1), got dtype {a.dtype}"
                     + (f" with values {a.min()}..{a.max()}" if a.dtype.kind in "iu" and a.size else ""))


def _from_array(a: np.ndarray, what: str) -> Image.Image:
    if a.ndim != 3 or a.shape[2] != 3 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ImageError(f"{what}: array must be HxWx3 (RGB, channels last), got shape {tuple(a.shape)}")
    return Image.fromarray(np.ascontiguousarray(_to_uint8(a, what)))  # HxWx3 uint8 is RGB


def _resize(im: Image.Image, cfg: VisionConfig) -> np.ndarray:
    """RGB PIL image -> (S, S, C) uint8, HF's bicubic resize."""
    s = cfg.image_size
    return np.asarray(im.resize((s, s), resample=Image.BICUBIC))


def _each(images: ImageInput | list[ImageInput], cfg: VisionConfig, fn, max_pixels: int | None) -> list[np.ndarray]:
    """fn(RGB PIL image, cfg) of every input image; the checks and error names `preprocess` documents."""
    items = images if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ImageError("images: empty list; pass at least one image")
    if cfg.n_channels != 3:
        raise ImageError(f"vision config has {cfg.n_channels} channels; only RGB (3) images are supported")
    many = isinstance(images, (list, tuple))
    return [fn(load_image(im, f"images[{i}]" if many else "image", max_pixels), cfg) for i, im in enumerate(items)]


def preprocess(images: ImageInput | list[ImageInput], cfg: VisionConfig, max_pixels: int | None = None) -> torch.Tensor:
    """One image or a list of them -> (N, C, S, S) float32 CPU tensor, S = cfg.image_size.

    Each item is a PIL image (any mode: RGBA, L, P, I;16, F ... are converted to RGB), a path to an image file
    (FORMATS; at most `max_pixels`, default MAX_PIXELS), or an HxWx3 RGB array (uint8, uint16, or float in
    [0, 1]). EXIF orientation is applied. Raises `ImageError` naming the file or list index at fault.
    """
    return normalise_pixels(resize_uint8(images, cfg, max_pixels), cfg)


def resize_uint8(images: ImageInput | list[ImageInput], cfg: VisionConfig, max_pixels: int | None = None) -> torch.Tensor:
    """preprocess's first half: the same inputs -> (N, S, S, C) uint8 CPU tensor, resized, not yet
    normalised. `normalise_pixels` finishes it on any device (the encoder's GPU: a quarter of the bytes to
    upload, and no CPU-side float copy)."""
    return torch.from_numpy(np.stack(_each(images, cfg, _resize, max_pixels)))


def normalise_pixels(pixels: torch.Tensor, cfg: VisionConfig) -> torch.Tensor:
    """(N, S, S, C) uint8 from `resize_uint8`, on any device -> (N, C, S, S) float32 there: HF's rescale
    and normalize, x * rescale_factor in float64, cast to float32, then (x - mean) / std in float32 (IEEE
    operations, correctly rounded, so the CPU and the GPU give the same bits)."""
    if pixels.dtype != torch.uint8 or pixels.dim() != 4 or pixels.shape[3] != 3:
        raise ImageError(f"pixels: expected (N, S, S, 3) uint8 from resize_uint8, got {pixels.dtype} "
                         f"{tuple(pixels.shape)}")
    x = (pixels.to(torch.float64) * cfg.rescale_factor).to(torch.float32)
    mean, std = _mean_std(tuple(cfg.image_mean), tuple(cfg.image_std), pixels.device)
    return ((x - mean) / std).permute(0, 3, 1, 2).contiguous()


@functools.lru_cache(maxsize=16)
def _mean_std(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalisation constants as float32 tensors on `device`, made once (not a host copy per image)."""
    return (torch.tensor(mean, dtype=torch.float32, device=device),
            torch.tensor(std, dtype=torch.float32, device=device))
