"""Generation: a decoder that owns one conversation's KV cache, sampling, and the token iterator.

`Decoder` runs the LLM on a preallocated `KVCache`: `prefill` appends a block of input embeddings,
`step` appends one token, both returning the next-token logits; `truncate` evicts everything past a
length (used to drop a turn). `generate` turns logits into a token stream: greedy or
temperature/top-k/top-p sampling with a seed, stop ids, a token budget, and the context limit.
The loop follows gpt-fast/nanochat: prefill once, then one cached decode step per token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .errors import ContextLimitError
from .text import KVCache


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
    given explicit positions with gaps (pruned visual tokens that keep their original positions)."""

    def __init__(self, text_model, max_seq_len: int | None = None):
        self.model = text_model
        w = text_model.embed.weight
        self.cache = KVCache(text_model.cfg, max_seq_len=max_seq_len, dtype=w.dtype, device=w.device)
        self.length = 0
        self.position = 0
        self._explicit: list[tuple[int, torch.Tensor]] = []  # (first slot, positions) of such prefills

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
        later tokens continue after the last of them."""
        T = h.shape[1]
        self.check_room(T)
        explicit = positions is not None
        if not explicit and self.position != self.length:
            positions = torch.arange(self.position, self.position + T, device=h.device)
        # Only pass positions when they differ from the slots, as models without the argument expect.
        extra = {} if positions is None else {"positions": positions}
        logits = self.model(h, self.cache, self.length, last_only=True, **extra)
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
        ids = torch.tensor([[token]], device=self.cache.k[0].device)
        return self.prefill(self.model.embed(ids))

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
             stop_ids: set[int] | frozenset[int] = frozenset(), vocab_size: int | None = None) -> Iterator[int]:
    """Yield new token ids, starting from the logits after the prompt.

    Stops after a stop id (which is yielded), after `max_new_tokens`, or when the cache is full.
    The last yielded token is never written to the cache: the caller feeds it with the next turn.
    `vocab_size` limits sampling to ids the tokenizer knows (LLM embedding tables are often padded).
    """
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=logits.device).manual_seed(params.seed)
    for i in range(params.max_new_tokens):
        token = sample(logits[:vocab_size], params, generator)
        yield token
        if token in stop_ids or i + 1 == params.max_new_tokens or decoder.length >= decoder.max_len:
            return
        logits = decoder.step(token)
