"""Image preprocessing: files, PIL images or uint8 arrays -> normalised (N, C, S, S) float32 pixels.

Follows VILA1.5's `image_aspect_ratio: resize` path exactly: PIL `convert("RGB")`, bicubic resize to
S x S ignoring the aspect ratio with PIL (as HF's SiglipImageProcessor / CLIPImageProcessor do with
their PIL backend), x * rescale_factor, then (x - mean) / std. Arithmetic follows HF's numpy code
(rescale in float64, cast to float32, normalise in float32) so pixels match it bit for bit.
Video frames are images: pass a list.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .config import VisionConfig
from .errors import ImageError

ImageInput = Image.Image | str | os.PathLike | np.ndarray


def load_image(image: ImageInput, what: str = "image") -> Image.Image:
    """One image input -> an RGB PIL image. `what` names the argument in error messages.

    Alpha is dropped, not composited (PIL `convert("RGB")`), because VILA converts before HF sees it.
    """
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        return _open_file(Path(image))
    if isinstance(image, np.ndarray):
        return _from_array(image, what)
    raise ImageError(f"{what}: expected a PIL image, a file path or an HxWx3 uint8 array, got {type(image).__name__}")


def _open_file(path: Path) -> Image.Image:
    if not path.is_file():
        raise ImageError(f"{path}: image file not found")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")  # convert() forces the full decode while the file is open
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageError(f"{path}: cannot read image ({e})") from None


def _from_array(a: np.ndarray, what: str) -> Image.Image:
    if a.dtype != np.uint8:
        raise ImageError(f"{what}: array must be uint8 (0..255), got dtype {a.dtype}")
    if a.ndim != 3 or a.shape[2] != 3 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ImageError(f"{what}: array must be HxWx3 (RGB, channels last), got shape {tuple(a.shape)}")
    return Image.fromarray(np.ascontiguousarray(a))  # HxWx3 uint8 is RGB


def _normalise(im: Image.Image, cfg: VisionConfig) -> np.ndarray:
    """RGB PIL image -> (C, S, S) float32, exactly HF's resize / rescale / normalize."""
    s = cfg.image_size
    im = im.resize((s, s), resample=Image.BICUBIC)
    x = (np.asarray(im).astype(np.float64) * cfg.rescale_factor).astype(np.float32)  # (S, S, C)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)
    std = np.asarray(cfg.image_std, dtype=np.float32)
    return ((x - mean) / std).transpose(2, 0, 1)  # (C, S, S)


def preprocess(images: ImageInput | list[ImageInput], cfg: VisionConfig) -> torch.Tensor:
    """One image or a list of them -> (N, C, S, S) float32 CPU tensor, S = cfg.image_size.

    Each item is a PIL image (any mode: RGBA, L, P, ... are converted to RGB), a path to an image
    file, or an HxWx3 uint8 RGB array. Raises `ImageError` naming the file or list index at fault.
    """
    items = images if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ImageError("images: empty list; pass at least one image")
    if cfg.n_channels != 3:
        raise ImageError(f"vision config has {cfg.n_channels} channels; only RGB (3) images are supported")
    many = isinstance(images, (list, tuple))
    out = [_normalise(load_image(im, f"images[{i}]" if many else "image"), cfg) for i, im in enumerate(items)]
    return torch.from_numpy(np.stack(out))
