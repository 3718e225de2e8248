"""Vision-to-language projector: `mlp_downsample` (VILA1.5), `mlp2x_gelu` (LLaVA), `linear`.

Split into `merge` (the 2x2 token merge of mlp_downsample; identity otherwise) and `mlp`, because
SparseVILA prunes merged tokens between the two. The merge reproduces VILA's `flat_square` exactly:
zero pad to an even grid at bottom/right, channels [top-left, top-right, bottom-left, bottom-right],
merged cell (i, j) at token j*side + i (column-pair-major). See reference/vila_sparsevila.md 1.4;
tests/test_projector.py checks it against VILA's own reshape sequence.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tinyvila import ops
from tinyvila.config import ProjectorConfig, VisionConfig
from tinyvila.vision import LayerNorm

KINDS = ("mlp_downsample", "mlp2x_gelu", "linear")


class Projector(nn.Module):
    """(B, N, D) vision features -> (B, N', d) LLM embeddings; N' = cfg.n_tokens(vision)."""

    def __init__(self, cfg: ProjectorConfig, vision: VisionConfig):
        super().__init__()
        if cfg.kind not in KINDS:
            raise ValueError(f"unknown projector kind {cfg.kind!r}; known: {', '.join(KINDS)}")
        self.cfg = cfg
        self.n_in = vision.n_out_tokens
        self.side = math.isqrt(self.n_in)
        self.n_out = cfg.n_tokens(vision)  # raises if mlp_downsample is given a non-square grid
        downsample = cfg.kind == "mlp_downsample"
        self.norm = LayerNorm(cfg.merged_dim, eps=cfg.norm_eps) if downsample else None
        self.fc1 = nn.Linear(cfg.merged_dim, cfg.out_dim)
        self.fc2 = nn.Linear(cfg.out_dim, cfg.out_dim) if cfg.kind != "linear" else None

    def merge(self, feats: torch.Tensor) -> torch.Tensor:
        """(B, N, D) -> (B, N', merged_dim): the 2x2 space-to-depth of mlp_downsample, else identity."""
        if self.norm is None:
            return feats
        B, N, D = feats.shape
        if N != self.n_in:
            raise ValueError(f"projector expects {self.n_in} tokens per image, got {N}")
        s, odd = self.side, self.side % 2
        x = feats.view(B, s, s, D)  # (B, row, col, D), patches are row-major
        x = F.pad(x, (0, 0, 0, odd, 0, odd))  # zero column at the right, zero row at the bottom
        h = (s + odd) // 2
        x = x.view(B, h, 2, h, 2, D)  # (B, i, dr, j, dc, D): row = 2i + dr, col = 2j + dc
        # Tokens run j-major (VILA's flat_square permutes the grid axes); channels in (dr, dc) order.
        x = x.permute(0, 3, 1, 2, 4, 5)  # (B, j, i, dr, dc, D)
        return x.reshape(B, h * h, 4 * D)  # (B, N', 4D)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N', merged_dim) -> (B, N', d); tokens are independent, so any subset may be passed."""
        if self.norm is not None:
            x = self.norm(x)
        x = self.fc1(x)
        if self.fc2 is not None:
            x = self.fc2(ops.gelu(x, "gelu"))  # nn.GELU() in VILA: exact erf form
        return x

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.merge(feats))
