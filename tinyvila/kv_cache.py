"""The KV cache of one conversation: storage only. Preallocated keys and values, spans, views, decode indices.

`KVCache` holds per layer `k[i]`, `v[i]` (B, Hkv, max_seq_len, Dh), views of one (n_layers, ...) tensor per K
and V (`k_stack`, `v_stack`; one tensor so a SparseVILA question's packing is one launch). Keys are stored
rotated at their logical position (text.Attention writes them), so packing never re-rotates. The session
records `Span`s (system, visual, text, question, answer) with a retrievable flag (visual by default), which
SparseVILA's retrieval (retrieval.py) reads. `StepIndex` holds where a decode step writes and reads, as
device tensors a captured CUDA graph advances itself; `RowsIndex` the same for the rows of a follow-up prefill.
Which attention runs over the cache is the model's business (text.Attention), not the cache's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import TextConfig
from .errors import ContextLimitError

KINDS = ("system", "visual", "text", "question", "answer")


@dataclass
class Span:
    """Cache slots [start, end) of one kind; only retrievable spans are ever sparsified."""

    kind: str
    start: int
    end: int
    retrievable: bool


@dataclass
class StepIndex:
    """Where one decode step writes and reads, as device tensors: what a captured CUDA graph of the
    step reads and then advances itself, so replaying it needs no host work per token.

    `index` (3,) int64 holds the full-cache slot the new token's K/V go to, its row in the packed buffer
    (when one is active) and its RoPE position: `slot`, `row`, `pos`, (1,) views. `lengths` (B,) int32 is
    the keys the step attends over (slot + 1, or row + 1 over a packed buffer). `Decoder._begin` sets
    them before a run of steps; each step adds 1 to all of them inside its argmax launch (ops.argmax_step),
    which is why the three live in one tensor and the lengths move with them rather than being recomputed.
    `rope` (2, P, Dh): cos and sin of positions 0..P-1 in the activation dtype (text.rope_table, the values
    rope_cos_sin gives), which the step reads at `pos` instead of recomputing them (None: it computes them).
    """

    index: torch.Tensor
    lengths: torch.Tensor
    rope: torch.Tensor | None = None

    @property
    def slot(self) -> torch.Tensor:
        return self.index[0:1]

    @property
    def row(self) -> torch.Tensor:
        return self.index[1:2]

    @property
    def pos(self) -> torch.Tensor:
        return self.index[2:3]

    def set(self, slot: int, row: int, pos: int, length: int) -> None:
        for t, value in ((self.slot, slot), (self.row, row), (self.pos, pos), (self.lengths, length)):
            t.fill_(value)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.index, self.lengths


@dataclass
class RowsIndex:
    """Where the rows of a padded follow-up prefill write and read, as device tensors, so a captured CUDA graph
    of it replays at any cache length (generate.Decoder's follow-up graphs). `start` (1,) int64 is the slot of
    row 0; `slots` (T,) int64 = start + 0..T-1, where the rows' K/V go; `keys` (1,) int32 = start + T, the keys
    the last row sees (row t sees slots 0..start + t); `cu_rows` = [0, T] and `cu_keys` = [0, max_seq_len], (2,)
    int32, the rows' and the cache's offsets as a varlen attention call takes them (ops.attention_rows)."""

    start: torch.Tensor
    slots: torch.Tensor
    keys: torch.Tensor
    cu_rows: torch.Tensor
    cu_keys: torch.Tensor


class KVCache:
    """Preallocated keys and values and the spans recorded over them.

    Every write target is bounds-checked before anything is written (`check`), so running past the declared
    context is an error, never a silent overwrite.
    """

    def __init__(self, cfg: TextConfig, batch: int = 1, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu"):
        self.max_seq_len = cfg.max_seq_len if max_seq_len is None else max_seq_len
        self.batch, self.dtype, self.n_layers = batch, dtype, cfg.n_layers
        self.n_kv_heads, self.head_dim = cfg.n_kv_heads, cfg.head_dim
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, self.max_seq_len, cfg.head_dim)
        self.k_stack = torch.zeros(shape, dtype=dtype, device=device)
        self.v_stack = torch.zeros(shape, dtype=dtype, device=device)
        # Per-layer views by indexing, not unbind(): unbind's multi-output views refuse in-place writes when
        # the model runs with autograd on (a forward outside inference_mode). Never rebind them: write in place.
        self.k = [self.k_stack[i] for i in range(cfg.n_layers)]
        self.v = [self.v_stack[i] for i in range(cfg.n_layers)]
        self.spans: list[Span] = []
        self._step: StepIndex | None = None    # device indices of decode steps (step_index())
        self._slots: tuple | None = None       # ((start, T), slot tensor) of the current prefill (slots())

    @property
    def device(self) -> torch.device:
        return self.k_stack.device

    # -- storage -------------------------------------------------------------------------------
    def check(self, start: int, T: int) -> None:
        """Raise ContextLimitError (a ValueError) unless slots start..start+T-1 exist."""
        if start < 0 or T < 1:
            raise ValueError(f"bad cache write: start {start}, {T} tokens")
        if start + T > self.max_seq_len:
            raise ContextLimitError(
                f"KV cache overflow: writing {T} tokens at {start} needs {start + T} slots, "
                f"max_seq_len is {self.max_seq_len}; declare a larger max_seq_len")

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, Dh) at slots start..start+T-1 of `layer` -> the views of slots
        0..start+T-1, (B, Hkv, start+T, Dh)."""
        end = start + k.shape[2]
        self.check(start, k.shape[2])
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.view(layer, end)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values of slots 0..end-1, (B, Hkv, end, Dh) each."""
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def slots(self, start: int, T: int) -> torch.Tensor:
        """Slots start..start+T-1 as a (T,) int64 device tensor, made once per prefill (not once per layer: a
        short prefill is bound by host launches) and reused while (start, T) stays the same."""
        if self._slots is None or self._slots[0] != (start, T):
            self._slots = ((start, T), torch.arange(start, start + T, device=self.device))
        return self._slots[1]

    def use_slots(self, start: int, slots: torch.Tensor) -> None:
        """Make `slots(start, T)` return `slots` (T,) = start..start+T-1, a buffer the caller keeps: a
        CUDA-graph prefill bakes the slot tensor's address in, so it must outlive the capture."""
        self._slots = ((start, slots.numel()), slots)

    # -- spans ---------------------------------------------------------------------------------
    def add_span(self, kind: str, start: int, end: int, retrievable: bool | None = None) -> Span:
        """Record slots [start, end) as `kind`; retrievable defaults to kind == "visual"."""
        if kind not in KINDS:
            raise ValueError(f"span kind {kind!r} is not one of {', '.join(KINDS)}")
        if not 0 <= start < end <= self.max_seq_len:
            raise ValueError(f"bad span [{start}, {end}) for a cache of {self.max_seq_len} slots")
        span = Span(kind, start, end, kind == "visual" if retrievable is None else retrievable)
        self.spans.append(span)
        return span

    def truncate(self, length: int) -> None:
        """Forget spans past `length` (cutting the one that straddles it)."""
        self.spans = [s for s in self.spans if s.start < length]
        if self.spans and self.spans[-1].end > length:
            self.spans[-1].end = length

    def retrievable_runs(self, end: int | None = None) -> list[tuple[int, int]]:
        """(start, stop) of the retrievable spans' slots (before `end`: None = all), in span order."""
        return [(s.start, s.end if end is None else min(s.end, end)) for s in self.spans
                if s.retrievable and (end is None or s.start < end)]

    def retrievable_slots(self, end: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """(N,) int32 slots of the retrievable spans (before `end`), in order, on `device` (default: the
        cache's)."""
        return self.slots_of(self.retrievable_runs(end), self.device if device is None else device)

    @staticmethod
    def slots_of(runs: list[tuple[int, int]], device: torch.device | str) -> torch.Tensor:
        """The slots of `runs` in order, (N,) int32 on `device`."""
        # A few tensor ops whatever the span count (a 256-frame video has 256 visual spans; one arange per span
        # was a Python loop of 256 small ops on every question).
        idx = torch.zeros(0, dtype=torch.long)
        if runs:
            starts, stops = torch.tensor(runs, dtype=torch.long).unbind(1)
            lens = stops - starts
            # slot of output i = its run's start + (i - the run's first output index)
            idx = torch.arange(int(lens.sum())) + torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens)
        return idx.to(device, torch.int32)

    @staticmethod
    def one_run(runs: list[tuple[int, int]]) -> range | None:
        """range(first, last + 1) when the slots of `runs` (non-empty (start, stop) pairs, in order) are one run
        of consecutive slots, i.e. each pair starts where the one before it stops; else None. From the pairs
        alone: no tensor op."""
        if not runs:
            return None
        first, stop = runs[0]
        for start, end in runs[1:]:
            if start != stop:
                return None
            stop = end
        return range(first, stop)

    # -- decode steps (graph-capturable) --------------------------------------------------------
    def step_index(self) -> StepIndex:
        """The cache's one StepIndex (made on first use, then reused: a captured graph holds it)."""
        if self._step is None:
            self._step = StepIndex(torch.zeros(3, dtype=torch.long, device=self.device),
                                   torch.zeros(self.batch, dtype=torch.int32, device=self.device))
        return self._step


def turn_spans(ids: list[int], start: int, per_image: int, doc: tuple[int, int] | None = None,
               first: bool = False, image_token: int = -200) -> list[tuple[str, int, int]]:
    """(kind, start slot, end slot) of a prefill of `ids` at slot `start`, where each image sentinel
    expands to `per_image` slots: "visual" per image, "text" for the id range `doc` (a document the
    caller marks retrievable), "system" before the first of those in a first turn, "question" else."""
    spans, slot, open_at, kind = [], start, start, "system" if first else "question"

    def close(end, next_kind):
        nonlocal open_at, kind
        if end > open_at:
            spans.append((kind, open_at, end))
        open_at, kind = end, next_kind

    for i, t in enumerate(ids):
        if doc is not None and i == doc[0]:
            close(slot, "text")
        if doc is not None and i == doc[1]:
            close(slot, "question")
        if t == image_token:
            close(slot, "visual")
            slot += per_image
            close(slot, "question")
        else:
            slot += 1
    close(slot, "question")
    return spans


def changed_range(with_doc: list[int], without_doc: list[int]) -> tuple[int, int]:
    """Id range [a, b) of `with_doc` that differs from `without_doc` (a document's tokens, found by
    common prefix and suffix so BPE merges at its edges cannot misplace it)."""
    a = 0
    while a < min(len(with_doc), len(without_doc)) and with_doc[a] == without_doc[a]:
        a += 1
    s = 0
    while s < min(len(with_doc), len(without_doc)) - a and with_doc[-1 - s] == without_doc[-1 - s]:
        s += 1
    return a, len(with_doc) - s
