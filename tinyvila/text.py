"""The language model: one LLaMA-style decoder for Llama-2/3 (incl. llama3 RoPE scaling) and Qwen2.

`TextModel` runs hidden states through the layers against a preallocated `KVCache` and returns
float32 logits; tinyvila/convert/hf.py imports a HuggingFace LlamaForCausalLM / Qwen2ForCausalLM
into it. Numerics follow HF `modeling_llama.py`: RoPE tables in fp32 cast to the
activation dtype, RMSNorm statistics in fp32. Tested against transformers in tests/test_text.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from tinyvila import decode_step, ops
from tinyvila.config import TextConfig
from tinyvila.kv_cache import KVCache, RowsIndex, StepIndex
from tinyvila.options import DEFAULT, Options
from tinyvila.retrieval import FastV, Retrieval


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


# -- one forward pass -----------------------------------------------------------------------------
@dataclass
class Pass:
    """Where one forward pass reads and writes: the conversation's cache, the slot of its first row (or a
    decode step's StepIndex: slot, packed row and RoPE position as device tensors; or a follow-up prefill's
    RowsIndex: its rows' slots as device tensors), and the sparsity state that changes which attention runs
    (SparseVILA's retrieval, FastV's key mask), both optional."""

    cache: KVCache
    start: int | StepIndex | RowsIndex
    retrieval: Retrieval | None = None
    fastv: FastV | None = None

    @property
    def step(self) -> bool:
        """A decode step (one token, device indices), rather than rows at host slots."""
        return isinstance(self.start, StepIndex)

    def packed(self):
        """The active packed decode buffer (retrieval.Packed) or None."""
        return None if self.retrieval is None else self.retrieval.packed


# -- modules -------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    options: Options = DEFAULT

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's add and this norm in one pass: -> (norm(residual + x), residual + x);
        residual None -> (norm(x), x)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, opts=self.options)


class Attention(nn.Module):
    """Causal GQA self-attention over the cache; q, k, v come from one fused projection.

    Which attention runs is decided here, from the pass: a decode step attends over the packed buffer when a
    SparseVILA turn has one, else over the full cache; rows at host slots attend causally over the cache,
    with their log-sum-exp when a question is being scored (SparseVILA) or FastV is deciding, and with FastV's
    key mask on the layers it prunes."""

    options: Options = DEFAULT

    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, cfg.qkv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: Pass) -> torch.Tensor:
        """x: (B, T, d) at slots p.start.. ; cos, sin: (T, Dh) -> (B, T, d)."""
        return self.wo(self.heads(self.wqkv(x), cos, sin, p))

    def heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: Pass) -> torch.Tensor:
        """The projected q, k, v (B, T, qkv_dim) -> the heads' outputs (B, T, H * Dh), before wo."""
        # RoPE on q and k, k and v stored at their slots: one fused kernel on CUDA.
        k, v, slots, second = self.write_targets(p, qkv.shape[1])
        q = ops.rope_qkv(qkv, cos, sin, k, v, slots, self.n_heads, self.n_kv_heads, second=second,
                         opts=self.options)  # (B, H, T, D)
        return self.attend(q, p)

    def write_targets(self, p: Pass, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """Where T new rows' k and v go: (k cache, v cache, slots (T,) on the device, second), the arguments of
        ops.rope_qkv; `second` = (packed k, packed v, rows) while a decode step runs over a packed buffer."""
        i, cache = self.layer, p.cache
        if p.step:
            packed = p.packed()
            second = None if packed is None else (*packed.layer(i), p.start.row)
            return cache.k[i], cache.v[i], p.start.slot, second
        if p.packed() is not None:
            raise RuntimeError("a packed decode buffer is active: decode steps go through a StepIndex; "
                               "unpack() before a prefill")
        if isinstance(p.start, RowsIndex):  # bounds checked by the caller (Decoder), on the host
            return cache.k[i], cache.v[i], p.start.slots, None
        cache.check(p.start, T)
        return cache.k[i], cache.v[i], cache.slots(p.start, T), None

    def attend(self, q: torch.Tensor, p: Pass) -> torch.Tensor:
        """Rotated q (B, H, T, D), its k and v already cached -> (B, T, H * D)."""
        B, _, T, _ = q.shape
        i = self.layer
        if p.step:
            if T != 1:
                raise RuntimeError(f"a decode step takes one token, got {T}")
            packed = p.packed()
            k, v = (p.cache.k[i], p.cache.v[i]) if packed is None else packed.layer(i)
            o = ops.decode_attention(q[:, :, 0], k, v, p.start.lengths, opts=self.options)[:, :, None]
        else:
            o = self._attend_rows(q, p)
        return o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, H, T, D) -> (B, T, H * D)

    def _attend_rows(self, q: torch.Tensor, p: Pass) -> torch.Tensor:
        """Rows at slots p.start.. over the cache up to the last of them -> (B, H, T, D)."""
        start, i = p.start, self.layer
        if isinstance(start, RowsIndex):  # a follow-up prefill's graph: no FastV, every row a question row
            sc = None if p.retrieval is None else p.retrieval.scoring
            o, lse = ops.attention_rows(q, p.cache.k[i], p.cache.v[i], start, lse=sc is not None,
                                         opts=self.options)
            if sc is not None:
                sc.add(i, sc.q_from, q, p.cache.k[i], lse, opts=self.options)
            return o
        k, v = p.cache.view(i, start + q.shape[2])
        keep = None if p.fastv is None else p.fastv.mask_for(i, k.shape[2])
        if keep is not None:
            return ops.attention_key_masked(q, k, v, start, keep)
        scoring = p.retrieval is not None and p.retrieval.scoring is not None
        deciding = p.fastv is not None and p.fastv.deciding
        if not (scoring or deciding):
            return ops.attention(q, k, v, causal=True, q_start=start)
        o, lse = ops.attention_lse(q, k, v, start)  # lse (B, H, T): the retrieval kernel's normaliser
        if scoring:
            p.retrieval.scoring.add(i, start, q, k, lse, opts=self.options)
        if deciding:
            p.fastv.observe(i, start, q, k, lse, opts=self.options)
        return o


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one projection `w13` (gate rows first)."""

    options: Options = DEFAULT

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.silu_mul(self.w13(x), opts=self.options))


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
        x, residual = self.forward_residual(h, None, cos, sin, Pass(cache, start))
        return residual + x

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                         sin: torch.Tensor, p: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """The form TextModel runs: the block's input is the stream residual + x (x when residual is None)
        -> (MLP output, stream before it), left unadded so that the add is fused into the next norm (the
        next layer's attn_norm, or the final norm). Same bits as `forward`. decode_step.block_fused is the
        decode form of this, with both norms inside the W4 GEMVs."""
        h, residual = self.attn_norm.add_norm(x, residual)
        h, residual = self.mlp_norm.add_norm(self.attn(h, cos, sin, p), residual)
        return self.mlp(h), residual


class TextModel(nn.Module):
    """LLaMA / Qwen2 decoder. Parameter names are those of docs/checkpoint_format.md minus `text.`.

    `model.embed(tokens)` is the token embedding itself: (B, T) long -> (B, T, d). The parent VLM
    splices image embeddings into that output before calling `forward`.
    """

    options: Options = DEFAULT

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # Tied models store no lm_head at all; the embedding matrix doubles as the output layer.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor, cache: KVCache, start: int | StepIndex, *, last_only: bool = False,
                positions: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                retrieval: Retrieval | None = None, fastv: FastV | None = None) -> torch.Tensor:
        """Run hidden states h (B, T, d) at cache slots start..start+T-1 -> logits (B, T or 1, V) fp32.

        K/V are written into `cache` and each row attends causally over slots 0..its own.
        `positions` (T,) long overrides the RoPE positions (default: the slots), e.g. after pruning.
        `last_only` returns only the last row's logits (prefill). `rows` (R,) long, a device tensor,
        returns only those rows' logits (B, R, V): a CUDA-graph prefill padded past its last real row
        selects that row by device index, which a replay can change and a host slice could not.
        A `StepIndex` as `start` runs one decode token (T = 1) at the slot, position and packed row
        held in its device tensors: no host values, so the step can be captured in a CUDA graph; its cos
        and sin are the row `pos` of its RoPE table when it has one (`StepIndex.rope`). A `RowsIndex` runs
        T rows at its device slots (a later turn's graph; `positions` given, bounds checked by the caller).
        `retrieval` / `fastv`: the conversation's sparsity state (see Attention).
        """
        p = Pass(cache, start, retrieval, fastv)
        cos, sin = self._rope(h, p, positions)
        if decode_step.use_fused(self, h):
            x, residual = decode_step.layers_fused(self, h, cos, sin, p)
        else:
            x, residual = h, None  # the residual stream is residual + x; each add fuses into the next norm
            for block in self.layers:
                x, residual = block.forward_residual(x, residual, cos, sin, p)
        if rows is not None:
            x, residual = x.index_select(1, rows), None if residual is None else residual.index_select(1, rows)
        elif last_only:
            x, residual = x[:, -1:], None if residual is None else residual[:, -1:]
        h, _ = self.norm.add_norm(x, residual)
        # Logits in the activation dtype like HF, then fp32 for sampling.
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return ops.dense_linear(h, w, opts=self.options).float()

    def _rope(self, h: torch.Tensor, p: Pass, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, Dh) of this pass's rows: a decode step's row of its RoPE table (one gather), else
        computed for the positions (default: the slots, one tensor shared with the cache writes)."""
        table = None
        if p.step:  # its lengths are this step's (Decoder._begin, ops.argmax_step)
            positions, table = p.start.pos, p.start.rope
        elif isinstance(p.start, RowsIndex):
            if positions is None:
                raise ValueError("rows at device slots (a RowsIndex) need their positions")
        else:
            self._check_inputs(h, p.cache, p.start, positions)
            if positions is None:
                positions = p.cache.slots(p.start, h.shape[1])
        if table is not None and table.dtype == h.dtype:
            cos, sin = table.index_select(1, positions)  # (1, Dh) each
            return cos, sin
        return rope_cos_sin(self.cfg, positions, h.dtype, self.inv_freq(h.device))

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
