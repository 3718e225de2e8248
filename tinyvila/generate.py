"""Generation: a decoder that owns one conversation's KV cache, sampling, and the token iterator.

`Decoder` runs the LLM on a preallocated `KVCache`: `prefill` appends a block of input embeddings,
`step` appends one token, both returning the next-token logits; `truncate` evicts everything past a
length (used to drop a turn). `generate` turns logits into a token stream: greedy or
temperature/top-k/top-p sampling with a seed, stop ids, a token budget, and the context limit.
The loop follows gpt-fast/nanochat: prefill once, then one cached decode step per token.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import ops
from .cuda_graph import GraphLRU, capture
from .errors import ArgumentError, ContextLimitError
from .kv_cache import KVCache, RowsIndex, StepIndex
from .retrieval import PACKED_ROOM, FastV, Retrieval
from .text import rope_table

PREFILL_CHUNK = 4096  # prompt tokens per prefill pass: bounds activation memory for long videos
MAX_BATCH = 64        # greedy tokens per host synchronisation, at most
PREFILL_GRAPH_MAX = 2048  # longest padded first-turn prefill replayed from a CUDA graph (longer: eager)
FOLLOWUP_GRAPH_MAX = 256  # longest padded later-turn prefill replayed from one (a question, an answer resent)
# With Options.split_rows_attention off, later turns over more cached keys run eagerly: FlashAttention-2's varlen
# call (the graph's then) splits the keys over blocks only for one-row calls, its batch call (eager) always;
# unsplit, ~0.9 ms per 1K keys on vila-8b, H100.
FOLLOWUP_GRAPH_MAX_KEYS = 8192
MAX_GRAPHS = 16           # decode-step and prefill graphs a decoder keeps (least recently used dropped first)
_PRIME_REPLAYS = 8  # replays of the dropped first step graph of a process (Decoder._capture)
_STEP_CAPTURED: set[torch.device] = set()  # devices this process has captured a PDL decode step on (Decoder._capture)


def prefill_bucket(T: int) -> int:
    """The padded length a T-token graph prefill runs at: multiples of 16 up to 64, then four steps per
    octave (64, 80, 96, 112, 128, 160, 192, 224, 256, 320, ..., 448, 512, ..., 2048).

    Why: a prefill's cost grows with its rows (GEMM M), so padding is paid in GPU time, while every
    bucket is one more capture (an eager warm-up plus the capture itself, on first use) and one more
    graph. Quarter-octave steps cap the padding at 25% (12% on average; 447 -> 448 for one vila-8b image
    with a short question) with 24 buckets up to 2048; powers of two would waste up to 100%, multiples of
    128 would need 16 graphs. Buckets are multiples of 16, the tensor-core tile edge."""
    if T < 1:
        raise ValueError(f"a prefill needs at least one token, got {T}")
    if T <= 64:
        return -(-T // 16) * 16
    step = 1 << ((T - 1).bit_length() - 3)  # T in (2^j, 2^(j+1)] -> 2^j / 4
    return -(-T // step) * step


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters. A value out of range raises
    ArgumentError (a ValueError) naming the field."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int | None = None

    def __post_init__(self):
        def bad(name: str, rule: str) -> ArgumentError:
            return ArgumentError(name, f"SamplingParams.{name} must be {rule}, got {getattr(self, name)!r}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            raise bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "a whole number >= 0 (0 = off)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1] (1 = off)")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "a whole number >= 1")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "a whole number or None")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from next-token logits (V,)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class _PrefillInputs(NamedTuple):
    """Static inputs of the prefill graphs, each sized for the largest bucket: a graph of Tp rows reads
    the first Tp of them."""

    h: torch.Tensor      # (1, n, d) input embeddings, zero past the real rows
    pos: torch.Tensor    # (n,) int64 RoPE positions
    slots: torch.Tensor  # (n,) int64 0..n-1: the cache slots of a first turn, the rows of a later one (constant)
    last: torch.Tensor   # (1,) int64 the last real row, whose logits the graph returns
    start: torch.Tensor  # (1,) int64 the slot of row 0 (a later turn's: the cache length)


class Decoder:
    """Runs a `TextModel` over one conversation's KV cache. `length` = tokens in the cache;
    `position` = the logical RoPE position of the next token, ahead of `length` once a prefill was
    given explicit positions with gaps (pruned visual tokens that keep their original positions).

    Decode steps read their token, cache slot, RoPE position and packed-buffer row from device
    tensors (`KVCache.step_index`) and advance them themselves, so on CUDA one step is captured in a
    CUDA graph (per decode buffer and vocabulary limit) and replayed per token with no host work;
    greedy decoding also takes its argmax inside the graph and the host reads the new tokens once per
    batch (`greedy`). Besides the layers, the lm_head and the logits' fp32 cast, a step launches only
    the embedding gather, one gather of its cos/sin from a RoPE table built once (`_cover_rope`), and the
    argmax, whose final program also records the token and advances every counter (ops.argmax_step).
    `cuda_graph=False` (default: the model's Options.cuda_graph; an fp32 model never) runs the same step eagerly.
    The decoder owns the conversation's sparsity state beside its cache: `retrieval` (SparseVILA's scoring
    and packed decode buffer; `packed_room` decode rows past the packed ones before the buffer grows) and
    `fastv` (the permanent-pruning peer); the model's attention reads them (text.Attention).

    The first turn's prefill (empty cache: system + image + question in one pass) is host-bound too
    (~25 launches per layer), so with `cuda_graph` it replays a CUDA graph as well: the T rows padded at
    the END to `prefill_bucket(T)` rows (zero embeddings, positions continuing +1), one graph per bucket,
    captured on first use. With causal attention no real row sees a padding row, and the padding rows'
    K/V land in slots T.. that are past the cache length (nothing reads them; later tokens overwrite
    them). What this guarantees: the real rows' logits and K/V are those of the same forward run eagerly
    at the padded length (bit for bit on the GPU: same kernels, same shapes), and on CPU equal the
    unpadded prefill up to rounding. Against the unpadded eager prefill on the GPU they may differ in
    the last bits, because the GEMMs' M changes and cuBLAS / the W4 kernel may pick other tiles or
    split-K.

    SparseVILA's scored first turn (`Retrieval.begin_scoring`) replays a graph too, one per (bucket,
    `Retrieval.graph_key()`: first question row, retrievable count, span start). Its padding rows score
    nothing (their LSE is +inf, from the device index `last`) and the scores / retrievable slots live in
    buffers the graph keeps (`Retrieval.use_buffers`); `pack` then runs eagerly after it.

    A later turn (a follow-up question, with the last answer's final token and the template around it) is
    as host-bound, so it replays a graph too, padded the same way, up to FOLLOWUP_GRAPH_MAX rows: its rows
    sit at slots `start`.. where start (the cache length) is a device value (`RowsIndex`), their attention
    reads the cache up to start + row through a kernel that takes that count from the device and splits the
    keys (ops.attention_rows), so one graph per bucket serves every length of the conversation. Its padding rows
    write K/V past the real ones, where the next tokens overwrite them. SparseVILA scores such a turn inside
    the graph when every row is a question row (no new retrievable tokens in it). A decoder's first later
    turn of each graph key runs eagerly and the capture waits for the second (`_later_graph_due`).
    Other prefills (FastV, a first turn whose question rows are not all in this prefill, a later turn that
    brings retrievable tokens, a packed buffer, more padded rows than the limits or `prefill_chunk`, past
    the cache, or, with Options.split_rows_attention off, a later turn past FOLLOWUP_GRAPH_MAX_KEYS keys) run
    eagerly. `pad_prefill` (tests) runs the padded forward eagerly where no graph is used.
    """

    def __init__(self, text_model, max_seq_len: int | None = None, cuda_graph: bool | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, packed_room: int = PACKED_ROOM,
                 device_lock: threading.RLock | None = None):
        self.model = text_model
        # Held around each prefill and each run of decode steps: the decoders of one model share device buffers
        # (VLM.device_lock says which), so another thread's launches must not come between one call's kernels.
        self.device_lock = threading.RLock() if device_lock is None else device_lock
        w = text_model.embed.weight
        self.cache = KVCache(text_model.cfg, max_seq_len=max_seq_len, dtype=w.dtype, device=w.device)
        self.retrieval = Retrieval(self.cache, packed_room, text_model.options)
        self.fastv = FastV(self.cache)
        self.length = 0
        self.position = 0
        self._explicit: list[tuple[int, torch.Tensor]] = []  # (first slot, positions) of such prefills
        if cuda_graph is None:  # fp32/fp64 models decode through PyTorch references that sync the host
            cuda_graph = text_model.options.cuda_graph and w.is_cuda and w.dtype in (torch.float16, torch.bfloat16)
        self.cuda_graph, self.prefill_chunk = cuda_graph, prefill_chunk
        # The decode step's device state: input token, greedy outputs of a batch, and their count.
        self._token = torch.zeros(1, 1, dtype=torch.long, device=w.device)
        self._out = torch.zeros(MAX_BATCH, dtype=torch.long, device=w.device)
        self._count = torch.zeros(1, dtype=torch.long, device=w.device)
        # Captured graphs: ("step", vocabulary limit, packed buffer) -> (graph, logits) and ("prefill", padded
        # bucket, *Retrieval.graph_key()) -> (graph, logits, scoring buffers or None).
        self.graphs = GraphLRU(MAX_GRAPHS)
        self.pad_prefill = False
        self._pf: _PrefillInputs | None = None  # the prefill graphs' static inputs (made on first use)
        self._later_seen: set[tuple] = set()  # later-turn graph keys met once (`_later_graph_due`)

    @property
    def max_len(self) -> int:
        return self.cache.max_seq_len

    def check_room(self, n_new: int) -> None:
        """Raise ContextLimitError, changing nothing, if n_new more tokens would not fit."""
        if self.length + n_new > self.max_len:
            raise ContextLimitError(
                f"the conversation would need {self.length + n_new} tokens ({self.length} cached + "
                f"{n_new} new) but the model's context is {self.max_len}; shorten the prompt, "
                "start a new conversation (/clear), or load with a larger max_seq_len")

    @torch.inference_mode()
    def prefill(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Append (1, T, d) input embeddings; returns the logits (V,) after the last one.

        positions (T,) long, increasing: their RoPE positions (default: the next T logical ones);
        later tokens continue after the last of them. Runs in chunks of `prefill_chunk` tokens, so a
        long (video) prompt needs activation memory for one chunk, not for all of it. A first turn
        (empty cache), and a short later one, replay a CUDA graph at a padded length instead (see the
        class docstring)."""
        with self.device_lock:
            return self._prefill(h, positions)

    def _prefill(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        T = h.shape[1]
        self.check_room(T)
        explicit = positions is not None
        if not explicit and self.position != self.length:
            positions = torch.arange(self.position, self.position + T, device=h.device)
        bucket = self._prefill_bucket(T)
        if bucket is None:
            logits = self._prefill_eager(h, positions)
        else:
            logits = self._prefill_padded(h, positions, bucket)
        if explicit:
            self._explicit.append((self.length, positions.cpu()))
            self.position = int(self._explicit[-1][1][-1]) + 1
        else:
            self.position += T
        self.length += T
        return logits

    def _prefill_eager(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The prefill in chunks of `prefill_chunk` rows -> the last row's logits (V,)."""
        T = h.shape[1]
        for a in range(0, T, self.prefill_chunk):
            b = min(T, a + self.prefill_chunk)
            # Only pass positions when they differ from the slots, as models without the argument expect.
            extra = {} if positions is None else {"positions": positions[a:b]}
            logits = self.model(h[:, a:b], self.cache, self.length + a, last_only=True, retrieval=self.retrieval,
                                fastv=self.fastv, **extra)
        return logits[0, -1]

    # -- first-turn prefill at a padded length (CUDA graph) -------------------------------------
    def _prefill_bucket(self, T: int) -> int | None:
        """The padded length of a graph (or `pad_prefill`) prefill of T tokens, None for eager."""
        if not (self.cuda_graph or self.pad_prefill):
            return None
        if self.fastv.key_mask is not None or self.fastv.deciding or self.retrieval.packed is not None:
            return None  # FastV decides and masks on the host, mid-pass; a packed buffer refuses prefills
        sc, start = self.retrieval.scoring, self.length
        if start == 0:
            if sc is not None and sc.q_from >= T:
                return None  # question rows outside this pass are scored eagerly
            limit = min(PREFILL_GRAPH_MAX, self.prefill_chunk, self.max_len)
        else:
            if sc is not None and sc.q_from != start:
                return None  # a later turn with retrievable rows of its own (a new image) is scored eagerly
            limit = min(FOLLOWUP_GRAPH_MAX, self.prefill_chunk, self.max_len - start)
            if not self.model.options.split_rows_attention:
                limit = min(limit, FOLLOWUP_GRAPH_MAX_KEYS - start)
        Tp = prefill_bucket(T)
        return None if Tp > limit or (start and not self._later_graph_due(self._graph_key(Tp))) else Tp

    def _graph_key(self, Tp: int) -> tuple:
        """The key of the padded prefill graph of Tp rows at the cache's end (see `_replay_prefill`)."""
        return ("prefill", Tp, self.length > 0, *self.retrieval.graph_key(self.length))

    def _later_graph_due(self, key: tuple) -> bool:
        """Whether a later turn of graph key `key` pads and replays: from the decoder's second such turn on. A
        capture costs a few eager turns and a conversation may never repeat a bucket (`pad_prefill` alike)."""
        seen = key in self.graphs.entries or key in self._later_seen
        self._later_seen.add(key)
        return seen

    def _prefill_padded(self, h: torch.Tensor, positions: torch.Tensor | None, Tp: int) -> torch.Tensor:
        """Rows h (1, T, d) at slots length.. run as Tp rows: copied into the static inputs, zero padding
        after them, positions continuing +1 past the last; the last real row's logits (V,).
        A graph replay when `cuda_graph`, else the same padded forward eagerly."""
        T, start = h.shape[1], self.length
        self.model._check_inputs(h, self.cache, start, positions)  # all the eager path validates, for T rows
        if h.shape[2] != self.model.cfg.dim:
            raise ValueError(f"hidden states of width {h.shape[2]}, the model's is {self.model.cfg.dim}")
        pf = self._prefill_inputs()
        pf.h[:, :T].copy_(h)
        pf.h[:, T:Tp].zero_()  # zero rows: RMSNorm maps them to zero, never to NaN
        if positions is None:
            torch.add(pf.slots[:Tp], start, out=pf.pos[:Tp])
        else:
            pf.pos[:T].copy_(positions)
            pf.pos[T:Tp].copy_(pf.slots[:Tp - T] + (positions[-1:].to(pf.pos.device) + 1))
        pf.last.fill_(T - 1)
        pf.start.fill_(start)
        if self.cuda_graph:
            logits = self._replay_prefill(Tp)
        else:
            if self.retrieval.scoring is not None:  # as a graph would, into other buffers than begin_scoring's
                self.retrieval.use_buffers(*self._scoring_buffers())
            logits = self._padded_forward(Tp, start > 0)[0, -1]
        self.retrieval.end_padded()
        return logits

    def _replay_prefill(self, Tp: int) -> torch.Tensor:
        """The padded prefill (static inputs filled) replayed from its graph, captured on first use;
        with scoring on, the graph's scoring buffers take the question's slots first."""
        # What the graph bakes in: a first turn's host slots or a later turn's device ones (RowsIndex), and of the
        # scoring its first question row and span (the kernel's key view starts at the span's first slot).
        made, start = [], self.length

        def make():
            bufs = self._scoring_buffers()
            if bufs is not None:
                self.retrieval.use_buffers(*bufs)
            made.append(True)
            return (*self._capture_prefill(Tp, start > 0), bufs)

        graph, logits, bufs = self.graphs.get(self._graph_key(Tp), make)
        if bufs is not None and not made:
            self.retrieval.use_buffers(*bufs)
        graph.replay()
        return logits[0, -1].clone()  # the graph's output buffer is overwritten by the next replay

    def _scoring_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """New (idx, scores) buffers shaped as the current scoring's (None without scoring), poisoned:
        the padded pass must fill idx and zero the scores itself (`Retrieval.use_buffers`)."""
        sc = self.retrieval.scoring
        if sc is None:
            return None
        return torch.full_like(sc.idx, -1), torch.full_like(sc.scores, float("nan"))

    def _prefill_inputs(self) -> _PrefillInputs:
        """The static inputs every prefill graph reads, sized for the largest bucket allowed (views of
        one buffer per input, so all graphs share them and none grows)."""
        if self._pf is None:
            n = min(PREFILL_GRAPH_MAX, self.prefill_chunk, self.max_len)
            w = self.model.embed.weight
            slots = torch.arange(n, device=w.device)
            self._pf = _PrefillInputs(torch.zeros(1, n, w.shape[1], dtype=w.dtype, device=w.device),
                                      torch.zeros(n, dtype=torch.long, device=w.device), slots,
                                      *(torch.zeros(1, dtype=torch.long, device=w.device) for _ in range(2)))
        return self._pf

    def _padded_forward(self, Tp: int, later: bool) -> torch.Tensor:
        """The forward a prefill graph captures, from the static inputs: logits (1, 1, V) of row `last`
        (and, with scoring on, the retrieval scores of the real question rows). Device ops only. A first turn
        writes at the static `slots` (its address is baked in), a later one at slots `start` + `slots` made
        inside the pass (a RowsIndex, the `later` form), so one graph serves every cache length."""
        pf = self._pf
        if not later:
            self.cache.use_slots(0, pf.slots[:Tp])
            at = 0
        else:
            two = pf.slots[:2]  # [0, 1]: the varlen offsets [0, Tp] and [0, max_len] without a host copy
            at = RowsIndex(pf.start, pf.slots[:Tp] + pf.start, (pf.start + Tp).int(), (two * Tp).int(),
                           (two * self.max_len).int())
        self.retrieval.pad_rows(pf.slots[:Tp], pf.last, later)  # scoring on: rows past `last` score nothing
        return self.model(pf.h[:, :Tp], self.cache, at, positions=pf.pos[:Tp], rows=pf.last,
                          retrieval=self.retrieval, fastv=self.fastv)

    def _capture_prefill(self, Tp: int, later: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The eager warm-up writes K/V at the Tp slots from the cache's end, which the replay then rewrites
        # with the same values (and scores, which the replay zeroes before scoring again). The graph shares
        # the decode graphs' pool: replays are serial on one stream and every graph's state that outlives
        # a replay (inputs, cache, step index, scoring buffers) lives outside the pool; outputs are cloned
        # (prefill) or consumed (decode) before another graph runs.
        return self._capture_graph(lambda: self._padded_forward(Tp, later))

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Append one token; returns the next-token logits (V,)."""
        with self.device_lock:
            self._begin(token, 1)
            logits = self._run(None).clone()  # a graph's output buffer is overwritten by the next replay
            self._set_length(self.length + 1)
        return logits

    @torch.inference_mode()
    def greedy(self, token: int, n: int, vocab_size: int | None = None) -> list[int]:
        """Append `token` and its n - 1 greedy successors; returns the n argmax ids (over the first
        `vocab_size` logits) that followed each appended token. One host synchronisation in all."""
        if not 1 <= n <= MAX_BATCH:
            raise ValueError(f"greedy decodes 1..{MAX_BATCH} tokens per call, got {n}")
        with self.device_lock:
            self._begin(token, n)
            for _ in range(n):
                self._run(vocab_size)
            self._set_length(self.length + n)
            return self._out[:n].tolist()

    def _begin(self, token: int, n: int) -> None:
        """Before n decode steps (eager, host values): the step index at the cache's end, a RoPE table that
        covers their positions, the input token, and an empty record."""
        self.check_room(n)
        self.retrieval.ensure_room(self.length, n)  # a packed buffer grows (re-packs) when the steps would not fit
        p = self.retrieval.packed
        row = self.length - (p.dropped if p is not None else 0)  # the step's row in the buffer it attends over
        st = self.cache.step_index()
        st.set(self.length, row, self.position, row + 1)
        self._cover_rope(st, self.position + n)
        self._token.fill_(token)
        self._count.zero_()

    def _cover_rope(self, st: StepIndex, end: int) -> None:
        """Give the steps a RoPE table (text.rope_table) with the rows of positions 0..end-1. The first
        covers the whole cache (every position, unless explicit positions left gaps); one too short is
        replaced by one twice as long, which drops the captured step graphs (they read the old table)."""
        have = 0 if st.rope is None else st.rope.shape[1]
        if have >= end:
            return
        w = self.model.embed.weight
        st.rope = rope_table(self.model.cfg, max(end, self.max_len, 2 * have), w.dtype, w.device)
        self.graphs.clear(lambda key: key[0] == "step")  # prefill graphs compute their own cos/sin

    def _set_length(self, length: int) -> None:
        """Move the end of the cache within the current decode run (positions are contiguous there)."""
        self.position += length - self.length
        self.length = length

    def _step(self, vocab_size: int | None) -> torch.Tensor:
        """One decode step from the device state: logits (V,) of `_token` at the step index; the argmax
        becomes the next `_token` and is recorded in `_out[_count]`; `_count` and the index advance.
        Device ops only; on CUDA that tail is the argmax's two launches (ops.argmax_step)."""
        cache, st, sparse = self.cache, self.cache.step_index(), {"retrieval": self.retrieval, "fastv": self.fastv}
        if self.fastv.key_mask is not None:  # permanent-pruning baselines decode through the masked prefill path
            logits = self.model(self.model.embed(self._token), cache, self.length + int(self._count),
                                last_only=True, positions=st.pos, **sparse)[0, -1]
        else:
            logits = self.model(self.model.embed(self._token), cache, st, **sparse)[0, -1]  # (V,)
        ops.argmax_step(logits[:vocab_size], self._token, self._out, self._count, st.index, st.lengths,
                        opts=self.model.options)
        return logits

    def _run(self, vocab_size: int | None) -> torch.Tensor:
        """`_step`, replayed from a CUDA graph captured for this decode buffer and vocabulary limit."""
        if not self.cuda_graph or self.fastv.key_mask is not None:
            return self._step(vocab_size)
        p = self.retrieval.packed  # a graph reads the buffer it was captured over: its allocation is in the key
        key = ("step", vocab_size, None if p is None else (p.generation, p.capacity))
        graph, logits = self.graphs.get(key, lambda: self._capture(vocab_size))
        graph.replay()
        return logits

    def _capture(self, vocab_size: int | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The eager warm-up step writes K/V at the next slot (overwritten by the real step) and advances
        # the device state, which is restored before the capture.
        live = (*self.cache.step_index().tensors(), self._token, self._count)
        device = self._token.device
        if self.model.options.pdl and device not in _STEP_CAPTURED:
            # The first decode-step graph a process captures with PDL replays 3-5% slower than every graph
            # captured after a step graph has been captured and replayed (eager warm-ups do not help):
            # docs/perf_notes.md, "First step graph". So the first one is replayed a few times, then dropped.
            _STEP_CAPTURED.add(device)
            graph, _ = self._capture_graph(lambda: self._step(vocab_size), restore=live)
            saved = [t.clone() for t in live]
            for _ in range(_PRIME_REPLAYS):
                graph.replay()  # writes K/V at the next slot only (the real step overwrites it)
                for t, v in zip(live, saved):
                    t.copy_(v)
            del graph
        return self._capture_graph(lambda: self._step(vocab_size), restore=live)

    def _capture_graph(self, fn, restore: tuple = ()) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """fn() captured in the decoder's graph pool after one eager warm-up (tinyvila/cuda_graph.capture)."""
        with torch.cuda.device(self._token.device):
            return capture(fn, self.graphs.pool, restore=restore)

    def truncate(self, length: int) -> None:
        """Forget everything past `length` (the entries are overwritten by later writes)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self._explicit = [(s, p[:length - s]) for s, p in self._explicit if s < length]
        self.cache.truncate(length)  # spans past it go
        self.retrieval.reset()  # and any scoring or packed decode buffer
        if length == 0:
            self.fastv.reset()  # a new conversation has no permanent pruning
        self.length = self.position = length
        if self._explicit:  # positions run on contiguously after the last explicit one
            start, pos = self._explicit[-1]
            self.position = int(pos[-1]) + 1 + length - (start + len(pos))


def generate(decoder: Decoder, logits: torch.Tensor, params: SamplingParams,
             stop_ids: set[int] | frozenset[int] = frozenset(), vocab_size: int | None = None,
             batch: int = 16) -> Iterator[int]:
    """Yield new token ids, starting from the logits after the prompt.

    Stops after a stop id (which is yielded), after `max_new_tokens`, or when the cache is full.
    The last yielded token is never written to the cache: the caller feeds it with the next turn.
    `vocab_size` limits sampling to ids the tokenizer knows (LLM embedding tables are often padded).
    Greedy decoding runs `batch` steps per host synchronisation (`Decoder.greedy`); tokens computed
    past a stop are discarded, and the cache always holds exactly what precedes the last yielded token.
    """
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=logits.device).manual_seed(params.seed)
    token, produced = sample(logits[:vocab_size], params, generator), 1
    yield token
    while not (token in stop_ids or produced == params.max_new_tokens or decoder.length >= decoder.max_len):
        if params.temperature > 0:
            logits = decoder.step(token)
            token, produced = sample(logits[:vocab_size], params, generator), produced + 1
            yield token
            continue
        n = min(batch, params.max_new_tokens - produced, decoder.max_len - decoder.length)
        new = decoder.greedy(token, n, vocab_size)
        base = decoder.length - n  # the cache before this batch; token j (1-based) follows base + j
        for j, token in enumerate(new, 1):
            decoder._set_length(base + j)
            produced += 1
            yield token
            if token in stop_ids or produced == params.max_new_tokens:
                return
