"""Vision encoder: one pre-LN ViT for the SigLIP form and the CLIP form (HF import: convert/hf.py).

SigLIP: patch conv with bias, no CLS token, tanh-GELU. CLIP: CLS token, LayerNorm on the
embeddings (`pre_norm`), quick-GELU, conv without bias. Only the layers up to the selected one
(`VisionConfig.n_run_layers`) are built and run; the final LayerNorm only with `post_norm` (DINOv2),
else HF's `hidden_states[select_layer]`. W8A8 (quant="w8a8"): int8 linears fed by fused kernels.
Tensor names follow docs/checkpoint_format.md.
Tested against transformers' SiglipVisionModel / CLIPVisionModel in tests/test_vision.py.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tinyvila import ops
from tinyvila.config import VisionConfig
from tinyvila.cuda_graph import GraphCache, GraphOwner
from tinyvila.quant import QTensor, W8A8Linear

VISION_QUANT = ("none", "w8a8")  # QuantConfig.vision values


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm's parameters and names, computed through `ops.layer_norm` (the kernel seam)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class LayerNormQuant(LayerNorm):
    """W8A8: LayerNorm fused with per-token int8 quantization; returns a QTensor for the next W8A8Linear."""

    def forward(self, x: torch.Tensor) -> QTensor:
        return QTensor(*ops.layer_norm_quant(x, self.weight, self.bias, self.eps))


def _linear(quant: str):
    """The Linear class of a vision quantization mode (same state-dict names either way)."""
    if quant not in VISION_QUANT:
        raise ValueError(f"unknown vision quantization {quant!r}; known: {', '.join(VISION_QUANT)}")
    return W8A8Linear if quant == "w8a8" else nn.Linear


def _linear_add(lin: nn.Module, x, residual: torch.Tensor | None) -> torch.Tensor:
    """lin(x) [+ residual]; a W8A8Linear adds the residual inside its GEMM epilogue (one kernel)."""
    if residual is None:
        return lin(x)
    return lin(x, residual) if isinstance(lin, W8A8Linear) else lin(x) + residual


class Attention(nn.Module):
    """Non-causal multi-head self-attention with q, k, v fused into one Linear."""

    def __init__(self, cfg: VisionConfig, quant: str = "none"):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wqkv = _linear(quant)(cfg.dim, 3 * cfg.dim)
        self.wo = _linear(quant)(cfg.dim, cfg.dim)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, D) -> q, k, v each (B, H, T, Dh)."""
        B, T, _ = x.shape
        qkv = self.wqkv(x).view(B, T, 3, self.n_heads, self.head_dim)  # (B, T, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, Dh)
        return q, k, v

    def forward(self, x: torch.Tensor, return_qk: bool = False, residual: torch.Tensor | None = None):
        """(B, T, D) -> (B, T, D) [+ residual]; with `return_qk` also (q, k, lse): q, k (B, H, T, Dh)
        and the attention's row LSE (B, H, T) fp32 where the kernel gives one (CUDA), else None; the
        prefill-salience kernel reuses it, so salience costs one extra QK^T pass, not two."""
        B, T, D = x.shape
        q, k, v = self.qkv(x)
        if return_qk:
            o, lse = ops.attention_with_lse(q, k, v)
        else:
            o = ops.attention(q, k, v, causal=False)  # scale Dh^-0.5, as HF
        o = _linear_add(self.wo, o.transpose(1, 2).reshape(B, T, D), residual)  # (B, T, D)
        return (o, (q, k, lse)) if return_qk else o


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig, quant: str = "none"):
        super().__init__()
        self.act, self.quant_act = cfg.act, quant == "w8a8"
        self.fc1 = _linear(quant)(cfg.dim, cfg.mlp_dim)
        self.fc2 = _linear(quant)(cfg.mlp_dim, cfg.dim)

    def forward(self, x: torch.Tensor | QTensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D) [+ residual]."""
        h = self.fc1(x)
        # W8A8: GELU fused with the per-token quantization that fc2 needs.
        h = QTensor(*ops.gelu_quant(h, self.act)) if self.quant_act else ops.gelu(h, self.act)
        return _linear_add(self.fc2, h, residual)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(norm1(x)) [* ls1], then + mlp(norm2(x)) [* ls2] (LayerScale)."""

    def __init__(self, cfg: VisionConfig, quant: str = "none"):
        super().__init__()
        Norm = LayerNormQuant if quant == "w8a8" else LayerNorm  # W8A8: the norms emit int8 directly
        self.norm1 = Norm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg, quant)
        self.norm2 = Norm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg, quant)
        self.ls1 = nn.Parameter(torch.empty(cfg.dim)) if cfg.layer_scale else None
        self.ls2 = nn.Parameter(torch.empty(cfg.dim)) if cfg.layer_scale else None

    def forward(self, x: torch.Tensor, return_qk: bool = False):
        """(B, T, D) -> (B, T, D); with `return_qk` also this layer's (q, k, lse) (Attention.forward)."""
        # Without LayerScale the skip connection rides in the output GEMMs (fused in W8A8).
        a = self.attn(self.norm1(x), return_qk=return_qk, residual=x if self.ls1 is None else None)
        a, qk = a if return_qk else (a, None)
        x = a if self.ls1 is None else x + a * self.ls1
        m = self.mlp(self.norm2(x), residual=x if self.ls2 is None else None)
        x = m if self.ls2 is None else x + m * self.ls2
        return (x, qk) if return_qk else x


class VisionEncoder(GraphOwner, nn.Module):
    """ViT truncated at `cfg.select_layer`: pixels (B, C, S, S) -> features (B, n_out_tokens, D).

    `quant` "w8a8" builds W8A8Linear q/k/v, o, fc1, fc2 fed by fused LayerNorm/GELU+quant kernels
    (attention, embeddings and norms' parameters stay in the float dtype).
    """

    def __init__(self, cfg: VisionConfig, quant: str = "none"):
        super().__init__()
        self.cfg, self.quant = cfg, quant
        D, P = cfg.dim, cfg.patch_size
        self.patch_embed = nn.Conv2d(cfg.n_channels, D, P, stride=P, bias=cfg.patch_bias)
        self.cls_token = nn.Parameter(torch.empty(D)) if cfg.cls_token else None
        self.pos_embed = nn.Parameter(torch.empty(cfg.n_tokens, D))
        self.pre_norm = LayerNorm(D, eps=cfg.norm_eps) if cfg.pre_norm else None
        # Layers past the selected one never influence the output, so they are not even built.
        self.layers = nn.ModuleList(Block(cfg, quant) for _ in range(cfg.n_run_layers))
        self.post_norm = LayerNorm(D, eps=cfg.norm_eps) if cfg.post_norm else None
        self.graphs: GraphCache | None = None  # see use_cuda_graphs
        self._patch_w: tuple[tuple, torch.Tensor] | None = None  # see _patch_weight

    def _patch_weight(self) -> torch.Tensor:
        """The patch embedding's (D, C, P, P) weight as a (D, Kp) GEMM operand, its C P P columns zero-padded to
        Kp, a multiple of 8 (16-byte rows: 588 -> 592 at P = 14, where cuBLAS's unaligned kernel took 0.375 ms at
        64 images on the H200). Built once per weight: kept while the weight's storage and version are the same
        (loading, moving, casting or editing it in place rebuilds it), not cached while a CUDA graph is being
        captured (a tensor from the graph's pool must not outlive it; the capture's warm-up has built it)."""
        w = self.patch_embed.weight
        D, K = w.shape[0], w[0].numel()
        if w.requires_grad and torch.is_grad_enabled():  # a differentiable call: no cache across autograd graphs
            return F.pad(w.reshape(D, K), (0, -K % 8))
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if self._patch_w is not None and self._patch_w[0] == key:
            return self._patch_w[1]
        wp = F.pad(w.detach().reshape(D, K), (0, -K % 8))
        if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._patch_w = (key, wp)
        return wp

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) -> (B, T, D) = hidden_states[0]: patches (+ CLS first) + positions (+ pre_norm).

        The patch embedding is the checkpoint's Conv2d (kernel = stride = P) computed as what it is, one
        GEMM over each patch's C x P x P pixels: the patches are cut out with one copy (pixels past the
        last whole patch are dropped, as the convolution drops them; rows zero-padded to a multiple of 8)
        against the weight as a (D, C P P) matrix padded alike (_patch_weight, built once).
        cuDNN's convolution of 3 input channels runs an implicit GEMM at ~45 TFLOP/s plus NCHW <-> NHWC
        conversions and a transposing copy (H200, docs/perf_notes.md "Patch embedding and attention": with the position add,
        ~3.2 ms of a 65 ms W8A8 SigLIP-so400m encode of 64 images)."""
        w = self.patch_embed.weight  # (D, C, P, P)
        D, C, P = w.shape[0], w.shape[1], w.shape[2]
        grid = self.pos_embed.shape[0] - (self.cls_token is not None)
        if pixels.dim() != 4 or pixels.shape[1] != C or (pixels.shape[2] // P) * (pixels.shape[3] // P) != grid:
            S = self.cfg.image_size
            raise ValueError(f"VisionEncoder: pixels of shape {tuple(pixels.shape)}; this encoder takes (B, {C}, {S}, {S}) "
                             f"images ({grid} patches of {P}x{P} pixels; tinyvila.image preprocesses to that size)")
        B, gh, gw = pixels.shape[0], pixels.shape[2] // P, pixels.shape[3] // P
        K = C * P * P
        w = self._patch_weight()  # (D, Kp)
        Kp = w.shape[1]
        patches = torch.empty(B, gh, gw, Kp, dtype=w.dtype, device=pixels.device)  # row-major over the grid
        if Kp > K:
            patches[..., K:].zero_()
        patches[..., :K].view(B, gh, gw, C, P, P).copy_(
            pixels[:, :, :gh * P, :gw * P].reshape(B, C, gh, P, gw, P).permute(0, 2, 4, 1, 3, 5))
        x = F.linear(patches.view(B * gh * gw, Kp), w, self.patch_embed.bias).view(B, gh * gw, D)
        if self.cls_token is not None:
            cls = self.cls_token.to(x.dtype).expand(x.shape[0], 1, -1)  # (B, 1, D)
            x = torch.cat([cls, x], dim=1)  # (B, T, D)
        x = x + self.pos_embed
        return x if self.pre_norm is None else self.pre_norm(x)

    def run_layers(self, x: torch.Tensor, qk_layer: int | None = None):
        """The layer loop, (B, T, D) -> (B, T, D) = hidden_states[n_run_layers], and the (q, k, lse)
        of layer `qk_layer` (0-based; see Attention.forward) or None."""
        qk = None
        for i, layer in enumerate(self.layers):
            if i == qk_layer:
                x, qk = layer(x, return_qk=True)
            else:
                x = layer(x)
        return x, qk

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, n_out_tokens, D): drops the CLS token for select_feature "patch"."""
        return x[:, 1:] if self.cfg.n_out_tokens < self.cfg.n_tokens else x

    def use_cuda_graphs(self, enabled: bool = True) -> "VisionEncoder":
        """Run `forward` on CUDA inputs as a CUDA graph replay, one graph per input shape and dtype
        (tinyvila/cuda_graph.py): removes the launch overhead that dominates at one image. Inference
        only; graphs are dropped when the weights are moved or reloaded. `VLM.encode_images` reads
        this switch to replay encoder + projector (and SparseVILA's prune) from its own graphs."""
        self.graphs = GraphCache(self._forward) if enabled else None
        return self

    def features(self, pixels: torch.Tensor, qk_layer: int | None = None):
        """(B, C, S, S) -> the projector's input (B, n_out_tokens, D) (post_norm, then `select`), and
        layer `qk_layer`'s (q, k, lse) (`run_layers`) or None. Eager; the graph-safe body of both
        `forward` and SparseVILA's prune (tinyvila/sparsity.py), so the two see the same features."""
        x, qk = self.run_layers(self.embed(pixels), qk_layer)
        x = x if self.post_norm is None else self.post_norm(x)
        return self.select(x), qk

    def _forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.features(pixels)[0]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) -> (B, n_out_tokens, D); a graph replay on CUDA after `use_cuda_graphs`."""
        if self.graphs is not None and pixels.is_cuda:
            return self.graphs(pixels)
        return self._forward(pixels)
