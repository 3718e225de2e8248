"""SmoothQuant W8A8 for tinyvila vision encoders (SigLIP, CLIP, DINOv2 forms): calibrate, smooth, quantize.

Math (Xiao et al., SmoothQuant; mit-han-lab/smoothquant smooth.py): per input channel c of the linears
fed by a LayerNorm, a = max over calibration tokens of |X[:, c]| (the LayerNorm's output) and
w = max over those linears' rows of |W[:, c]|; s = clamp(a^alpha / w^(1-alpha), 1e-5). Then
LN.weight /= s, LN.bias /= s and W[:, c] *= s: exact in float, it moves activation outliers into the
weights. Done for norm1 -> wqkv and norm2 -> fc1 of every layer (wo and fc2 are quantized unsmoothed).
Then every linear is quantized per output channel (tinyvila/quant.py's W8A8 format).
CLI: `python scripts/quantize.py smoothquant-vision SRC DST`; also used by scripts/eval_vision_quality.py.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from tinyvila.image import preprocess
from tinyvila.quant import quantize_w8
from tinyvila.vision import VisionEncoder
from tinyvila.convert.vision_checkpoint import load_vision, save_vision

DEFAULT_ALPHA = 0.5  # measured on DINOv2-small (docs/benchmarks.md); SmoothQuant's and llm-awq's SigLIP default
QUANT_LINEARS = ("attn.wqkv", "attn.wo", "mlp.fc1", "mlp.fc2")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def bundled_photos() -> list[Path]:
    """The real photos bundled in the scikit-image wheel (`pip install --no-deps scikit-image`), found
    without importing skimage; sorted by name. Grey test charts and synthetic images are excluded."""
    import importlib.util

    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("scikit-image is not installed; run `pip install --no-deps scikit-image`, "
                                "or pass a folder of calibration images")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    names = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
             "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "brick.png", "grass.png",
             "gravel.png", "color.png", "ihc.png", "camera.png", "horse.png", "moon.png", "page.png",
             "coins.png", "cell.png", "microaneurysms.png", "clock_motion.png")
    return [folder / n for n in names if (folder / n).is_file()]


def image_files(folder: str | Path | None) -> list[Path]:
    """Image files of a folder (sorted), or the bundled photos when `folder` is None."""
    if folder is None:
        return bundled_photos()
    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"{folder}: no .png/.jpg images to calibrate on")
    return files


@torch.no_grad()
def collect_act_scales(enc: VisionEncoder, batches) -> list[dict[str, torch.Tensor]]:
    """Per layer {"norm1": (D,), "norm2": (D,)} fp32 max |LayerNorm output| per channel over all tokens
    of all batches of pixels (B, C, S, S): the inputs of wqkv and fc1."""
    scales = [{} for _ in enc.layers]
    hooks = []
    for i, layer in enumerate(enc.layers):
        for name in ("norm1", "norm2"):
            def hook(_m, _inp, out, i=i, name=name):
                amax = out.detach().float().abs().reshape(-1, out.shape[-1]).amax(0)  # (D,)
                prev = scales[i].get(name)
                scales[i][name] = amax if prev is None else torch.maximum(prev, amax)
            hooks.append(getattr(layer, name).register_forward_hook(hook))
    try:
        for pixels in batches:
            enc(pixels.to(enc.patch_embed.weight.device, enc.patch_embed.weight.dtype))
    finally:
        for h in hooks:
            h.remove()
    return scales


@torch.no_grad()
def smooth(enc: VisionEncoder, act_scales: list[dict[str, torch.Tensor]], alpha: float) -> None:
    """Folds s = a^alpha / w^(1-alpha) into norm1/wqkv and norm2/fc1 of every layer, in place."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    for layer, acts in zip(enc.layers, act_scales):
        for norm, lin in ((layer.norm1, layer.attn.wqkv), (layer.norm2, layer.mlp.fc1)):
            a = acts["norm1" if norm is layer.norm1 else "norm2"].clamp(min=1e-5)
            w = lin.weight.float().abs().amax(0).clamp(min=1e-5)  # (K,): over all output rows
            s = (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-5)
            norm.weight.div_(s.to(norm.weight.dtype))
            norm.bias.div_(s.to(norm.bias.dtype))
            lin.weight.mul_(s.to(lin.weight.dtype)[None, :])


def w8a8_state_dict(enc: VisionEncoder, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`vision.*` tensors of the W8A8 form of a dense encoder: every QUANT_LINEARS weight quantized per
    output channel (weight int8, weight_scale fp32), everything else (biases too) in `dtype`."""
    quantized = {f"layers.{i}.{n}" for i in range(len(enc.layers)) for n in QUANT_LINEARS}
    out = {}
    for name, t in enc.state_dict().items():
        mod, _, leaf = name.rpartition(".")
        if mod in quantized and leaf == "weight":
            qw = quantize_w8(t)
            out[f"vision.{mod}.weight"], out[f"vision.{mod}.weight_scale"] = qw["weight"], qw["weight_scale"]
        else:
            out[f"vision.{name}"] = t.detach().to(dtype or t.dtype)
    return out


def calibration_batches(files: list[Path], cfg, batch: int = 4, progress: tqdm | None = None):
    """Preprocessed pixel batches of the files, `batch` images at a time."""
    for i in range(0, len(files), batch):
        yield preprocess([str(f) for f in files[i:i + batch]], cfg)
        if progress is not None:
            progress.update(len(files[i:i + batch]))


def smoothquant(enc: VisionEncoder, files: list[Path], alpha: float | None = DEFAULT_ALPHA,
                dtype: torch.dtype | None = None, progress: bool = False) -> dict[str, torch.Tensor]:
    """Calibrates `enc` on `files`, smooths it in place with `alpha` and returns its W8A8 `vision.*`
    state dict; alpha=None skips calibration and smoothing (plain round-to-nearest W8A8)."""
    if alpha is not None:
        bar = tqdm(total=len(files), desc="calibrate", unit="image") if progress else None
        try:
            smooth(enc, collect_act_scales(enc, calibration_batches(files, enc.cfg, progress=bar)), alpha)
        finally:
            if bar is not None:
                bar.close()
    return w8a8_state_dict(enc, dtype)


def smoothquant_vision(src: str | Path, dst: str | Path, *, alpha: float | None = DEFAULT_ALPHA,
                       calib: str | Path | None = None, n_calib: int = 8, dtype: str = "float16") -> Path:
    """A dense vision checkpoint -> its W8A8 version calibrated on the first `n_calib` images of `calib`
    (default: the bundled photos); alpha=None is plain round-to-nearest W8A8. Returns `dst`."""
    enc = load_vision(src, dtype=torch.float32)
    if enc.quant != "none":
        raise ValueError(f"{src}: already quantized ({enc.quant}); start from a dense checkpoint")
    files = image_files(calib)[:n_calib]
    sd = smoothquant(enc, files, alpha, getattr(torch, dtype), progress=True)
    return save_vision(dst, enc.cfg, sd, quant="w8a8", dtype=dtype)
