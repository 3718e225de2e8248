"""The KV cache of one conversation: preallocated full cache, spans, retrieval scoring, packed decode.

`KVCache` holds per layer `k[i]`, `v[i]` (B, Hkv, max_seq_len, Dh), views of one (n_layers, ...)
tensor per K and V (`k_stack`, `v_stack`), keys rotated at their logical position when written.
The session records `Span`s (system, visual, text, question, answer) with a retrievable flag
(visual by default). For SparseVILA decode sparsity (DESIGN.md sec. 3): while a
question is prefilled with scoring on, every layer's attention also returns its log-sum-exp and the
retrieval-salience kernel scores the retrievable slots (read as one block of keys when they are one
run of consecutive slots, the usual single image or document); `pack` then keeps the top `decode_keep` of
them per layer and KV head (`sparsity.decode_select`; text spans select runs, docs/sparsity.md) and
gathers [non-retrievable | selected | rest] into one contiguous buffer per layer, which decode
steps attend over (new K/V go to both buffers). `unpack` ends the turn; the
full cache keeps every token, so the next question retrieves its own subset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .config import TextConfig
from .errors import ContextLimitError
from .sparsity import FASTV_LAYER, decode_select, fastv_keep_mask

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
    the keys the step attends over (slot + 1, or row + 1 over a packed buffer). `KVCache.begin_steps` sets
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
class _Scoring:
    idx: torch.Tensor              # (N,) int32 retrievable slots, all before `q_from`
    q_from: int                    # first slot of the question rows
    scores: torch.Tensor           # (n_layers, B, Hkv, N) fp32 salience, accumulated over chunks
    windowed: torch.Tensor | None  # (N,) bool: slot lies in a text span (decode_select's window);
                                   # None when no retrievable text span exists
    host_idx: torch.Tensor         # (N,) the same slots on the CPU: pack() builds the rest without a sync
    scored: list                   # per layer: bool, its rows were scored at least once
    fastv: float | None = None     # FastV-style pruning: keep fraction, applied after layer K-1
    pad: torch.Tensor | None = None  # (Tp - q_from,) bool, during a padded first-turn prefill: rows
                                     # from q_from that are padding (they add nothing: `pad_rows`)
    span: range | None = None      # the slots of `idx` when they are one run start..stop-1: the kernel
                                   # then reads the keys as one block, loading no slot (`retrievable_span`)

    @property
    def kernel_idx(self) -> torch.Tensor | range:
        """What the retrieval kernel scores: the span when there is one, else the slot tensor."""
        return self.idx if self.span is None else self.span


@dataclass
class _Packed:
    k: list                        # per layer (B, Hkv, capacity, Dh): views of k_stack
    v: list
    rows: int                      # rows packed at the turn's start (decode steps append after them)
    dropped: int                   # full-cache slots left out; packed row = slot - dropped
    kept: int                      # retrievable slots kept per layer and KV head
    idx: torch.Tensor | None = None      # (n_layers, B, Hkv, rows) int32: the full-cache slots packed
    k_stack: torch.Tensor | None = None  # (n_layers, B, Hkv, capacity, Dh): one pack launch for all
    v_stack: torch.Tensor | None = None


def packed_slots(rows: int, room: int) -> int:
    """Slots of a packed decode buffer for `rows` packed rows and a turn that appends at most `room` tokens:
    their sum rounded up to a power of two (a few sizes serve a whole conversation, one captured decode graph
    each). KVCache.pack allocates this, capped by the cache's own room."""
    return 1 << (rows + max(room, 1) - 1).bit_length()


class KVCache:
    """Preallocated keys and values, spans, and the SparseVILA scoring/packing state.

    Every write is bounds-checked before anything is written, so running past the declared context
    is an error, never a silent overwrite.
    """

    def __init__(self, cfg: TextConfig, batch: int = 1, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu"):
        self.max_seq_len = cfg.max_seq_len if max_seq_len is None else max_seq_len
        self.batch, self.dtype, self.n_layers = batch, dtype, cfg.n_layers
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, self.max_seq_len, cfg.head_dim)
        # One tensor per K and V for all layers, so a question's packing is one launch; self.k[i],
        # self.v[i] (B, Hkv, max_seq_len, Dh) are views of it (never rebind them: write in place).
        self.k_stack = torch.zeros(shape, dtype=dtype, device=device)
        self.v_stack = torch.zeros(shape, dtype=dtype, device=device)
        # Per-layer views by indexing, not unbind(): unbind's multi-output views refuse in-place
        # writes when the model runs with autograd on (a forward outside inference_mode).
        self.k, self.v = [self.k_stack[i] for i in range(cfg.n_layers)], [self.v_stack[i] for i in range(cfg.n_layers)]
        self.spans: list[Span] = []
        self.scoring: _Scoring | None = None
        self.packed: _Packed | None = None    # active during a sparse turn's decode
        self._storage: _Packed | None = None  # the packed buffers, kept across turns for reuse
        # Permanent pruning baselines (FastV-style): (first layer, (max_seq_len,) bool keep mask).
        self.key_mask: tuple[int, torch.Tensor] | None = None
        self._step: StepIndex | None = None    # device indices of decode steps (step_index())
        self._slots: tuple | None = None       # ((start, T), slot tensor) of the current prefill (slots())

    # -- the full cache ------------------------------------------------------------------------
    def check(self, start: int, T: int) -> None:
        """Raise ContextLimitError (a ValueError) unless slots start..start+T-1 exist."""
        if start < 0 or T < 1:
            raise ValueError(f"bad cache write: start {start}, {T} tokens")
        if start + T > self.max_seq_len:
            raise ContextLimitError(
                f"KV cache overflow: writing {T} tokens at {start} needs {start + T} slots, "
                f"max_seq_len is {self.max_seq_len}; declare a larger max_seq_len")

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, Dh) at slots start..start+T-1 of `layer`.

        Returns the views of slots 0..start+T-1, (B, Hkv, start+T, Dh), for attention.
        """
        end = start + k.shape[2]
        self.check(start, k.shape[2])
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def rope_write(self, layer: int, start: int | StepIndex, qkv: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, n_heads: int) -> torch.Tensor:
        """Rotate q and k of the fused projection qkv (B, T, (H + 2 Hkv) Dh) with cos, sin (T, Dh)
        and store k, v at slots start..start+T-1 (a decode step's `StepIndex`: its slot, and its row of
        the packed buffer when one is active); returns the rotated q (B, H, T, Dh). Keys are cached
        rotated at their logical position, so packing never re-rotates. One fused kernel on CUDA."""
        k, v, slots, second = self.write_targets(layer, start, qkv.shape[1])
        return ops.rope_qkv(qkv, cos, sin, k, v, slots, n_heads, k.shape[1], second=second)

    def write_targets(self, layer: int, start: int | StepIndex, T: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """Where rope_write stores T new rows of `layer`: (k, v, slots, second), the arguments of ops.rope_qkv
        (and of ops.w4a16_linear_rope, which does the same inside the qkv GEMV): the layer's caches, the slots
        (T,) on the device, and (packed k, packed v, rows) while a packed decode buffer is active."""
        if isinstance(start, StepIndex):
            p = self.packed
            second = None if p is None else (p.k[layer], p.v[layer], start.row)
            return self.k[layer], self.v[layer], start.slot, second
        if self.packed is not None:
            raise RuntimeError("a packed decode buffer is active: decode steps go through a StepIndex; "
                               "unpack() before a prefill")
        self.check(start, T)
        return self.k[layer], self.v[layer], self.slots(start, T), None

    def slots(self, start: int, T: int) -> torch.Tensor:
        """Slots start..start+T-1 as a (T,) int64 device tensor, made once per prefill (not once per
        layer: a short prefill is bound by host launches) and reused while (start, T) stays the same."""
        if self._slots is None or self._slots[0] != (start, T):
            self._slots = ((start, T), torch.arange(start, start + T, device=self.k[0].device))
        return self._slots[1]

    def use_slots(self, start: int, slots: torch.Tensor) -> None:
        """Make `slots(start, T)` return `slots` (T,) = start..start+T-1, a buffer the caller keeps:
        a CUDA-graph prefill bakes the slot tensor's address in, so it must outlive the capture."""
        self._slots = ((start, slots.numel()), slots)

    def attend(self, layer: int, start: int | StepIndex, q: torch.Tensor) -> torch.Tensor:
        """Attend q (B, H, T, Dh) of the rows at slots start.. (already written by `rope_write`) over
        the cache -> (B, H, T, Dh).

        Dense causal attention over the full cache, unless a question is being scored (attention
        with LSE plus retrieval salience) or a decode step runs over a packed buffer.
        """
        if isinstance(start, StepIndex):
            return self._attend_step(layer, start, q)
        end = start + q.shape[2]
        k_all, v_all = self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        if self.key_mask is not None and layer >= self.key_mask[0]:
            return ops.attention_key_masked(q, k_all, v_all, start, self.key_mask[1][:end])
        if self.scoring is not None:
            o, lse = ops.attention_lse(q, k_all, v_all, start)
            self._score(layer, start, q, k_all, lse)
            return o
        return ops.attention(q, k_all, v_all, causal=True, q_start=start)

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
        """Forget spans past `length` (cutting the one that straddles it); drops any packed buffer."""
        self.spans = [s for s in self.spans if s.start < length]
        if self.spans and self.spans[-1].end > length:
            self.spans[-1].end = length
        self.scoring = None
        self.unpack()

    def _retrievable_runs(self, end: int | None = None) -> list[tuple[int, int]]:
        """(start, stop) of the retrievable spans' slots (before `end`: None = all), in span order."""
        return [(s.start, s.end if end is None else min(s.end, end)) for s in self.spans
                if s.retrievable and (end is None or s.start < end)]

    def retrievable_slots(self, end: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """(N,) int32 slots of the retrievable spans (before `end`), in order, on `device` (default:
        the cache's)."""
        return self._slots_of(self._retrievable_runs(end), self.k[0].device if device is None else device)

    @staticmethod
    def _slots_of(runs: list[tuple[int, int]], device: torch.device | str) -> torch.Tensor:
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
    def retrievable_span(runs: list[tuple[int, int]]) -> range | None:
        """range(first, last + 1) when the slots of `runs` (non-empty (start, stop) pairs, in scoring order) are one
        run of consecutive slots, i.e. each pair starts where the one before it stops; else None. The common case
        (one image's visual tokens or one document, or adjacent images): the retrieval kernel then reads the keys
        as one contiguous block instead of gathering them through a slot tensor (13% faster at a 64-token question
        over 32K keys, H200 S7-C), with the same sums in the same order. From the pairs alone: no tensor op."""
        if not runs:
            return None
        first, stop = runs[0]
        for start, end in runs[1:]:
            if start != stop:
                return None
            stop = end
        return range(first, stop)

    # -- retrieval scoring (during the question's prefill) --------------------------------------
    def begin_scoring(self, q_from: int) -> int:
        """Score the retrievable slots before `q_from` by the attention of the rows from `q_from` on,
        in the next prefill calls. Returns the number of retrievable slots (0: nothing to score).
        When they are one run of slots, the kernel takes that range (`retrievable_span`), else the slots."""
        runs = self._retrievable_runs(q_from)
        N = sum(stop - start for start, stop in runs)
        if not N:
            self.scoring = None
            return 0
        dev = self.k[0].device
        span = self.retrievable_span(runs)
        if span is not None:  # one run (one image, one document): the slots made on each side, no copy between
            host_idx = torch.arange(span.start, span.stop, dtype=torch.int32)
            idx = torch.arange(span.start, span.stop, dtype=torch.int32, device=dev)
        else:
            host_idx = self._slots_of(runs, "cpu")
            idx = host_idx.to(dev)
        windowed = None  # decode_select's window: slots of retrievable text spans (None when there are none)
        if any(s.retrievable and s.kind == "text" for s in self.spans):
            text = torch.zeros(self.max_seq_len, dtype=torch.bool)
            for s in self.spans:
                if s.retrievable and s.kind == "text":
                    text[s.start:s.end] = True
            in_text = text[host_idx.long()]  # (N,)
            windowed = in_text.to(dev) if in_text.any() else None
        # All layers' scores in one tensor: each layer's kernel accumulates into its slice, and
        # pack() selects for every layer at once.
        scores = torch.zeros(self.n_layers, self.batch, self.k[0].shape[1], N, dtype=torch.float32, device=dev)
        self.scoring = _Scoring(idx, q_from, scores, windowed, host_idx, [False] * self.n_layers, span=span)
        return N

    def begin_fastv(self, last_row: int, keep: float) -> int:
        """FastV-style permanent pruning within the next prefill (one pass): layer K-1's attention of
        row `last_row` (the last prompt token) keeps the top `keep` of the retrievable slots before
        it, hidden from layers >= K for the rest of the conversation (`key_mask`)."""
        n = self.begin_scoring(last_row)
        if n:
            self.scoring.fastv = keep
        return n

    def _score(self, layer: int, start: int, q: torch.Tensor, k_all: torch.Tensor, lse: torch.Tensor) -> None:
        sc = self.scoring
        r0 = max(0, sc.q_from - start)  # first question row in this chunk
        if r0 >= q.shape[2]:
            return
        if r0:  # (a view per call costs host time: an eager prefill scores every layer)
            q, lse = q[:, :, r0:], lse[:, :, r0:]
        if sc.pad is not None:  # padding rows take lse = +inf, so each adds exp(s - inf) = 0 exactly
            lse = lse.masked_fill(sc.pad, float("inf"))
        ops.retrieval_salience(q, k_all, sc.kernel_idx, lse, out=sc.scores[layer])
        sc.scored[layer] = True
        if sc.fastv is not None and layer == FASTV_LAYER - 1:  # decided before layer K runs
            self.key_mask = fastv_keep_mask(sc.scores, sc.idx, self.max_seq_len, sc.fastv)
            self.scoring = None

    # -- scoring in a padded first-turn prefill (a CUDA graph; Decoder._prefill_padded) ---------
    def use_scoring_buffers(self, idx: torch.Tensor, scores: torch.Tensor) -> None:
        """Score the current question into buffers the caller keeps, idx (N,) int32 (filled here with
        the retrievable slots) and scores (n_layers, B, Hkv, N) fp32 (zeroed by `pad_rows` inside the
        pass), instead of begin_scoring's own: a CUDA-graph prefill bakes their addresses in. A scoring
        with a `span` reads no idx but bakes the span itself in (the kernel's key view starts at its
        first slot), so a graph captured with one span must not be replayed for another (Decoder keys
        its prefill graphs by the span)."""
        sc = self.scoring
        if idx is not sc.idx:
            idx.copy_(sc.idx)
        sc.idx, sc.scores = idx, scores

    def pad_rows(self, slots: torch.Tensor, last: torch.Tensor) -> None:
        """The prefill about to run (slots (Tp,) = 0..Tp-1, from an empty cache) is padded past row
        `last` ((1,) int64, a device tensor: the padding may change from replay to replay): with
        scoring on, its rows after `last` score nothing, and the scores restart from zero (nothing is
        scored before a first turn's prefill). Device ops only, so a CUDA graph captures it."""
        sc = self.scoring
        if sc is not None:
            sc.scores.zero_()
            sc.pad = slots[sc.q_from:] > last  # (Tp - q_from,)

    def end_padded(self) -> None:
        """After a padded prefill whose question rows (from q_from) were all real: every layer has
        scored them (a graph replay does not run `_score`'s host bookkeeping); the padding mask goes."""
        if self.scoring is not None:
            self.scoring.pad = None
            self.scoring.scored = [True] * self.n_layers

    # -- packed decode buffer ------------------------------------------------------------------
    def pack(self, keep: float, length: int, window: int = 0, room: int | None = None) -> int:
        """End scoring; keep the top `keep` of the scored slots per layer and KV head (at least one;
        `sparsity.decode_select`, with `window` over text spans), gather [non-retrievable | selected |
        rest] of slots 0..length-1 into the packed buffers. Returns the number of packed rows per head.

        `room`: at most how many tokens this turn's decode steps append (the answer's token budget; None:
        every slot the cache has left). The buffers hold `packed_slots(rows, room)`, never past the cache's own
        room: the decoding attention picks its tiles and split count from the buffer's length, and a buffer
        sized for the whole context (~40K slots for a 2K-row turn of a long video) ran it with the long-buffer
        tiles (docs/benchmarks.md, S11-I).

        Every layer at once: one selection over the stacked scores, one sort, one pack launch for all
        layers' K and V (a handful of launches per question, not a handful per layer), and no
        device-to-host sync (the non-retrievable slots come from the host's spans)."""
        sc, self.scoring = self.scoring, None
        if sc is None or not all(sc.scored):
            raise RuntimeError("pack() needs a scored question: call begin_scoring() before its prefill")
        L, B, Hkv = self.n_layers, self.batch, self.k[0].shape[1]
        N = sc.idx.numel()
        n_keep = min(N, max(1, round(keep * N)))
        if sc.span is not None:  # the slots around one run
            others = torch.cat([torch.arange(sc.span.start), torch.arange(sc.span.stop, length)])
        else:
            rest = torch.ones(length, dtype=torch.bool)
            rest[sc.host_idx.long()] = False
            others = rest.nonzero()[:, 0]
        others = others.to(self.k[0].device, torch.int32, non_blocking=True)  # (length - N,)
        rows = length - N + n_keep
        cap = rows + self.max_seq_len - length  # room for every token this turn can still append
        if room is not None:
            cap = min(cap, packed_slots(rows, room))
        self._ensure_packed(cap, n_keep, length - rows)
        top = decode_select(sc.scores, n_keep, sc.idx, window, sc.windowed)  # (L, B, Hkv, n_keep)
        chosen = sc.idx[top]  # slots
        idx = torch.cat([others.expand(L, B, Hkv, -1), chosen], dim=-1).sort(dim=-1).values  # original order
        self.packed.idx = idx  # (L, B, Hkv, rows)
        ops.kv_pack((self.k_stack, self.v_stack), idx, (self.packed.k_stack, self.packed.v_stack))
        self.packed.rows = rows
        return rows

    def _ensure_packed(self, cap: int, kept: int, dropped: int) -> None:
        """Reuse the packed buffers of an earlier turn when they are large enough."""
        old = self._storage
        if old is None or old.k[0].shape[2] < cap:
            B, Hkv, _, D = self.k[0].shape
            shape, dev = (self.n_layers, B, Hkv, cap, D), self.k[0].device
            ks, vs = (torch.empty(shape, dtype=self.dtype, device=dev) for _ in range(2))
            old = _Packed([ks[i] for i in range(len(ks))], [vs[i] for i in range(len(vs))], 0, 0, 0,
                          k_stack=ks, v_stack=vs)
            self._storage = old
        old.dropped, old.kept = dropped, kept
        self.packed = old

    def unpack(self) -> None:
        """Back to dense attention over the full cache (the buffers are kept for reuse)."""
        self.packed = None

    # -- decode steps (graph-capturable) --------------------------------------------------------
    def step_index(self) -> StepIndex:
        """The cache's one StepIndex (made on first use, then reused: a captured graph holds it)."""
        if self._step is None:
            dev = self.k[0].device
            self._step = StepIndex(torch.zeros(3, dtype=torch.long, device=dev),
                                   torch.zeros(self.batch, dtype=torch.int32, device=dev))
        return self._step

    def begin_steps(self, slot: int, pos: int) -> StepIndex:
        """Before a run of decode steps (host values, eager): the first writes full-cache slot `slot`
        (and the matching packed row when a packed buffer is active) at RoPE position `pos`, and attends
        over the keys up to and including it; each step then advances the index itself."""
        p = self.packed
        row = slot - (p.dropped if p is not None else 0)
        st = self.step_index()
        st.set(slot, row, pos, (row if p is not None else slot) + 1)
        return st

    def _attend_step(self, layer: int, st: StepIndex, q: torch.Tensor) -> torch.Tensor:
        """One decode token q (B, H, 1, Dh), rotated at `st.pos`, over the first `st.lengths` keys of the
        packed buffer (when active) or the full cache (its K/V were stored by `rope_write`)."""
        if q.shape[2] != 1:
            raise RuntimeError(f"a decode step takes one token, got {q.shape[2]}")
        src = self.packed if self.packed is not None else self
        return ops.decode_attention(q[:, :, 0], src.k[layer], src.v[layer], st.lengths)[:, :, None]  # (B, H, 1, Dh)


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
