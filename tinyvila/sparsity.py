"""Prefill pruning of visual tokens: which of an image's projector tokens reach the LLM.

SparseVILA (query-agnostic, reference/vila_sparsevila.md sec. 2.3): the salience layer's attention
gives every patch the mean attention it receives (ops.prefill_salience; an encoder with a CLS token
uses the CLS row instead), the patches a projector token merges add up (2x2 for mlp_downsample, in
`Projector.merge`'s exact token order; padding cells count 0), and the top `prefill_keep` fraction
of each image's tokens is kept in original order; the projector MLP then runs on those only.
Peers for side-by-side runs, selected by `SparsityConfig.prefill_method`: "random" (seeded) and
"visionzip" (dominant tokens by the same salience plus contextual tokens merged by key similarity;
VisionZip uses CLIP's CLS attention, so on SigLIP this is an adaptation, see docs/sparsity.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops
from .config import SparsityConfig, VisionConfig

# VisionZip's published split (54 dominant + 10 contextual of 64 tokens), kept as a fraction.
VISIONZIP_CONTEXT_FRAC = 10 / 64


def keep_count(n: int, keep: float) -> int:
    """Tokens kept of n at keep fraction `keep`: round(keep * n), at least 1."""
    return max(1, min(n, round(keep * n)))


def salience_layer(vision: VisionConfig, sparsity: SparsityConfig) -> int:
    """The 0-based executed layer whose attention gives salience (negative counts from the last)."""
    n = vision.n_run_layers
    if not -n <= sparsity.salience_layer < n:
        raise ValueError(f"salience_layer {sparsity.salience_layer} out of range: the encoder runs {n} layers")
    return sparsity.salience_layer % n


def token_salience(q: torch.Tensor, k: torch.Tensor, vision: VisionConfig, lse: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Salience of the tokens handed to the projector: q, k (B, H, T, Dh) -> (B, n_out_tokens) fp32.

    No summary token (SigLIP): mean attention received from all rows. CLS (CLIP): from the CLS row.
    lse (B, H, T): the salience layer's own attention normaliser, when it has one (fused: the kernel
    then runs only its column pass)."""
    n_query = 1 if vision.cls_token else None
    lse = lse[:, :, :1] if lse is not None and n_query == 1 else lse
    s = ops.prefill_salience(q, k, n_query=n_query, lse=lse)  # (B, T)
    return s[:, 1:] if vision.n_out_tokens < vision.n_tokens else s


def grid_salience(salience: torch.Tensor, projector) -> torch.Tensor:
    """(B, n_out_tokens) -> (B, N') per projector token: the sum over the cells it merges."""
    return projector.merge(salience[..., None]).sum(-1)  # merge: (B, N, 1) -> (B, N', 4 or 1)


def top_k(salience: torch.Tensor, k: int) -> torch.Tensor:
    """(B, N) -> (B, k) indices of the k largest, in increasing (original) order."""
    return salience.topk(k, dim=-1).indices.sort(dim=-1).values


def random_k(B: int, n: int, k: int, seed: int, device) -> torch.Tensor:
    """(B, k) seeded uniform choice of k of n per image, in original order."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(B)])
    return idx.sort(dim=-1).values.to(device)


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, N, C), idx (B, k) -> (B, k, C)."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def visionzip(merged: torch.Tensor, salience: torch.Tensor, keys: torch.Tensor, k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """VisionZip selection on projector tokens: (B, N, C) merged features, (B, N) salience,
    (B, N, E) keys -> (B, k, C) tokens, (B, k) the grid index each one stands at.

    Dominant: the top k_d by salience. Contextual: k - k_d targets evenly spaced over the remaining
    tokens; every other remaining token joins its most key-similar (cosine) target and each target
    becomes the mean of its group. Tokens are returned in grid order of their index."""
    B, N, _ = merged.shape
    # At least one contextual token whenever something is dropped and the budget allows two kinds.
    n_ctx = min(k - 1, max(1, round(k * VISIONZIP_CONTEXT_FRAC))) if 1 < k < N else 0
    n_dom = k - n_ctx
    tokens, index = [], []
    if n_ctx == 0:
        idx = top_k(salience, k)
        return gather(merged, idx), idx
    for b in range(B):  # per image: the groups have data-dependent sizes
        dom = salience[b].topk(n_dom).indices
        rest_mask = torch.ones(N, dtype=torch.bool, device=merged.device)
        rest_mask[dom] = False
        rest = rest_mask.nonzero().squeeze(1)  # increasing grid order
        targets = rest[(torch.arange(n_ctx, device=rest.device) * len(rest)) // max(n_ctx, 1)]
        others = rest[~torch.isin(rest, targets)]
        unit = F.normalize(keys[b].float(), dim=-1)  # (N, E)
        group = (unit[others] @ unit[targets].T).argmax(-1)  # (n_others,) target of each other token
        sums = merged[b, targets].float().index_add(0, group, merged[b, others].float())
        counts = torch.ones(n_ctx, device=merged.device).index_add(0, group, torch.ones_like(group, dtype=torch.float))
        ctx = (sums / counts[:, None]).to(merged.dtype)
        idx = torch.cat([dom, targets])
        order = idx.argsort()
        tokens.append(torch.cat([merged[b, dom], ctx])[order])
        index.append(idx[order])
    return torch.stack(tokens), torch.stack(index)


def prune_top_k(vision, projector, pixels: torch.Tensor, k: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseVILA's whole prune at a fixed k: pixels (B, C, S, S) -> (B, k, d) tokens, (B, k) index.

    Encoder (salience layer `layer` also returning q, k, LSE), salience per projector token, top-k,
    gather, projector MLP on the kept tokens. No host synchronisation and fixed shapes throughout,
    so `VLM.encode_images` replays exactly this function from a CUDA graph per (B, k, layer)."""
    feats, (q, kk, lse) = vision.features(pixels, qk_layer=layer)
    merged = projector.merge(feats)  # (B, N', C)
    sal = grid_salience(token_salience(q, kk, vision.cfg, lse), projector)  # (B, N')
    idx = top_k(sal, k)
    return projector.mlp(gather(merged, idx)), idx


def prune(vision, projector, pixels: torch.Tensor, sparsity: SparsityConfig,
          graphs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode and prune: pixels (B, C, S, S) -> (B, k, d) LLM-width tokens and (B, k) their index in
    the image's projector-token grid (increasing), k = keep_count(N', prefill_keep).

    `graphs`: a GraphCache over `prune_top_k` (tinyvila/cuda_graph.py); given, "sparsevila" on CUDA
    is one graph replay, the same kernels as the eager call. "random" uses the encoder's own graph
    when it has one (its selection is a host RNG); "visionzip" stays eager (groups of data-dependent
    size, a per-image host loop)."""
    cfg = vision.cfg
    k = keep_count(projector.n_out, sparsity.prefill_keep)
    if sparsity.prefill_method == "random":  # needs no attention: the plain encoder runs
        merged = projector.merge(vision(pixels))  # (B, N', C)
        idx = random_k(merged.shape[0], merged.shape[1], k, sparsity.seed, merged.device)
        return projector.mlp(gather(merged, idx)), idx
    layer = salience_layer(cfg, sparsity)
    if sparsity.prefill_method == "sparsevila":
        if graphs is not None and pixels.is_cuda:
            return graphs(pixels, k, layer)
        return prune_top_k(vision, projector, pixels, k, layer)
    feats, (q, kk, lse) = vision.features(pixels, qk_layer=layer)
    merged = projector.merge(feats)  # (B, N', C)
    sal = grid_salience(token_salience(q, kk, cfg, lse), projector)  # (B, N')
    keys = kk.mean(1)  # (B, T, Dh): head-mean keys, as VisionZip
    keys = projector.merge(keys[:, 1:] if cfg.n_out_tokens < cfg.n_tokens else keys)  # (B, N', E)
    tokens, idx = visionzip(merged, sal, keys, k)
    return projector.mlp(tokens), idx
