"""SparseVILA's decode sparsity (query-aware retrieval) and its permanent-pruning peer FastV.

While a question is prefilled with `Retrieval.begin_scoring` on, the model's attention (text.Attention) also
returns each row's log-sum-exp and hands it to `Retrieval.score`, which runs the retrieval-salience kernel over
the retrievable cached slots (visual spans, and documents marked retrievable). `pack` then keeps the top
`decode_keep` of them per layer and KV head (`decode_select`) and gathers [non-retrievable | selected | rest]
into one contiguous buffer per layer, which the turn's decode steps attend over (new K/V go to both it and the
full cache). `unpack` ends the turn; the full cache keeps every token, so the next question retrieves its own
subset. `FastV` prunes once and for all: layer K-1's attention of the last prompt row hides the unchosen
retrievable slots from layers >= K for the rest of the conversation. docs/sparsity.md has the method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .kv_cache import KVCache
from .options import DEFAULT, Options
from .sparsity import keep_count

DECODE_METHODS = ("sparsevila", "fastv")
FASTV_LAYER = 2  # FastV's K: layers >= K lose the pruned tokens, chosen by layer K-1's attention
PACKED_ROOM = 256  # decode rows a packed buffer holds past its packed rows (rounded up); it grows when full


def decode_select(scores: torch.Tensor, n_keep: int, slots: torch.Tensor, window: int = 0,
                  windowed: torch.Tensor | None = None) -> torch.Tensor:
    """Top n_keep retrievable tokens per KV head: scores (..., N), e.g. (n_layers, B, Hkv, N), over
    cache slots `slots` (N,) -> (..., n_keep) indices into `slots`.

    A token of a `windowed` span (N,) bool also takes the best score of the `window` tokens right
    before it in the same span (adjacent slots), so a selected token brings the ones after it: on
    text, the heads that copy an answer attend at decode time to the tokens that FOLLOW what the
    question matched, which the question itself never attends to (docs/sparsity.md)."""
    if window > 0 and windowed is not None and bool(windowed.any()):
        base, best = scores, scores.clone()
        slots = slots.long()
        for d in range(1, min(window, scores.shape[-1] - 1) + 1):
            ok = (slots[d:] - slots[:-d] == d) & windowed[d:] & windowed[:-d]  # (N-d,) same span
            # A slightly smaller inherited score: the tokens nearest the anchor win ties at the budget.
            prev = torch.where(ok, base[..., :-d] * (1.0 - 1e-6 * d), float("-inf"))
            best[..., d:] = torch.maximum(best[..., d:], prev)
        scores = best
    return scores.topk(n_keep, dim=-1).indices


def fastv_keep_mask(scores: torch.Tensor, idx: torch.Tensor, max_len: int, keep: float,
                    layer: int = FASTV_LAYER) -> tuple[int, torch.Tensor]:
    """FastV (pkunlp-icler/FastV): the last prompt token's attention at layer K-1, summed over heads,
    keeps the top `keep` of the retrievable slots `idx` (N,); every other slot stays. scores: per
    layer (1, Hkv, N) retrieval salience of the last row. Returns (K, (max_len,) bool keep mask):
    permanent, for every later token of the conversation."""
    s = scores[layer - 1].sum(1)[0]  # (N,)
    chosen = idx[s.topk(keep_count(idx.numel(), keep)).indices].long()
    mask = torch.ones(max_len, dtype=torch.bool, device=idx.device)
    mask[idx.long()] = False
    mask[chosen] = True
    return layer, mask


def packed_slots(rows: int, room: int) -> int:
    """Slots of a packed decode buffer for `rows` rows and `room` more: their sum rounded up to a power of two.
    A few sizes serve a whole conversation (one captured decode graph each), and the decoding attention picks
    its tiles and split count from the buffer's length, so the buffer is sized to the turn, never to the whole
    context (a 40K-slot buffer for a 2K-row turn ran the long-buffer tiles: docs/perf_notes.md)."""
    return 1 << (rows + max(room, 1) - 1).bit_length()


@dataclass
class Scoring:
    """One question's retrieval scoring, accumulated layer by layer during its prefill."""

    idx: torch.Tensor              # (N,) int32 retrievable slots, all before `q_from`
    q_from: int                    # first slot of the question rows
    scores: torch.Tensor           # (n_layers, B, Hkv, N) fp32 salience, accumulated over chunks
    windowed: torch.Tensor | None  # (N,) bool: slot lies in a text span (decode_select's window); None: none do
    host_idx: torch.Tensor         # (N,) the same slots on the CPU: pack() builds the rest without a sync
    scored: list                   # per layer: bool, its rows were scored at least once
    pad: torch.Tensor | None = None  # (Tp - q_from,) bool during a padded first-turn prefill: padding rows
    span: range | None = None      # the slots of `idx` when they are one run: the kernel reads them as one block

    @property
    def kernel_idx(self) -> torch.Tensor | range:
        """What the retrieval kernel scores: the span when there is one, else the slot tensor."""
        return self.idx if self.span is None else self.span

    @classmethod
    def of(cls, cache: KVCache, q_from: int) -> Scoring | None:
        """Scoring of the retrievable slots before `q_from` (None when there are none). One run of slots (one
        image, one document, adjacent images) is scored as a range: the kernel reads those keys as one block,
        with the same sums in the same order as through the slot tensor."""
        runs = cache.retrievable_runs(q_from)
        N = sum(stop - start for start, stop in runs)
        if not N:
            return None
        dev = cache.device
        span = KVCache.one_run(runs)
        if span is not None:  # the slots made on each side, no copy between
            host_idx = torch.arange(span.start, span.stop, dtype=torch.int32)
            idx = torch.arange(span.start, span.stop, dtype=torch.int32, device=dev)
        else:
            host_idx = KVCache.slots_of(runs, "cpu")
            idx = host_idx.to(dev)
        windowed = None
        text = [s for s in cache.spans if s.retrievable and s.kind == "text"]
        if text:
            mask = torch.zeros(cache.max_seq_len, dtype=torch.bool)
            for s in text:
                mask[s.start:s.end] = True
            in_text = mask[host_idx.long()]  # (N,)
            windowed = in_text.to(dev) if in_text.any() else None
        # All layers' scores in one tensor: each layer's kernel accumulates into its slice, and pack() selects
        # for every layer at once.
        scores = torch.zeros(cache.n_layers, cache.batch, cache.n_kv_heads, N, dtype=torch.float32, device=dev)
        return cls(idx, q_from, scores, windowed, host_idx, [False] * cache.n_layers, span=span)

    def add(self, layer: int, start: int, q: torch.Tensor, k_all: torch.Tensor, lse: torch.Tensor, *,
            opts: Options = DEFAULT) -> bool:
        """Score this layer's question rows among q (B, H, T, D) at slots start.. with their lse (B, H, T)
        against the cached keys k_all. Returns whether any question row was in this chunk."""
        r0 = max(0, self.q_from - start)  # first question row in this chunk
        if r0 >= q.shape[2]:
            return False
        if r0:  # (a view per call costs host time: an eager prefill scores every layer)
            q, lse = q[:, :, r0:], lse[:, :, r0:]
        if self.pad is not None:  # padding rows take lse = +inf, so each adds exp(s - inf) = 0 exactly
            lse = lse.masked_fill(self.pad, float("inf"))
        ops.retrieval_salience(q, k_all, self.kernel_idx, lse, out=self.scores[layer], opts=opts)
        self.scored[layer] = True
        return True


@dataclass
class Packed:
    """A turn's packed decode buffers: (n_layers, B, Hkv, capacity, Dh) per K and V, one pack launch for all."""

    k_stack: torch.Tensor
    v_stack: torch.Tensor
    generation: int                # which allocation this is: a decode graph captured over it is keyed by it
    rows: int = 0                  # rows packed at the turn's start (decode steps append after them)
    dropped: int = 0               # full-cache slots left out; packed row = slot - dropped
    kept: int = 0                  # retrievable slots kept per layer and KV head
    idx: torch.Tensor | None = None  # (n_layers, B, Hkv, rows) int32: the full-cache slots packed

    @property
    def capacity(self) -> int:
        return self.k_stack.shape[3]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's packed K and V, (B, Hkv, capacity, Dh) each."""
        return self.k_stack[i], self.v_stack[i]


class Retrieval:
    """SparseVILA decode retrieval over one conversation's cache: a question's scoring, then its packed buffer.

    `scoring` is set between `begin_scoring` and `pack`; `packed` between `pack` and `unpack`. The packed
    buffers are kept across turns and reused when large enough. `room` is how many decode rows a buffer holds
    past its packed rows (rounded up to a power of two); a turn that decodes past it grows the buffer
    (`ensure_room`, a re-pack from the full cache, which holds every token)."""

    def __init__(self, cache: KVCache, room: int = PACKED_ROOM, options: Options = DEFAULT):
        self.cache, self.room, self.options = cache, room, options
        self.scoring: Scoring | None = None
        self.packed: Packed | None = None
        self._storage: Packed | None = None
        self._generation = 0

    # -- scoring (during the question's prefill) -------------------------------------------------
    def begin_scoring(self, q_from: int) -> int:
        """Score the retrievable slots before `q_from` by the attention of the rows from `q_from` on, in the
        next prefill calls. Returns the number of retrievable slots (0: nothing to score)."""
        self.scoring = Scoring.of(self.cache, q_from)
        return 0 if self.scoring is None else self.scoring.idx.numel()

    def graph_key(self, start: int = 0) -> tuple[int, int, int]:
        """What a padded prefill graph at slot `start` bakes in of the scoring: (first question row q_from -
        start, N, first slot of the span or -1 when scored through the slot tensor); (0, 0, -1) without."""
        sc = self.scoring
        if sc is None:
            return 0, 0, -1
        return sc.q_from - start, sc.idx.numel(), -1 if sc.span is None else sc.span.start

    def use_buffers(self, idx: torch.Tensor, scores: torch.Tensor) -> None:
        """Score the current question into buffers the caller keeps, idx (N,) int32 (filled here with the
        retrievable slots) and scores (n_layers, B, Hkv, N) fp32 (zeroed by `pad_rows` inside the pass): a
        CUDA-graph prefill bakes their addresses in. A span is baked in too (the kernel's key view starts at
        its first slot), hence `graph_key`."""
        sc = self.scoring
        if idx is not sc.idx:
            idx.copy_(sc.idx)
        sc.idx, sc.scores = idx, scores

    def pad_rows(self, rows: torch.Tensor, last: torch.Tensor, later: bool = False) -> None:
        """The prefill about to run (rows (Tp,) = 0..Tp-1) is padded past row `last` ((1,) int64 on the device:
        it may change from replay to replay): its rows after `last` score nothing, and the scores restart from
        zero. A first turn's question starts at row q_from; a `later` turn's at row 0 (Decoder only pads those
        whose rows are all question rows), so nothing here depends on the cache length. Device ops only, so a
        CUDA graph captures it."""
        sc = self.scoring
        if sc is not None:
            sc.scores.zero_()
            sc.pad = rows[0 if later else sc.q_from:] > last  # (Tp - first question row,)

    def end_padded(self) -> None:
        """After a padded prefill whose question rows were all real: every layer has scored them (a graph
        replay runs no host bookkeeping); the padding mask goes."""
        if self.scoring is not None:
            self.scoring.pad = None
            self.scoring.scored = [True] * self.cache.n_layers

    # -- the packed decode buffer ----------------------------------------------------------------
    def pack(self, keep: float, length: int, window: int = 0) -> int:
        """End scoring; keep the top `keep` of the scored slots per layer and KV head (at least one;
        `decode_select`, with `window` over text spans) and gather [non-retrievable | selected | rest] of slots
        0..length-1 into the packed buffers. Returns the number of packed rows per head.

        Every layer at once: one selection over the stacked scores, one sort, one pack launch for all layers'
        K and V, and no device-to-host sync (the non-retrievable slots come from the host's spans)."""
        sc, self.scoring = self.scoring, None
        if sc is None or not all(sc.scored):
            raise RuntimeError("pack() needs a scored question: call begin_scoring() before its prefill")
        c = self.cache
        N = sc.idx.numel()
        n_keep = min(N, max(1, round(keep * N)))
        if sc.span is not None:  # the slots around one run
            others = torch.cat([torch.arange(sc.span.start), torch.arange(sc.span.stop, length)])
        else:
            rest = torch.ones(length, dtype=torch.bool)
            rest[sc.host_idx.long()] = False
            others = rest.nonzero()[:, 0]
        others = others.to(c.device, torch.int32, non_blocking=True)  # (length - N,)
        rows = length - N + n_keep
        cap = min(rows + c.max_seq_len - length, packed_slots(rows, self.room))
        p = self._buffers(cap)
        top = decode_select(sc.scores, n_keep, sc.idx, window, sc.windowed)  # (L, B, Hkv, n_keep)
        L, B, Hkv = c.n_layers, c.batch, c.n_kv_heads
        idx = torch.cat([others.expand(L, B, Hkv, -1), sc.idx[top]], dim=-1).sort(dim=-1).values  # original order
        ops.kv_pack((c.k_stack, c.v_stack), idx, (p.k_stack, p.v_stack), opts=self.options)
        p.idx, p.rows, p.dropped, p.kept = idx, rows, length - rows, n_keep
        self.packed = p
        return rows

    def ensure_room(self, length: int, n_new: int) -> None:
        """Before decode steps that take the cache from `length` to length + n_new: grow the active packed
        buffer when they would not fit, re-packing from the full cache (the packed rows, then every token the
        turn has appended since, which the full cache holds too)."""
        p = self.packed
        if p is None or length - p.dropped + n_new <= p.capacity:
            return
        c = self.cache
        turn_start = p.rows + p.dropped
        cap = min(p.rows + c.max_seq_len - turn_start, packed_slots(length - p.dropped + n_new, 0))
        L, B, Hkv = c.n_layers, c.batch, c.n_kv_heads
        appended = torch.arange(turn_start, length, dtype=torch.int32, device=c.device).expand(L, B, Hkv, -1)
        idx = torch.cat([p.idx, appended], dim=-1)
        old = p
        self._storage = None  # a new, larger allocation
        p = self._buffers(cap)
        ops.kv_pack((c.k_stack, c.v_stack), idx, (p.k_stack, p.v_stack), opts=self.options)
        p.idx, p.rows, p.dropped, p.kept = old.idx, old.rows, old.dropped, old.kept
        self.packed = p

    def _buffers(self, cap: int) -> Packed:
        """The packed buffers of an earlier turn when they hold `cap` rows, else new ones."""
        p = self._storage
        if p is None or p.capacity < cap:
            c = self.cache
            shape = (c.n_layers, c.batch, c.n_kv_heads, cap, c.head_dim)
            self._generation += 1
            with torch.inference_mode(False):  # kept across turns: a later pack() may run outside inference mode
                p = Packed(*(torch.empty(shape, dtype=c.dtype, device=c.device) for _ in range(2)), self._generation)
            self._storage = p
        return p

    def unpack(self) -> None:
        """Back to dense attention over the full cache (the buffers are kept for reuse)."""
        self.packed = None

    def reset(self) -> None:
        """Drop any scoring and packed buffer (the cache was truncated)."""
        self.scoring = None
        self.packed = None


class FastV:
    """FastV-style permanent pruning: within one prefill, layer K-1's attention of the last prompt row keeps the
    top `keep` of the retrievable slots before it; the rest are hidden from layers >= K from then on."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.scoring: Scoring | None = None  # set during the deciding prefill
        self.keep = 1.0
        self.key_mask: tuple[int, torch.Tensor] | None = None  # (first layer, (max_seq_len,) bool keep mask)

    def begin(self, last_row: int, keep: float) -> int:
        """Decide in the next prefill, from row `last_row` (the last prompt token). Returns the number of
        retrievable slots (0: nothing to prune)."""
        self.scoring, self.keep = Scoring.of(self.cache, last_row), keep
        return 0 if self.scoring is None else self.scoring.idx.numel()

    @property
    def deciding(self) -> bool:
        return self.scoring is not None

    def mask_for(self, layer: int, end: int) -> torch.Tensor | None:
        """The keep mask (end,) bool layer `layer` applies to slots 0..end-1, or None (all visible)."""
        if self.key_mask is None or layer < self.key_mask[0]:
            return None
        return self.key_mask[1][:end]

    def observe(self, layer: int, start: int, q: torch.Tensor, k_all: torch.Tensor, lse: torch.Tensor, *,
                opts: Options = DEFAULT) -> None:
        """Layer `layer`'s attention of the prefill rows (as Scoring.add); at layer K-1 the mask is decided,
        before layer K runs."""
        sc = self.scoring
        sc.add(layer, start, q, k_all, lse, opts=opts)
        if layer == FASTV_LAYER - 1:
            self.key_mask = fastv_keep_mask(sc.scores, sc.idx, self.cache.max_seq_len, self.keep)
            self.scoring = None

    def reset(self) -> None:
        self.scoring, self.key_mask = None, None
