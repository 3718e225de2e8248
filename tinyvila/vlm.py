"""The whole vision-language model: vision encoder -> projector -> spliced into the LLM's embeddings.

`VLM` owns the three modules (the vision side is absent for text-only checkpoints) and the two steps
that join them: `encode_images` (pixels -> LLM-width image embeddings) and `embed` (a prompt's token
ids, with `IMAGE_TOKEN` sentinels, -> input embeddings with each image's tokens spliced in at its
sentinel, as VILA's `tokenizer_image_token` + `prepare_inputs_labels_for_multimodal` do).
With `SparsityConfig.prefill_keep` < 1, `encode_images` prunes each image's tokens before the projector
MLP (tinyvila/sparsity.py) and `positions` gives the kept tokens their original RoPE positions.
On CUDA, once `vision.use_cuda_graphs()` is on (tinyvila.load does it), encoder + projector, and
SparseVILA's whole prune, replay from CUDA graphs (tinyvila/cuda_graph.py): at one image the eager
launches cost several times the GPU work.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from . import sparsity as sparse
from .config import SparsityConfig, VLMConfig
from .cuda_graph import GraphCache, GraphOwner
from .options import Options, set_options
from .image import normalise_pixels
from .projector import Projector
from .quant import swap_linears
from .text import TextModel
from .tokenizer import IMAGE_TOKEN  # VILA's IMAGE_TOKEN_INDEX (-200): one sentinel per image
from .vision import VisionEncoder

ENCODE_BATCH = 32  # images (video frames) per vision-encoder pass


class VLM(GraphOwner, nn.Module):
    GRAPHS_ATTR = "_graphs"  # the encode graphs (GraphOwner drops them when the weights move)

    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionEncoder(cfg.vision, cfg.quant.vision) if cfg.vision is not None else None
        self.projector = Projector(cfg.projector, cfg.vision) if cfg.projector is not None else None
        self.text = TextModel(cfg.text)
        if cfg.quant.llm == "w4a16":  # packed W4 LLM linears, stored as such in the checkpoint
            swap_linears(self.text, cfg.quant)
        self._graphs: GraphCache | None = None  # encode graphs, made on first CUDA use (_encode_graphs)
        # Every chat of this model runs on the device through this lock: an encode, a prefill, a run of decode steps
        # (generate.Decoder). They share buffers on the device: the encode graphs' static inputs (two threads'
        # images would mix), the W4 GEMM's dequantization scratch, the kernels' split-K workspaces and counters.
        # One stream keeps those consistent only while no other thread's launches come between one call's kernels.
        self.device_lock = threading.RLock()

    def set_options(self, options: Options) -> VLM:
        """Run with these runtime options from now on (every submodule that reads them; tinyvila/options.py).
        The encoder's CUDA graphs follow `options.cuda_graph` on CUDA; captured graphs are dropped, since they
        baked in the old forms."""
        set_options(self, options)
        self._drop_graphs()
        if self.vision is not None:
            self.vision.use_cuda_graphs(options.cuda_graph and self.device.type == "cuda")
        return self

    @property
    def options(self) -> Options:
        return self.text.options

    @property
    def device(self) -> torch.device:
        return self.text.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text.embed.weight.dtype

    def encode_images(self, pixels: torch.Tensor, sparsity: SparsityConfig | None = None,
                      with_index: bool = False):
        """(N, C, S, S) preprocessed images (image.preprocess), or (N, S, S, C) uint8 resized ones
        (image.resize_uint8: uploaded as they are and normalised on the model's device, the same values),
        -> (N, k, d) LLM-width embeddings, k = image_tokens, or fewer when `sparsity.prefill_keep` < 1
        (tinyvila/sparsity.py; 1.0 is exactly the dense path). `with_index` also returns (N, k) long: each
        kept token's index in the image's token grid."""
        if self.vision is None:
            raise ValueError(f"this checkpoint ({self.cfg.text.arch}, text only) has no vision encoder")
        if pixels.dtype == torch.uint8:
            pixels = normalise_pixels(pixels.to(self.device), self.cfg.vision)
        pixels = pixels.to(self.device, self.dtype)
        with self.device_lock:
            out, idx = self._encode_all(pixels, sparsity)
        return (out, idx) if with_index else out

    def _encode_all(self, pixels: torch.Tensor, sparsity: SparsityConfig | None):
        """encode_images' device section: (N, C, S, S) -> ((N, k, d), (N, k) index)."""
        # Long videos go through the encoder ENCODE_BATCH frames at a time: activation memory (and a
        # CUDA graph's pool) stays that of one batch, and one captured batch shape serves them all.
        graphs = self._encode_graphs() if pixels.is_cuda else None
        outs, idxs = [], []
        for chunk in pixels.split(ENCODE_BATCH):
            if sparsity is not None and sparsity.prefill_keep < 1.0:
                out, idx = sparse.prune(self.vision, self.projector, chunk, sparsity, graphs)
            else:
                out = graphs(chunk) if graphs is not None else self._encode(chunk)  # (n, image_tokens, d)
                idx = torch.arange(out.shape[1], device=out.device).expand(out.shape[0], -1)
            outs.append(out)
            idxs.append(idx)
        return (outs[0], idxs[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(idxs))

    def _encode(self, pixels: torch.Tensor, k: int | None = None, layer: int | None = None):
        """The graph-safe body: (n, C, S, S) -> projector(encoder) (n, image_tokens, d); with k,
        SparseVILA's prune at salience layer `layer` -> ((n, k, d), (n, k) index)."""
        if k is None:
            return self.projector(self.vision.features(pixels)[0])
        return sparse.prune_top_k(self.vision, self.projector, pixels, k, layer)

    def _encode_graphs(self) -> GraphCache | None:
        """The GraphCache over `_encode` when the encoder's graphs are on, else None (eager)."""
        if self.vision.graphs is None:
            return None
        if self._graphs is None:
            self._graphs = GraphCache(self._encode)
        return self._graphs

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

    def n_embeds(self, ids: list[int], tokens_per_image: int | None = None) -> int:
        """Sequence length `embed` will produce for these ids (checked before any work is done);
        tokens_per_image: what each image holds after pruning (default image_tokens)."""
        n_img = sum(t == IMAGE_TOKEN for t in ids)
        per_image = self.cfg.image_tokens if tokens_per_image is None else tokens_per_image
        return len(ids) - n_img + n_img * per_image

    def positions(self, ids: list[int], index: torch.Tensor, start: int) -> torch.Tensor:
        """RoPE positions (T,) long of `embed(ids, images)` when kept image tokens keep their original
        positions: text tokens count one each, image i spans image_tokens positions and its kept
        tokens sit at their grid index `index[i]` (n_sentinels, k) inside that span."""
        pos, p, i = [], start, 0
        index = index.tolist()
        for t in ids:
            if t == IMAGE_TOKEN:
                pos += [p + j for j in index[i]]
                p, i = p + self.cfg.image_tokens, i + 1
            else:
                pos.append(p)
                p += 1
        return torch.tensor(pos, device=self.device)  # (T,)
