"""Vision W8A8 quality on a real ViT: cosine similarity of final CLS and patch features to fp32.

    python -m scripts.eval_vision_quality checkpoints/dinov2-small [--alpha 0.5] [--alphas 0.3,0.5,0.7]

Needs an fp32 vision checkpoint (`python scripts/quantize.py import-dinov2`). Calibrates SmoothQuant on the first
--n-calib bundled scikit-image photos (or --calib DIR) and evaluates on the remaining photos, which
calibration never saw, for: fp16, W8A8 without smoothing, W8A8 with SmoothQuant (each alpha). Runs the
reference (CPU) or kernel (CUDA) path through ops. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tinyvila.convert.smoothquant import DEFAULT_ALPHA, bundled_photos, image_files, smoothquant
from tinyvila.image import preprocess
from tinyvila.vision import VisionEncoder
from tinyvila.convert.vision_checkpoint import load_vision, read_vision_config
from tinyvila.errors import CheckpointError, TinyVilaError


def cosines(feats: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Mean cosine similarity of CLS features and of patch features (B, T, D) to the reference's."""
    cls = F.cosine_similarity(feats[:, 0].double(), ref[:, 0].double(), dim=-1)
    patch = F.cosine_similarity(feats[:, 1:].double(), ref[:, 1:].double(), dim=-1)
    return {"cls_cos": cls.mean().item(), "cls_cos_min": cls.min().item(), "patch_cos": patch.mean().item()}


@torch.no_grad()
def w8a8_encoder(dense: VisionEncoder, files: list[Path], alpha: float | None, dtype: torch.dtype) -> VisionEncoder:
    """W8A8 copy of an fp32 encoder (SmoothQuant with `alpha`, or plain when None), in `dtype`."""
    sd = smoothquant(copy.deepcopy(dense), files, alpha, dtype)
    with torch.device("meta"):
        enc = VisionEncoder(dense.cfg, "w8a8")
    enc.load_state_dict({k.removeprefix("vision."): v for k, v in sd.items()}, assign=True, strict=True)
    return enc.to(dense.patch_embed.weight.device).eval()


@torch.no_grad()
def evaluate(folder: Path, calib: list[Path], evals: list[Path], alphas: list[float], device: str) -> list[dict]:
    if read_vision_config(folder)[1] != "none":  # the evaluation quantizes the dense encoder itself
        raise CheckpointError(f"{folder}: a W8A8 checkpoint; pass the dense vision checkpoint it was built from "
                              "(quantize.py import-dinov2 writes one): this evaluation runs SmoothQuant on it itself")
    dense = load_vision(folder, device=device, dtype=torch.float32)
    pixels = preprocess([str(f) for f in evals], dense.cfg).to(device)
    ref = dense(pixels)
    dtype = torch.float16 if device == "cuda" else torch.float32  # CPU: fp32 activations (the reference path)
    variants = [("fp16", None), ("w8a8 (no smoothing)", None), *((f"w8a8 smoothquant a={a}", a) for a in alphas)]
    rows = []
    for name, alpha in tqdm(variants, desc="variants", unit="variant"):
        if name == "fp16":
            feats = copy.deepcopy(dense).half()(pixels.half())
        else:
            feats = w8a8_encoder(dense, calib, alpha, dtype)(pixels.to(dtype))
        rows.append({"variant": name, **cosines(feats.float(), ref)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="fp32 vision checkpoint folder (quantize.py import-dinov2)")
    p.add_argument("--alphas", default=str(DEFAULT_ALPHA), help="comma-separated SmoothQuant alphas")
    p.add_argument("--calib", type=Path, help="calibration image folder (default: the bundled photos)")
    p.add_argument("--n-calib", type=int, default=8, help="bundled photos used for calibration (rest: eval)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    photos = bundled_photos()
    calib = image_files(a.calib) if a.calib else photos[:a.n_calib]
    evals = [f for f in photos if f not in calib]
    try:
        rows = evaluate(a.checkpoint, calib, evals, [float(x) for x in a.alphas.split(",")], a.device)
    except TinyVilaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{len(calib)} calibration images, {len(evals)} evaluation images, device {a.device}")
    for r in rows:
        print(f"{r['variant']:28s} cls_cos {r['cls_cos']:.5f} (min {r['cls_cos_min']:.5f})  patch_cos {r['patch_cos']:.5f}")
    print(json.dumps({"eval": "vision_w8a8", "model": str(a.checkpoint), "device": a.device,
                      "torch": torch.__version__, "n_calib": len(calib), "n_eval": len(evals), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
