"""Measuring a conversation, shared by `scripts/bench.py` and `python -m tinyvila.chat --benchmark`.

- `summary(turns)`: one conversation's (or turn's) breakdown from `api.Stats`: encode, prefill,
  decode, end to end, TTFT, decode tok/s, tokens, context, visual kept, decode rows, peak memory;
  `line` and `table` print it the same way in both tools.
- `FirstUse`: counts Triton kernel loads (a compilation or a disk-cache load on first use in this
  process) and autotuner runs while active, so a timed turn that paid for them says so.
- The cost model speed-ups are set beside (DESIGN.md sec. 8, reference/perf.md sec. 2):
  prefill FLOPs = 2 N P_lin + 4 L H D (N P + N (N + 1) / 2) for N new tokens after P cached ones
  (linears, then causal QK^T and PV); a decode step at R attended rows reads every weight the step
  uses in its stored format plus R KV rows: W + R * 2 L Hkv D b (b = bytes per KV element).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from .api import Stats
from .config import VLMConfig

# key: (header, format). The order is the print order.
COLUMNS = {
    "encode_ms": ("encode ms", ".1f"), "prefill_ms": ("prefill ms", ".1f"), "prefill_tokens": ("prefill tok", "d"),
    "decode_ms": ("decode ms", ".1f"), "decode_tokens": ("decode tok", "d"), "e2e_ms": ("e2e ms", ".1f"),
    "ttft_ms": ("TTFT ms", ".1f"), "decode_tok_s": ("tok/s", ".1f"), "context_tokens": ("context", "d"),
    "visual": ("visual kept", "s"), "decode_rows": ("decode rows", "d"), "peak_gb": ("peak GB", ".2f"),
    "first_use": ("first-use loads", "d"),  # Triton kernel loads + autotunings inside the timed span (FirstUse)
}


def summary(turns: list[Stats], peak_gb: float | None = None) -> dict:
    """The breakdown of one conversation (or one turn): times and token counts summed over the turns,
    TTFT of the first turn, context and decode rows of the last, decode tok/s over all turns."""
    if not turns:
        raise ValueError("summary of no turns")
    total = {k: sum(getattr(t, k) for t in turns) for k in
             ("encode_ms", "prefill_ms", "prefill_tokens", "decode_ms", "decode_tokens")}
    kept, visual = sum(t.visual_kept for t in turns), sum(t.visual_tokens for t in turns)
    return {**total, "e2e_ms": total["encode_ms"] + total["prefill_ms"] + total["decode_ms"],
            "ttft_ms": turns[0].ttft_ms,
            "decode_tok_s": 1000 * total["decode_tokens"] / total["decode_ms"] if total["decode_ms"] else 0.0,
            "context_tokens": turns[-1].context_tokens, "visual": f"{kept}/{visual}" if visual else "-",
            "decode_rows": turns[-1].decode_rows, "peak_gb": peak_gb}


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt) if isinstance(value, (int, float)) and fmt != "s" else str(value)


def line(row: dict, columns: dict | None = None) -> str:
    """One row as `header value | ...`: the COLUMNS it has (or `columns`), in their order."""
    cols = {k: v for k, v in (columns or COLUMNS).items() if k in row}
    return " | ".join(f"{head} {_cell(row[k], fmt)}" for k, (head, fmt) in cols.items())


def table(rows: list[dict], first: str, extra: dict | None = None) -> str:
    """Rows as an aligned table: column `first` (a label), then the COLUMNS and `extra` columns
    ({key: (header, format)}) the first row has."""
    cols = {first: (first, "s"), **{k: v for k, v in {**COLUMNS, **(extra or {})}.items() if k in rows[0]}}
    cells = [[head for head, _ in cols.values()]]
    cells += [[_cell(r.get(k), fmt) for k, (_, fmt) in cols.items()] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(c, widths)) for c in cells)


# -- peak memory and first use -------------------------------------------------------------------------
def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device) -> float | None:
    """Peak allocated GPU memory since the last `reset_peak`, GiB (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def _autotuners() -> list:
    """The Triton autotuners of the loaded kernel modules (their `cache` grows by one per new key)."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return []
    mods = [m for name, m in list(sys.modules.items()) if m is not None and name.split(".")[0] in ("csrc_triton", "tinyvila")]
    return [obj for m in mods for obj in list(vars(m).values()) if isinstance(obj, Autotuner)]


@dataclass
class FirstUse:
    """Counts Triton kernel binaries loaded (compiled or read from the disk cache: both are first-use
    costs of this process) and autotuner key misses between `start()` and `stop()`."""

    loads: int = 0
    tunings: int = 0
    _tuned_before: int = field(default=0, repr=False)
    _active: bool = field(default=False, repr=False)

    def _on_load(self, *args, **kwargs) -> None:
        self.loads += 1

    def start(self) -> "FirstUse":
        self.loads = self.tunings = 0
        self._tuned_before = sum(len(a.cache) for a in _autotuners())
        try:
            from triton import knobs
            knobs.runtime.kernel_load_end_hook.add(self._on_load)
            self._active = True
        except (ImportError, AttributeError):  # no Triton, or one without the hook: loads stay 0
            self._active = False
        return self

    def stop(self) -> int:
        """Stop counting; returns loads + tunings."""
        if self._active:
            from triton import knobs
            knobs.runtime.kernel_load_end_hook.remove(self._on_load)
            self._active = False
        self.tunings = sum(len(a.cache) for a in _autotuners()) - self._tuned_before
        return self.loads + self.tunings

    def __enter__(self) -> "FirstUse":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- cost model ----------------------------------------------------------------------------------------
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


class Recorder:
    """Per-answer measurement of a chat session (`python -m tinyvila.chat --benchmark`): peak memory
    and first-use loads since the previous answer (so an image added before a question counts with
    it), and the answers of the current conversation."""

    def __init__(self, device):
        self.device, self.turns, self.rows = device, [], []
        self._first_use = FirstUse()
        self._begin()

    def _begin(self) -> None:
        reset_peak(self.device)
        self._first_use.start()

    def record(self, stats: Stats) -> dict:
        """The answer just given: its summary row (with peak memory and first-use loads)."""
        row = {**summary([stats], peak_gb(self.device)), "first_use": self._first_use.stop()}
        self.turns.append(stats)
        self.rows.append(row)
        self._begin()
        return row

    def total(self) -> dict:
        """The conversation so far as one row: sums, first TTFT, the highest peak."""
        peaks = [r["peak_gb"] for r in self.rows if r["peak_gb"] is not None]
        return {**summary(self.turns, max(peaks) if peaks else None),
                "first_use": sum(r["first_use"] for r in self.rows)}

    def report(self) -> str:
        """A table of the conversation's answers and its total; then forgets them (a new conversation)."""
        rows = [{"turn": str(i + 1), **r} for i, r in enumerate(self.rows)] + [{"turn": "total", **self.total()}]
        self.turns, self.rows = [], []
        return table(rows, "turn")

    def close(self) -> None:
        self._first_use.stop()
