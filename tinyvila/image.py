"""Image preprocessing: files, PIL images or uint8 arrays -> normalised (N, C, S, S) float32 pixels.

Follows VILA1.5's `image_aspect_ratio: resize` path exactly: PIL `convert("RGB")`, bicubic resize to
S x S ignoring the aspect ratio with PIL (as HF's SiglipImageProcessor / CLIPImageProcessor do with
their PIL backend), x * rescale_factor, then (x - mean) / std. Arithmetic follows HF's numpy code
(rescale in float64, cast to float32, normalise in float32) so pixels match it bit for bit.
Video frames are images: pass a list. `preprocess` does it all on the CPU; `resize_uint8` stops before the
rescale and `normalise_pixels` finishes on any device with the same arithmetic (the runtime uploads uint8
pixels and normalises them on the GPU: a quarter of the bytes, and no float32 copy on the CPU).
"""

from __future__ import annotations

import functools
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


def _resize(im: Image.Image, cfg: VisionConfig) -> np.ndarray:
    """RGB PIL image -> (S, S, C) uint8, HF's bicubic resize."""
    s = cfg.image_size
    return np.asarray(im.resize((s, s), resample=Image.BICUBIC))


def _each(images: ImageInput | list[ImageInput], cfg: VisionConfig, fn) -> list[np.ndarray]:
    """fn(RGB PIL image, cfg) of every input image; the checks and error names `preprocess` documents."""
    items = images if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ImageError("images: empty list; pass at least one image")
    if cfg.n_channels != 3:
        raise ImageError(f"vision config has {cfg.n_channels} channels; only RGB (3) images are supported")
    many = isinstance(images, (list, tuple))
    return [fn(load_image(im, f"images[{i}]" if many else "image"), cfg) for i, im in enumerate(items)]


def preprocess(images: ImageInput | list[ImageInput], cfg: VisionConfig) -> torch.Tensor:
    """One image or a list of them -> (N, C, S, S) float32 CPU tensor, S = cfg.image_size.

    Each item is a PIL image (any mode: RGBA, L, P, ... are converted to RGB), a path to an image
    file, or an HxWx3 uint8 RGB array. Raises `ImageError` naming the file or list index at fault.
    """
    return normalise_pixels(resize_uint8(images, cfg), cfg)


def resize_uint8(images: ImageInput | list[ImageInput], cfg: VisionConfig) -> torch.Tensor:
    """preprocess's first half: the same inputs -> (N, S, S, C) uint8 CPU tensor, resized, not yet
    normalised. `normalise_pixels` finishes it on any device (the encoder's GPU: a quarter of the bytes to
    upload, and no CPU-side float copy)."""
    return torch.from_numpy(np.stack(_each(images, cfg, _resize)))


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
