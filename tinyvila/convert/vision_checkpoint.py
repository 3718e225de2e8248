"""Vision-only checkpoints: a folder with config.json and model.safetensors holding `vision.*` tensors.

Used for standalone vision encoders (the real DINOv2-small imported by `quantize.py import-dinov2`, and
its W8A8 SmoothQuant versions). config.json: {"format": "tinyvila-vision", "vision": VisionConfig,
"quant": "none" | "w8a8", "dtype": ...}. Tensor names, shapes and dtypes are those of
`VisionEncoder(cfg, quant)` prefixed with "vision." (docs/checkpoint_format.md), checked before loading.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tinyvila.config import VisionConfig
from tinyvila.errors import CheckpointError
from tinyvila.loader import check_tensors
from tinyvila.vision import VisionEncoder

FORMAT = "tinyvila-vision"


def expected_vision_tensors(cfg: VisionConfig, quant: str, dtype: torch.dtype) -> dict:
    """Name -> (shape, dtype) of every tensor of a vision checkpoint (float tensors in `dtype`,
    integer ones and modules' KEEP_DTYPE tensors in their own)."""
    with torch.device("meta"):
        enc = VisionEncoder(cfg, quant)
    keep = {f"{p}.{n}" if p else n for p, m in enc.named_modules() for n in getattr(m, "KEEP_DTYPE", ())}
    return {f"vision.{k}": (tuple(v.shape), dtype if v.is_floating_point() and k not in keep else v.dtype)
            for k, v in enc.state_dict().items()}


def save_vision(folder: str | os.PathLike, cfg: VisionConfig, state_dict: dict, *, quant: str = "none",
                dtype: str = "float32") -> Path:
    """Writes config.json + model.safetensors after checking `state_dict` (`vision.*` names) against the model."""
    folder = Path(folder)
    found = {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()}
    problems = check_tensors(found, expected_vision_tensors(cfg, quant, getattr(torch, dtype)), {})
    if problems:
        raise CheckpointError(f"{folder}: refusing to save a vision checkpoint that would not load:\n  "
                              + "\n  ".join(problems[:20]))
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "vision": dataclasses.asdict(cfg), "quant": quant, "dtype": dtype}
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, str(folder / "model.safetensors"))
    return folder


def read_vision_config(folder: str | os.PathLike) -> tuple[VisionConfig, str, str]:
    """config.json of a vision checkpoint -> (VisionConfig, quant, dtype)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; build a vision checkpoint with `python scripts/quantize.py import-dinov2`")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a vision-only checkpoint (format {meta.get('format')!r}, want {FORMAT!r})")
    vision = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["vision"].items()}
    return VisionConfig(**vision), meta.get("quant", "none"), meta.get("dtype", "float32")


def load_vision(folder: str | os.PathLike, *, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> VisionEncoder:
    """A vision checkpoint folder -> VisionEncoder in eval mode (floating weights cast to `dtype` if given)."""
    folder = Path(folder)
    cfg, quant, stored = read_vision_config(folder)
    sd = load_file(str(folder / "model.safetensors"))
    found = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
    problems = check_tensors(found, expected_vision_tensors(cfg, quant, getattr(torch, stored)), {})
    if problems:
        raise CheckpointError(f"{folder}: weights do not match config.json:\n  " + "\n  ".join(problems[:20]))
    with torch.device("meta"):
        enc = VisionEncoder(cfg, quant)
    enc.load_state_dict({k.removeprefix("vision."): v for k, v in sd.items()}, assign=True, strict=True)
    return enc.to(device=device, dtype=dtype).eval()
