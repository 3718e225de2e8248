"""The language model: one LLaMA-style decoder for Llama-2/3 (incl. llama3 RoPE scaling) and Qwen2.

`TextModel` runs hidden states through the layers against a preallocated `KVCache` and returns
float32 logits; `text_config_from_hf` / `text_weights_from_hf` import a HuggingFace
LlamaForCausalLM / Qwen2ForCausalLM (config dict, state dict) into the tinyvila layout of
docs/checkpoint_format.md. Numerics follow HF `modeling_llama.py`: RoPE tables in fp32 cast to the
activation dtype, RMSNorm statistics in fp32. Tested against transformers in tests/test_text.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn as nn

from tinyvila import ops
from tinyvila.config import RopeScaling, TextConfig


# -- RoPE ----------------------------------------------------------------------------------------
def rope_inv_freq(cfg: TextConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies, (Dh/2,) fp32: exactly HF's default / llama3 computation.

    Computed on demand rather than held in a buffer, so modules built on the meta device carry
    no state that `load_state_dict(assign=True)` would leave behind on meta.
    """
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float, device=device) / D))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    # Llama-3.1: long wavelengths are slowed down by `factor`, short ones kept, the band between
    # interpolated smoothly (HF `_compute_llama3_parameters`, same expressions, same order).
    low_freq_wavelen = rs.original_max_position / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / rs.factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin(cfg: TextConfig, positions: torch.Tensor, dtype: torch.dtype,
                 inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables for `positions` (T,) long -> two (T, Dh) tensors in `dtype`.

    The angles are formed in fp32 and only the results cast, as HF does, so fp16 runs see the same
    tables as the HF fp16 model (angles of large positions would be wrong if formed in fp16).
    `inv_freq`: `rope_inv_freq(cfg)` on the positions' device, when the caller keeps it.
    """
    if inv_freq is None:
        inv_freq = rope_inv_freq(cfg, positions.device)
    freqs = positions.float()[:, None] * inv_freq  # (T, Dh/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, Dh): rotate-half pairs d with d + Dh/2
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_table(cfg: TextConfig, n: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """cos and sin of positions 0..n-1 -> (2, n, Dh) in `dtype`: a decode step reads its row (StepIndex.rope)
    instead of running rope_cos_sin's seven tiny kernels every step. The same ops over all n positions, each
    elementwise, so row p equals rope_cos_sin(cfg, [p]) bit for bit (tests/test_rope_table.py)."""
    return torch.stack(rope_cos_sin(cfg, torch.arange(n, device=device), dtype))


# -- KV cache ------------------------------------------------------------------------------------
# The cache (spans, retrieval scoring, packed decode) lives in kv_cache.py; re-exported here.
from tinyvila.kv_cache import KVCache, StepIndex  # noqa: E402


# -- modules -------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's add and this norm in one pass: -> (norm(residual + x), residual + x);
        residual None -> (norm(x), x)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Causal GQA self-attention over the cache; q, k, v come from one fused projection."""

    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, cfg.qkv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                start: int | StepIndex) -> torch.Tensor:
        """x: (B, T, d) at cache slots start..start+T-1 (or a decode step's StepIndex); cos, sin:
        (T, Dh) -> (B, T, d)."""
        return self.wo(self.heads(self.wqkv(x), cos, sin, cache, start))

    def heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
              start: int | StepIndex) -> torch.Tensor:
        """The projected q, k, v (B, T, qkv_dim) -> the heads' outputs (B, T, H * Dh), before wo."""
        # RoPE on q and k, k and v stored at their slots: one fused kernel on CUDA.
        q = cache.rope_write(self.layer, start, qkv, cos, sin, self.n_heads)  # (B, H, T, D)
        return self._attend(q, cache, start)

    def heads_normed(self, rows: ops.NormedRows, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                     start: int | StepIndex) -> torch.Tensor:
        """heads() of wqkv (W4) applied to RMSNorm(rows.h) * weight (Block.forward_fused). With
        ops.FUSED_ROPE_GEMV, RoPE and the cache write ride in the qkv GEMV's launch (ops.w4a16_linear_rope)."""
        if not ops.FUSED_ROPE_GEMV:
            return self.heads(self.wqkv.forward_normed(rows), cos, sin, cache, start)
        k, v, slots, second = cache.write_targets(self.layer, start, rows.xg.shape[1])
        q = self.wqkv.forward_normed_rope(rows, cos, sin, k, v, slots, self.n_heads, self.n_kv_heads, second)
        return self._attend(q, cache, start)  # q: (B, H, T, D)

    def _attend(self, q: torch.Tensor, cache: KVCache, start: int | StepIndex) -> torch.Tensor:
        """Rotated q (B, H, T, D), its k and v already cached -> (B, T, H * D)."""
        B, _, T, _ = q.shape
        # Dense, scored (SparseVILA question) or packed-decode attention.
        o = cache.attend(self.layer, start, q)  # (B, H, T, D)
        return o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one projection `w13` (gate rows first)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.silu_mul(self.w13(x)))


class Block(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                start: int) -> torch.Tensor:
        """h (B, T, d) -> the block's output (B, T, d); the standalone form (AWQ calibration runs it)."""
        x, residual = self.forward_residual(h, None, cos, sin, cache, start)
        return residual + x

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                         sin: torch.Tensor, cache: KVCache, start) -> tuple[torch.Tensor, torch.Tensor]:
        """The form TextModel runs: the block's input is the stream residual + x (x when residual is
        None) -> (MLP output, stream before it), left unadded so that the add is fused into the next
        norm (the next layer's attn_norm, or the final norm). Same bits as `forward`."""
        h, residual = self.attn_norm.add_norm(x, residual)
        h, residual = self.mlp_norm.add_norm(self.attn(h, cos, sin, cache, start), residual)
        return self.mlp(h), residual

    def fused_ok(self) -> bool:
        """Whether every linear can take the fused norm/GEMV chain (W4 layers: forward_normed)."""
        return all(hasattr(lin, "forward_normed") for lin in (self.attn.wqkv, self.attn.wo, self.mlp.w13, self.mlp.w2))

    def forward_fused(self, x: torch.Tensor | ops.NormedRows, cos: torch.Tensor, sin: torch.Tensor,
                      cache: KVCache, start, next_norm: RMSNorm | None
                      ) -> ops.NormedRows | tuple[torch.Tensor, torch.Tensor]:
        """The decode form of forward_residual (W4 layers, ops.fused_norm_gemv): both norms live in the
        GEMVs (ops.NormedRows): wo's and w2's launches add their output to the stream and prepare the next
        norm (the MLP's, then `next_norm`, the next layer's attention norm), which qkv's and w13's launches
        apply; w13's launch also ends in SwiGLU where the kernel allows (ops.w4a16_linear_silu), and qkv's in RoPE
        and the cache write with ops.FUSED_ROPE_GEMV (Attention.heads_normed). x: the stream
        from the previous layer's w2 (NormedRows), or a plain stream (the first layer:
        its norm runs on its own). -> NormedRows for the next layer, or (MLP output, stream) like
        forward_residual when next_norm is None (the final norm then adds them)."""
        if not isinstance(x, ops.NormedRows):
            xn, h = self.attn_norm.add_norm(x, None)
            x = ops.NormedRows(h, xn, None, self.attn_norm.eps)
        o = self.attn.heads_normed(x, cos, sin, cache, start)
        rows = self.attn.wo.forward_norm_out(o, x.h, self.mlp_norm.weight, self.mlp_norm.eps)
        act = self.mlp.w13.forward_normed_silu(rows)
        if next_norm is None:
            return self.mlp.w2(act), rows.h
        return self.mlp.w2.forward_norm_out(act, rows.h, next_norm.weight, next_norm.eps)


class TextModel(nn.Module):
    """LLaMA / Qwen2 decoder. Parameter names are those of docs/checkpoint_format.md minus `text.`.

    `model.embed(tokens)` is the token embedding itself: (B, T) long -> (B, T, d). The parent VLM
    splices image embeddings into that output before calling `forward`.
    """

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # Tied models store no lm_head at all; the embedding matrix doubles as the output layer.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor, cache: KVCache, start: int | StepIndex, *, last_only: bool = False,
                positions: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run hidden states h (B, T, d) at cache slots start..start+T-1 -> logits (B, T or 1, V) fp32.

        K/V are written into `cache` and each row attends causally over slots 0..its own.
        `positions` (T,) long overrides the RoPE positions (default: the slots), e.g. after pruning.
        `last_only` returns only the last row's logits (prefill). `rows` (R,) long, a device tensor,
        returns only those rows' logits (B, R, V): a CUDA-graph prefill padded past its last real row
        selects that row by device index, which a replay can change and a host slice could not.
        A `StepIndex` as `start` runs one decode token (T = 1) at the slot, position and packed row
        held in its device tensors: no host values, so the step can be captured in a CUDA graph; its cos
        and sin are the row `pos` of its RoPE table when it has one (`StepIndex.rope`).
        """
        table = None
        if isinstance(start, StepIndex):  # its lengths are this step's (KVCache.begin_steps, ops.argmax_step)
            positions, table = start.pos, start.rope
        else:
            self._check_inputs(h, cache, start, positions)
            if positions is None:  # the slots themselves (one tensor, shared with the cache writes)
                positions = cache.slots(start, h.shape[1])
        if table is not None and table.dtype == h.dtype:
            cos, sin = table.index_select(1, positions)  # (1, Dh) each: the step's row, one gather
        else:
            cos, sin = rope_cos_sin(self.cfg, positions, h.dtype, self.inv_freq(h.device))  # (T, Dh) each
        x, residual = h, None  # the residual stream is residual + x; each add fuses into the next norm
        if self._fused_decode(h):
            for i, block in enumerate(self.layers):
                nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else None
                x = block.forward_fused(x, cos, sin, cache, start, nxt)
            x, residual = x
        else:
            for block in self.layers:
                x, residual = block.forward_residual(x, residual, cos, sin, cache, start)
        if rows is not None:
            x, residual = x.index_select(1, rows), None if residual is None else residual.index_select(1, rows)
        elif last_only:
            x, residual = x[:, -1:], None if residual is None else residual[:, -1:]
        h, _ = self.norm.add_norm(x, residual)
        # Logits in the activation dtype like HF, then fp32 for sampling.
        logits = ops.dense_linear(h, self.embed.weight if self.lm_head is None else self.lm_head.weight)
        return logits.float()

    def _fused_decode(self, h: torch.Tensor) -> bool:
        """Whether this call takes the fused norm/GEMV chain (Block.forward_fused): decode row counts
        (ops.fused_norm_gemv), W4 linears throughout, norm weights in h's dtype."""
        if not ops.fused_norm_gemv(h):
            return False
        return all(b.fused_ok() and b.attn_norm.weight.dtype == h.dtype and b.mlp_norm.weight.dtype == h.dtype
                   for b in self.layers)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE inverse frequencies on `device`, computed once (not a buffer: see rope_inv_freq)."""
        cached = getattr(self, "_inv_freq", None)
        if cached is None or cached.device != device:
            cached = self._inv_freq = rope_inv_freq(self.cfg, device)
        return cached

    def _check_inputs(self, h: torch.Tensor, cache: KVCache, start: int, positions: torch.Tensor | None) -> None:
        """Validate everything before the first layer writes to the cache."""
        B, T, _ = h.shape
        cache.check(start, T)
        if B != cache.batch or h.dtype != cache.dtype:
            raise ValueError(f"hidden states (batch {B}, {h.dtype}) do not match the cache "
                             f"(batch {cache.batch}, {cache.dtype})")
        if positions is not None and positions.shape != (T,):
            raise ValueError(f"positions must have shape ({T},), got {tuple(positions.shape)}")


# -- import from HuggingFace ---------------------------------------------------------------------
def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from either the v5 `rope_parameters` or the older keys."""
    rp = hf.get("rope_parameters")
    if rp is None:
        rp = dict(hf.get("rope_scaling") or {})
        rp.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rp.get("rope_type", rp.get("type", "default"))
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ValueError(f"unsupported rope type {kind!r}: only default and llama3 RoPE are implemented")
    return theta, RopeScaling(
        factor=float(rp["factor"]), low_freq_factor=float(rp["low_freq_factor"]),
        high_freq_factor=float(rp["high_freq_factor"]),
        original_max_position=int(rp["original_max_position_embeddings"]),
    )


def text_config_from_hf(hf: dict, *, max_seq_len: int | None = None) -> TextConfig:
    """TextConfig from an HF LlamaConfig / Qwen2Config dict (`config.json` of the `llm/` folder).

    max_seq_len defaults to min(max_position_embeddings, model_max_length / tokenizer_model_max_length
    where present). Variants this decoder does not implement are a ValueError, never a silent guess.
    """
    arch = hf.get("model_type")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported model_type {arch!r}: expected 'llama' or 'qwen2'")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
        raise ValueError("only SwiGLU MLPs without bias (hidden_act 'silu', mlp_bias false) are supported")
    # Llama's attention_bias also puts a bias on o_proj, which the runtime layout has no slot for.
    if arch == "llama" and hf.get("attention_bias", False):
        raise ValueError("llama attention_bias=True (bias on q/k/v/o) is not supported")
    if hf.get("use_sliding_window", False):
        raise ValueError("Qwen2 sliding-window attention is not supported")
    theta, scaling = _rope_from_hf(hf)
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // n_heads
    if max_seq_len is None:
        limits = [hf.get(k) for k in ("max_position_embeddings", "model_max_length", "tokenizer_model_max_length")]
        max_seq_len = min(int(n) for n in limits if n)
    return TextConfig(
        arch=arch, vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        ffn_dim=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, qkv_bias=arch == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), max_seq_len=max_seq_len,
        head_dim_override=None if head_dim == dim // n_heads else head_dim,
    )


def text_weights_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: TextConfig
                         ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """HF LlamaForCausalLM / Qwen2ForCausalLM state dict -> (tinyvila `text.*` tensors, HF keys used).

    q/k/v and gate/up are fused by concatenation (rows q, k, v and gate, up). The returned key set
    holds every HF key consumed or deliberately dropped (rotary `inv_freq` buffers; `lm_head.weight`
    of a tied model when it equals the embedding), so the caller can flag leftovers.
    """
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf_sd:
            raise KeyError(f"HF tensor {name!r} missing from the state dict")
        if name in used:
            raise RuntimeError(f"HF tensor {name!r} mapped twice")
        used.add(name)
        return hf_sd[name]

    out = {"text.embed.weight": take("model.embed_tokens.weight"), "text.norm.weight": take("model.norm.weight")}
    for i in range(cfg.n_layers):
        hp, tp = f"model.layers.{i}.", f"text.layers.{i}."
        qkv = [f"{hp}self_attn.{p}_proj" for p in "qkv"]
        out[tp + "attn_norm.weight"] = take(hp + "input_layernorm.weight")
        out[tp + "attn.wqkv.weight"] = torch.cat([take(n + ".weight") for n in qkv])
        if cfg.qkv_bias:
            out[tp + "attn.wqkv.bias"] = torch.cat([take(n + ".bias") for n in qkv])
        out[tp + "attn.wo.weight"] = take(hp + "self_attn.o_proj.weight")
        out[tp + "mlp_norm.weight"] = take(hp + "post_attention_layernorm.weight")
        out[tp + "mlp.w13.weight"] = torch.cat([take(hp + "mlp.gate_proj.weight"), take(hp + "mlp.up_proj.weight")])
        out[tp + "mlp.w2.weight"] = take(hp + "mlp.down_proj.weight")
        if out[tp + "attn.wqkv.weight"].shape != (cfg.qkv_dim, cfg.dim):
            raise ValueError(f"layer {i}: fused qkv has shape {tuple(out[tp + 'attn.wqkv.weight'].shape)}, "
                             f"config expects {(cfg.qkv_dim, cfg.dim)}")
    if not cfg.tie_embeddings:
        out["text.lm_head.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf_sd:
        if not torch.equal(take("lm_head.weight"), out["text.embed.weight"]):
            raise ValueError("tie_embeddings is set but lm_head.weight differs from the embedding")
    used |= {k for k in hf_sd if k.endswith("rotary_emb.inv_freq")}
    return out, used
