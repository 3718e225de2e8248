"""Measuring a conversation, shared by `scripts/bench.py` and `python -m tinyvila.chat --benchmark`.

- `summary(turns)`: one conversation's (or turn's) breakdown from `api.Stats`: encode, video decode and
  sampling (its own column, outside e2e and TTFT), prefill, decode, end to end, TTFT, decode tok/s,
  tokens, context, visual kept, decode rows, peak memory; `line` and `table` print it the same way in both tools.
- `FirstUse`: counts Triton kernel loads (a compilation or a disk-cache load on first use in this
  process) and autotuner runs while active, so a timed turn that paid for them says so.
The cost model that bench.py sets speeds beside (FLOPs, bytes a decode step reads) is
scripts/benches/cost_model.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from .api import Stats

# key: (header, format). The order is the print order.
COLUMNS = {
    "encode_ms": ("encode ms", ".1f"), "prefill_ms": ("prefill ms", ".1f"), "prefill_tokens": ("prefill tok", "d"),
    "decode_ms": ("decode ms", ".1f"), "decode_tokens": ("decode tok", "d"), "e2e_ms": ("e2e ms", ".1f"),
    "media_ms": ("video ms", ".1f"),  # decoding and sampling video frames: beside e2e, not in it
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
             ("encode_ms", "media_ms", "prefill_ms", "prefill_tokens", "decode_ms", "decode_tokens")}
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
