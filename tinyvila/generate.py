"""Generation: a decoder that owns one conversation's KV cache, sampling, and the token iterator.

`Decoder` runs the LLM on a preallocated `KVCache`: `prefill` appends a block of input embeddings,
`step` appends one token, both returning the next-token logits; `truncate` evicts everything past a
length (used to drop a turn). `generate` turns logits into a token stream: greedy or
temperature/top-k/top-p sampling with a seed, stop ids, a token budget, and the context limit.
The loop follows gpt-fast/nanochat: prefill once, then one cached decode step per token.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .errors import ContextLimitError
from .text import KVCache

PREFILL_CHUNK = 4096  # prompt tokens per prefill pass: bounds activation memory for long videos
MAX_BATCH = 64        # greedy tokens per host synchronisation, at most


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(f"invalid sampling parameters: {self}")


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


class Decoder:
    """Runs a `TextModel` over one conversation's KV cache. `length` = tokens in the cache;
    `position` = the logical RoPE position of the next token, ahead of `length` once a prefill was
    given explicit positions with gaps (pruned visual tokens that keep their original positions).

    Decode steps read their token, cache slot, RoPE position and packed-buffer row from device
    tensors (`KVCache.step_index`) and advance them themselves, so on CUDA one step is captured in a
    CUDA graph (per decode buffer and vocabulary limit) and replayed per token with no host work;
    greedy decoding also takes its argmax inside the graph and the host reads the new tokens once per
    batch (`greedy`). `cuda_graph=False` (or TINYVILA_CUDA_GRAPH=0, or an fp32 model) runs the same
    step eagerly.
    """

    def __init__(self, text_model, max_seq_len: int | None = None, cuda_graph: bool | None = None,
                 prefill_chunk: int = PREFILL_CHUNK):
        self.model = text_model
        w = text_model.embed.weight
        self.cache = KVCache(text_model.cfg, max_seq_len=max_seq_len, dtype=w.dtype, device=w.device)
        self.length = 0
        self.position = 0
        self._explicit: list[tuple[int, torch.Tensor]] = []  # (first slot, positions) of such prefills
        if cuda_graph is None:  # fp32/fp64 models decode through PyTorch references that sync the host
            cuda_graph = (w.is_cuda and w.dtype in (torch.float16, torch.bfloat16)
                          and os.environ.get("TINYVILA_CUDA_GRAPH", "1") != "0")
        self.cuda_graph, self.prefill_chunk = cuda_graph, prefill_chunk
        # The decode step's device state: input token, greedy outputs of a batch, and their count.
        self._token = torch.zeros(1, 1, dtype=torch.long, device=w.device)
        self._out = torch.zeros(MAX_BATCH, dtype=torch.long, device=w.device)
        self._count = torch.zeros(1, dtype=torch.long, device=w.device)
        self._graphs: dict[tuple, tuple] = {}
        self._pool = None

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
        long (video) prompt needs activation memory for one chunk, not for all of it."""
        T = h.shape[1]
        self.check_room(T)
        explicit = positions is not None
        if not explicit and self.position != self.length:
            positions = torch.arange(self.position, self.position + T, device=h.device)
        for a in range(0, T, self.prefill_chunk):
            b = min(T, a + self.prefill_chunk)
            # Only pass positions when they differ from the slots, as models without the argument expect.
            extra = {} if positions is None else {"positions": positions[a:b]}
            logits = self.model(h[:, a:b], self.cache, self.length + a, last_only=True, **extra)
        if explicit:
            self._explicit.append((self.length, positions.cpu()))
            self.position = int(self._explicit[-1][1][-1]) + 1
        else:
            self.position += T
        self.length += T
        return logits[0, -1]

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Append one token; returns the next-token logits (V,)."""
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
        self._begin(token, n)
        for _ in range(n):
            self._run(vocab_size)
        self._set_length(self.length + n)
        return self._out[:n].tolist()

    def _begin(self, token: int, n: int) -> None:
        self.check_room(n)
        dropped = self.cache.packed.dropped if self.cache.packed is not None else 0
        self.cache.step_index().set(self.length, self.length - dropped, self.position)
        self._token.fill_(token)
        self._count.zero_()

    def _set_length(self, length: int) -> None:
        """Move the end of the cache within the current decode run (positions are contiguous there)."""
        self.position += length - self.length
        self.length = length

    def _step(self, vocab_size: int | None) -> torch.Tensor:
        """One decode step from the device state: logits (V,) of `_token` at the step index; the argmax
        becomes the next `_token` and is recorded in `_out`; the index advances. Device ops only."""
        cache, st = self.cache, self.cache.step_index()
        if cache.key_mask is not None:  # permanent-pruning baselines decode through the masked prefill path
            logits = self.model(self.model.embed(self._token), cache, self.length + int(self._count),
                                last_only=True, positions=st.pos)[0, -1]
        else:
            logits = self.model(self.model.embed(self._token), cache, st)[0, -1]  # (V,)
        nxt = logits[:vocab_size].argmax().view(1)
        self._token.copy_(nxt.view(1, 1))
        self._out.index_copy_(0, self._count, nxt)
        self._count.add_(1)
        st.advance()
        return logits

    def _run(self, vocab_size: int | None) -> torch.Tensor:
        """`_step`, replayed from a CUDA graph captured for this decode buffer and vocabulary limit."""
        if not self.cuda_graph or self.cache.key_mask is not None:
            return self._step(vocab_size)
        p = self.cache.packed
        key = (vocab_size, None if p is None else (p.k[0].data_ptr(), tuple(p.k[0].shape)))
        if key not in self._graphs:
            if len(self._graphs) >= 8:  # buffers replaced many times: start over rather than grow
                self._graphs.clear()
            self._graphs[key] = self._capture(vocab_size)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

    def _capture(self, vocab_size: int | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # One eager warm-up step on a side stream compiles the Triton kernels and lets cuBLAS pick its
        # algorithms outside the capture. It writes K/V at the next slot (overwritten by the real
        # step) and advances the device state, which is restored after it.
        live = (*self.cache.step_index().tensors(), self._token, self._count)
        state = [t.clone() for t in live]
        side = torch.cuda.Stream(device=self._token.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(vocab_size)
        torch.cuda.current_stream().wait_stream(side)
        for t, saved in zip(live, state):
            t.copy_(saved)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(vocab_size)
        return graph, logits

    def truncate(self, length: int) -> None:
        """Forget everything past `length` (the entries are overwritten by later writes)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self._explicit = [(s, p[:length - s]) for s, p in self._explicit if s < length]
        self.cache.truncate(length)  # spans past it go; a packed decode buffer is dropped
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
