"""The cost model scripts/bench.py sets measured speeds beside (DESIGN.md sec. 8, reference/perf.md sec. 2).

Prefill FLOPs = 2 N P_lin + 4 L H D (N P + N (N + 1) / 2) for N new tokens after P cached ones (linears,
then causal QK^T and PV); a decode step at R attended rows reads every weight the step uses in its stored
format plus R KV rows: W + R * 2 L Hkv D b (b = bytes per KV element).
"""

from __future__ import annotations

import torch

from tinyvila.api import Stats
from tinyvila.config import VLMConfig


def _dtype_bytes(cfg: VLMConfig) -> int:
    return torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()


def _linear_shapes(cfg: VLMConfig) -> list[tuple[int, int]]:
    """(N, K) of one decoder layer's linears as tinyvila stores them (q/k/v and gate/up fused)."""
    t = cfg.text
    return [(t.qkv_dim, t.dim), (t.dim, t.n_heads * t.head_dim), (2 * t.ffn_dim, t.dim), (t.dim, t.ffn_dim)]


def linear_bytes(cfg: VLMConfig, N: int, K: int) -> int:
    """Stored bytes of one (N, K) LLM linear: fp16/bf16, or W4 = int4 payload + per group of G inputs
    a scale in the model dtype and an fp32 scaled zero (tinyvila/quant.py)."""
    b = _dtype_bytes(cfg)
    if cfg.quant.llm == "w4a16":
        return N * K // 2 + N * (K // cfg.quant.group_size) * (b + 4)
    return N * K * b


def decode_weight_bytes(cfg: VLMConfig) -> int:
    """Bytes one decode step must read besides the KV cache: every layer's linears (and qkv bias), its
    two RMSNorm scales, the final norm, the lm_head (the embedding matrix when tied, else an fp16
    matrix: AWQ leaves it unquantized) and one embedding row."""
    t, b = cfg.text, _dtype_bytes(cfg)
    layer = sum(linear_bytes(cfg, N, K) for N, K in _linear_shapes(cfg)) + 2 * t.dim * b
    layer += t.qkv_dim * b if t.qkv_bias else 0
    return t.n_layers * layer + t.dim * b + t.vocab_size * t.dim * b + t.dim * b


def kv_row_bytes(cfg: VLMConfig) -> int:
    """Bytes of one cached token's keys and values over all layers (fp16/bf16 cache)."""
    t = cfg.text
    return 2 * t.n_layers * t.n_kv_heads * t.head_dim * _dtype_bytes(cfg)


def decode_bytes(cfg: VLMConfig, turns: list[Stats]) -> float:
    """Bytes the decode steps of these turns must read. A turn of n answer tokens runs n - 1 steps
    (the first token comes from the prefill); step j attends over R0 + j rows, R0 = the rows at the
    turn's start: the packed rows (`decode_rows`) of a sparse turn, else the whole cache."""
    W, kv, total = decode_weight_bytes(cfg), kv_row_bytes(cfg), 0.0
    for t in turns:
        steps = max(t.decode_tokens - 1, 0)
        r0 = t.decode_rows if t.decode_rows else t.context_tokens - t.decode_tokens
        total += steps * W + kv * (steps * r0 + steps * (steps + 1) / 2)
    return total


def prefill_flops(cfg: VLMConfig, n_new: int, n_past: int) -> float:
    """FLOPs of prefilling n_new tokens after n_past cached ones: the linears, the last row's lm_head,
    and causal attention (QK^T and PV, 2 FLOPs per multiply-add)."""
    t = cfg.text
    params = t.n_layers * sum(N * K for N, K in _linear_shapes(cfg))
    attn = 4 * t.n_layers * t.n_heads * t.head_dim * (n_new * n_past + n_new * (n_new + 1) / 2)
    return 2 * n_new * params + 2 * t.dim * t.vocab_size + attn


def conversation_flops(cfg: VLMConfig, turns: list[Stats]) -> float:
    """Prefill FLOPs of a conversation's turns (each turn's past = the cache before it)."""
    return sum(prefill_flops(cfg, t.prefill_tokens, t.context_tokens - t.decode_tokens - t.prefill_tokens)
               for t in turns)
