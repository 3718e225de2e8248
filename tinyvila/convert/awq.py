"""AWQ and round-to-nearest W4 quantization of a tinyvila LLM.

    python scripts/quantize.py awq checkpoints/smollm2-135m checkpoints/smollm2-135m-awq --group-size 64

AWQ (Lin et al., as llm-awq / AutoAWQ implement it; ../shared/reference/quant_and_models.md sec. 2),
block by block on calibration text: per-channel scales searched on a grid of 20 for the layer groups
attn_norm -> wqkv, v rows of wqkv -> wo (only without GQA), mlp_norm -> w13, up rows of w13 -> w2
(loss = MSE of the group's output), folded into the preceding norm or rows; then a weight-clipping
search per linear; then `quant.quantize_w4`. `method="rtn"` is the same quantizer without either search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm
import torch.nn as nn

from tinyvila import quant
from tinyvila.errors import CheckpointError
from tinyvila.kv_cache import KVCache
from tinyvila.loader import WEIGHTS, _read_tensors, load_model, read_headers, save_checkpoint
from tinyvila.text import Block, Pass, rope_cos_sin
from tinyvila.tokenizer import Tokenizer, load_tokenizer

N_GRID = 20          # scale ratios alpha = 0, 0.05, ..., 0.95 (1.0 is never tried, as in the reference)
CLIP_SHRINK = 0.5    # clipping tries max |w| * (1 - i/20) for i < 10, i.e. down to 55%
HELDOUT_EVERY = 4    # pydoc topics i % 4 == 0 (123 K of 465 K chars) are held out, never calibrated on
QUANTIZED = ("attn.wqkv", "attn.wo", "mlp.w13", "mlp.w2")


# -- calibration text -----------------------------------------------------------------------------------
def pydoc_texts(split: str) -> list[str]:
    """English text on every Python install: the `pydoc_data.topics` entries, sorted by name, split
    deterministically into "calib" (3 of 4) and "heldout" (every 4th, from the first)."""
    from pydoc_data.topics import topics

    if split not in ("calib", "heldout"):
        raise ValueError(f"split must be 'calib' or 'heldout', got {split!r}")
    held = split == "heldout"
    return [topics[k].strip() for i, k in enumerate(sorted(topics)) if (i % HELDOUT_EVERY == 0) == held]


def token_blocks(tokenizer: Tokenizer, texts: list[str], n: int, seqlen: int) -> torch.Tensor:
    """Texts tokenized one by one, concatenated, cut into `n` blocks of `seqlen` -> (n, seqlen) long.

    Raises ValueError when the texts hold fewer than n * seqlen tokens.
    """
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text, add_special_tokens=True)
        if len(ids) >= n * seqlen:
            break
    if len(ids) < n * seqlen:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than {n} x {seqlen}; "
                         f"lower --n-samples/--seqlen or pass a longer --calib file")
    return torch.tensor(ids[: n * seqlen]).view(n, seqlen)


def calib_texts(path: Path | None) -> list[str]:
    """The --calib file split into paragraphs, or the pydoc calibration split."""
    if path is None:
        return pydoc_texts("calib")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise CheckpointError(f"--calib {path}: cannot read ({e})") from None
    return [p.strip() for p in text.split("\n\n") if p.strip()]


# -- the quantizer used inside the searches --------------------------------------------------------------
def pseudo_quantize(w: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense (..., K) -> the weight a W4 checkpoint would hold, in fp32: exactly
    `dequantize_w4(**quantize_w4(w, group_size, dtype))` without packing (tested equal)."""
    shape = w.shape
    wg = w.float().reshape(-1, group_size)
    wmax, wmin = wg.amax(-1, keepdim=True).clamp(min=0), wg.amin(-1, keepdim=True).clamp(max=0)
    s = ((wmax - wmin).clamp(min=1e-5) / 15).to(dtype).float()  # the stored scale
    z = torch.clamp(torch.round(-wmin / s), 0, 15)
    q = torch.clamp(torch.round(wg / s) + z, 0, 15)
    return (q * s - z * s).to(dtype).float().reshape(shape)


# -- scale search and folding -----------------------------------------------------------------------------
@dataclasses.dataclass
class ScaleGroup:
    """Linears (rows of them) that read one input x, the op before them that absorbs 1/s, and the
    module whose output is the loss. prev: a norm (nn.Module with .weight) or (linear, row slice)."""

    name: str
    prev: object
    linears: list[nn.Linear]
    x: torch.Tensor                  # (n, K) the linears' input
    inspect: Callable[[torch.Tensor], torch.Tensor]


def _w_mean(weights: list[torch.Tensor], G: int) -> torch.Tensor:
    """Per input channel: mean over output rows of |w| relative to its group's max (K,)."""
    w = torch.cat(weights).float()
    K = w.shape[1]
    a = w.abs().view(-1, G)
    return (a / (a.amax(1, keepdim=True) + 1e-6)).view(-1, K).mean(0)


def search_scale(g: ScaleGroup, G: int, dtype: torch.dtype) -> torch.Tensor:
    """The AWQ scale (K,) of one group: argmin over alpha of MSE(inspect(x) with Q(W s)/s, fp output)."""
    x = g.x.reshape(-1, g.x.shape[-1])  # (n, K)
    x_mean = x.abs().float().mean(0)
    w_mean = _w_mean([lin.weight for lin in g.linears], G)
    originals = [lin.weight.data.clone() for lin in g.linears]
    # A group whose output is one linear's: MSE(x dW^T) = sum(dW C * dW) / (n_out) with C = x^T x / n,
    # the same loss for a (K, K) product instead of a pass over every token.
    linear = len(g.linears) == 1 and g.inspect is g.linears[0]
    with torch.no_grad():
        C = (x.float().T @ x.float()) / x.shape[0] if linear else None
        ref = None if linear else g.inspect(g.x)
        best, best_s = float("inf"), torch.ones_like(x_mean)
        for r in range(N_GRID):
            a = r / N_GRID
            s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
            for lin, w in zip(g.linears, originals):
                lin.weight.data = (pseudo_quantize(w * s, G, dtype) / s).to(w.dtype)
            if linear:
                dw = g.linears[0].weight.float() - originals[0].float()  # (N, K)
                loss = ((dw @ C) * dw).sum().item() / dw.shape[0]
            else:
                loss = (g.inspect(g.x) - ref).float().pow(2).mean().item()
            if loss < best:
                best, best_s = loss, s.clone()
        for lin, w in zip(g.linears, originals):
            lin.weight.data = w
    return best_s


def apply_scale(g: ScaleGroup, s: torch.Tensor) -> None:
    """Fold s: the previous op's output channels / s, the linears' input columns * s (exact in fp)."""
    with torch.no_grad():
        if isinstance(g.prev, tuple):
            lin, rows = g.prev
            lin.weight.data[rows] /= s[:, None].to(lin.weight.dtype)
            if lin.bias is not None:
                lin.bias.data[rows] /= s.to(lin.bias.dtype)
        else:
            g.prev.weight.data /= s.to(g.prev.weight.dtype)
        for lin in g.linears:
            lin.weight.data *= s[None, :].to(lin.weight.dtype)


def search_clip(w: torch.Tensor, x: torch.Tensor, G: int, dtype: torch.dtype, rows_per_batch: int = 256
                ) -> torch.Tensor:
    """Per (row, group) clipping bound of w (N, K) minimizing the MSE of x_g . w_g over the tokens
    x (n, K); returns (N, K/G, 1). The reference samples 512 tokens and forms the products; the MSE
    is dw_g^T C_g dw_g with C_g = x_g^T x_g / n, so every token counts at a (G, G) cost per group."""
    N, K = w.shape
    x = x.reshape(-1, K).float()
    xg = x.view(-1, K // G, G).transpose(0, 1)  # (K/G, n, G)
    C = xg.transpose(1, 2) @ xg / x.shape[0]  # (K/G, G, G)
    bounds = []
    for r0 in range(0, N, rows_per_batch):
        wb = w[r0:r0 + rows_per_batch].float().view(-1, K // G, G)  # (b, K/G, G)
        org_max = wb.abs().amax(-1, keepdim=True)  # (b, K/G, 1)
        best_err = torch.full(org_max.shape[:2], float("inf"), device=w.device)
        best_max = org_max.clone()
        for i in range(int(CLIP_SHRINK * N_GRID)):
            max_val = org_max * (1 - i / N_GRID)
            dw = pseudo_quantize(wb.clamp(-max_val, max_val), G, dtype) - wb  # (b, K/G, G)
            dwg = dw.transpose(0, 1)  # (K/G, b, G)
            err = (torch.bmm(dwg, C) * dwg).sum(-1).T  # (b, K/G)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max[better] = max_val[better]
        bounds.append(best_max)
    return torch.cat(bounds)


def _clip(lin: nn.Linear, x: torch.Tensor, G: int, dtype: torch.dtype, rows: slice = slice(None)) -> None:
    w = lin.weight.data[rows]
    bound = search_clip(w, x, G, dtype)  # (N', K/G, 1)
    wg = w.view(w.shape[0], -1, G)
    lin.weight.data[rows] = torch.maximum(torch.minimum(wg, bound), -bound).view_as(w).to(w.dtype)


# -- one block ---------------------------------------------------------------------------------------------
def _capture(block: Block, h: torch.Tensor, cos, sin, cache: KVCache
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the block on h (B, T, d) at slot 0 of `cache`: (output, {linear name: its input (B, T, K)})."""
    inputs, hooks = {}, []
    for name in QUANTIZED:
        mod = block.get_submodule(name)
        hooks.append(mod.register_forward_hook(lambda m, a, o, name=name: inputs.__setitem__(name, a[0])))
    try:
        with torch.no_grad():
            out = block(h, cos, sin, cache, 0)
    finally:
        for hk in hooks:
            hk.remove()
    return out, inputs


def _groups(block: Block, inputs: dict, cos, sin, cache: KVCache) -> list[ScaleGroup]:
    H, Hkv, D = block.attn.n_heads, block.attn.n_kv_heads, block.attn.head_dim
    attn = lambda x: block.attn(x, cos, sin, Pass(cache, 0))  # noqa: E731
    groups = [ScaleGroup("attn_norm->wqkv", block.attn_norm, [block.attn.wqkv], inputs["attn.wqkv"], attn)]
    if H == Hkv:  # v rows -> wo only when shapes allow (no GQA), as the reference does
        v_rows = slice((H + Hkv) * D, (H + 2 * Hkv) * D)
        groups.append(ScaleGroup("v->wo", (block.attn.wqkv, v_rows), [block.attn.wo], inputs["attn.wo"],
                                 block.attn.wo))
    groups.append(ScaleGroup("mlp_norm->w13", block.mlp_norm, [block.mlp.w13], inputs["mlp.w13"], block.mlp))
    F = block.mlp.w2.weight.shape[1]
    groups.append(ScaleGroup("up->w2", (block.mlp.w13, slice(F, 2 * F)), [block.mlp.w2], inputs["mlp.w2"],
                             block.mlp.w2))
    return groups


def awq_block(block: Block, h: torch.Tensor, cos, sin, cache: KVCache, G: int, dtype: torch.dtype
              ) -> torch.Tensor:
    """AWQ-transform one block in place (scales folded, weights clipped; still dense) -> next input.

    h (n, T, d) are whole calibration sequences; `cache` (batch n, T slots) is scratch space."""
    out, inputs = _capture(block, h, cos, sin, cache)
    groups = _groups(block, inputs, cos, sin, cache)
    scales = [search_scale(g, G, dtype) for g in groups]
    for g, s in zip(groups, scales):
        apply_scale(g, s)
    _, inputs = _capture(block, h, cos, sin, cache)  # the linears' inputs after scaling (x / s)
    H, Hkv, D = block.attn.n_heads, block.attn.n_kv_heads, block.attn.head_dim
    with torch.no_grad():
        # q/k rows are never clipped (the reference skips them: their error is amplified by softmax).
        _clip(block.attn.wqkv, inputs["attn.wqkv"], G, dtype, slice((H + Hkv) * D, None))
        for name in ("attn.wo", "mlp.w13", "mlp.w2"):
            _clip(block.get_submodule(name), inputs[name], G, dtype)
    return out


# -- whole model ---------------------------------------------------------------------------------------------
def quantize_text(text, method: str, G: int, dtype: torch.dtype, tokens: torch.Tensor | None = None,
                  progress: bool = True) -> dict[str, torch.Tensor]:
    """Quantize a dense TextModel (modified in place for AWQ) -> {text.layers.i.<linear>.qweight/scales/
    zeros, text.layers.i.{attn,mlp}_norm.weight (folded)}. tokens (n, T): calibration ids (AWQ only)."""
    bar = tqdm(total=len(text.layers), desc=method, unit="layer") if progress else None
    h = cos = sin = cache = None
    if method == "awq":
        with torch.no_grad():
            h = text.embed(tokens.to(text.embed.weight.device))  # (n, T, d)
        cos, sin = rope_cos_sin(text.cfg, torch.arange(tokens.shape[1], device=h.device), h.dtype)
        cache = KVCache(text.cfg, batch=tokens.shape[0], max_seq_len=tokens.shape[1], dtype=h.dtype,
                        device=h.device)
    out = {}
    for i, block in enumerate(text.layers):
        if method == "awq":
            h = awq_block(block, h, cos, sin, cache, G, dtype)
        tp = f"text.layers.{i}."
        for name in QUANTIZED:
            q = quant.quantize_w4(block.get_submodule(name).weight.data.float(), G, dtype)
            out.update({f"{tp}{name}.{k}": v.cpu() for k, v in q.items()})
        for norm in ("attn_norm", "mlp_norm"):
            out[f"{tp}{norm}.weight"] = block.get_submodule(norm).weight.data.to(dtype).cpu()
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return out


def check_calib(calib: Path | None) -> None:
    """A --calib that names no readable file is an error whatever the method (rtn reads no text, but a
    typo must not pass silently)."""
    if calib is not None and not Path(calib).is_file():
        raise CheckpointError(f"--calib {calib}: no such file; pass a UTF-8 text file, or leave --calib out "
                              f"for the bundled pydoc text")


def check_group_size(text, group_size: int, where: Path) -> None:
    """Every quantized linear's in-width must be a multiple of the group size."""
    for name in QUANTIZED:
        K = text.layers[0].get_submodule(name).weight.shape[1]
        if K % group_size:
            raise CheckpointError(f"{where}: {name} has K={K}, not a multiple of --group-size {group_size}; "
                                  f"use a smaller group (576-wide SmolLM2 needs 64 or 32)")


def quantize_llm(model, tokenizer_path: Path, *, method: str, group_size: int, calib: Path | None,
                 n_samples: int, seqlen: int) -> dict[str, torch.Tensor]:
    """W4 tensors (and AWQ-folded norms) of a dense VLM's LLM, in the config's dtype; modifies `model.text`."""
    if method not in ("awq", "rtn"):
        raise ValueError(f"--method must be 'awq' or 'rtn', got {method!r}")
    tokens = None
    if method == "awq":
        tokens = token_blocks(load_tokenizer(tokenizer_path), calib_texts(calib), n_samples, seqlen)
    return quantize_text(model.text, method, group_size, getattr(torch, model.cfg.dtype), tokens)


def drop_dense_linears(sd: dict[str, torch.Tensor]) -> None:
    """Removes the dense weights of the LLM linears that W4 tensors replace, in place."""
    for k in [k for k in sd if k.startswith("text.layers.") and k.rsplit(".", 2)[-2] in ("wqkv", "wo", "w13", "w2")
              and k.endswith(".weight")]:
        del sd[k]


def search_device(device: str | None) -> tuple[str, torch.dtype | None]:
    """Where the search runs and in what dtype: fp32 on CPU (fast there, and the loss needs the precision);
    on GPU the model's own dtype."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, torch.float32 if device == "cpu" else None


def quantize_checkpoint(src: str | Path, dst: str | Path, *, method: str = "awq", group_size: int = 128,
                        calib: Path | None = None, n_samples: int = 8, seqlen: int = 256,
                        device: str | None = None, overwrite: bool = False) -> Path:
    """A dense tinyvila checkpoint -> its W4A16 version; every non-LLM-linear tensor is copied unchanged
    (norms that absorbed AWQ scales excepted)."""
    src = Path(src)
    if method not in ("awq", "rtn"):
        raise ValueError(f"--method must be 'awq' or 'rtn', got {method!r}")
    check_calib(calib)
    device, dtype = search_device(device)
    model = load_model(src, device=device, dtype=dtype)
    cfg = model.cfg
    if cfg.quant.llm != "none":
        raise CheckpointError(f"{src}: already quantized ({cfg.quant.llm}); start from a dense checkpoint")
    check_group_size(model.text, group_size, src)
    new = quantize_llm(model, src / cfg.tokenizer, method=method, group_size=group_size, calib=calib,
                       n_samples=n_samples, seqlen=seqlen)
    _, where, _ = read_headers(src)
    sd = _read_tensors(src, where)
    drop_dense_linears(sd)
    sd.update(new)
    qcfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, llm="w4a16", group_size=group_size))
    extras = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file() and p.name != "config.json"
              and p.suffix != ".safetensors" and not p.name.startswith(WEIGHTS)}
    return save_checkpoint(dst, qcfg, sd, extras, overwrite=overwrite)
