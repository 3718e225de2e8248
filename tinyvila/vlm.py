"""The whole vision-language model: vision encoder -> projector -> spliced into the LLM's embeddings.

`VLM` owns the three modules (the vision side is absent for text-only checkpoints) and the two steps
that join them: `encode_images` (pixels -> LLM-width image embeddings) and `embed` (a prompt's token
ids, with `IMAGE_TOKEN` sentinels, -> input embeddings with each image's tokens spliced in at its
sentinel, as VILA's `tokenizer_image_token` + `prepare_inputs_labels_for_multimodal` do).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import VLMConfig
from .projector import Projector
from .text import TextModel
from .tokenizer import IMAGE_TOKEN  # VILA's IMAGE_TOKEN_INDEX (-200): one sentinel per image
from .vision import VisionEncoder


class VLM(nn.Module):
    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionEncoder(cfg.vision) if cfg.vision is not None else None
        self.projector = Projector(cfg.projector, cfg.vision) if cfg.projector is not None else None
        self.text = TextModel(cfg.text)

    @property
    def device(self) -> torch.device:
        return self.text.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text.embed.weight.dtype

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, C, S, S) preprocessed images -> (N, image_tokens, d) LLM-width embeddings."""
        if self.vision is None:
            raise ValueError(f"this checkpoint ({self.cfg.text.arch}, text only) has no vision encoder")
        feats = self.vision(pixels.to(self.device, self.dtype))  # (N, n_out_tokens, D)
        return self.projector(feats)  # (N, image_tokens, d)

    def embed(self, ids: list[int], images: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids with IMAGE_TOKEN sentinels -> (1, T, d) input embeddings.

        images: (n_sentinels, image_tokens, d); image i replaces the i-th sentinel, so
        T = len(ids) - n_sentinels + n_sentinels * image_tokens.
        """
        slots = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN]
        n_images = 0 if images is None else images.shape[0]
        if len(slots) != n_images:
            raise ValueError(f"prompt has {len(slots)} image placeholders but {n_images} images were given")
        # Sentinels look up id 0 (any valid row) and are cut out below, as VILA does.
        tokens = torch.tensor([max(t, 0) for t in ids], device=self.device)
        h = self.text.embed(tokens[None])[0]  # (T_text, d)
        if not slots:
            return h[None]
        pieces, prev = [], 0
        for i, s in enumerate(slots):
            pieces += [h[prev:s], images[i].to(h.dtype)]
            prev = s + 1
        pieces.append(h[prev:])
        return torch.cat(pieces)[None]  # (1, T, d)

    def n_embeds(self, ids: list[int]) -> int:
        """Sequence length `embed` will produce for these ids (checked before any work is done)."""
        n_img = sum(t == IMAGE_TOKEN for t in ids)
        return len(ids) - n_img + n_img * self.cfg.image_tokens
