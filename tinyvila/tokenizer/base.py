"""The tokenizer interface, streaming UTF-8 decoding and added (special) token splitting.

`Tokenizer` is what the runtime needs from a tokenizer; `BPETokenizer` (bpe.py) and
`SentencePieceTokenizer` (sentencepiece.py) fill it. `StreamDecoder` turns ids into complete
characters one token at a time, and `decode` is defined through it. `_AddedSplitter` cuts added
tokens out of the text first, as HF's AddedVocabulary does, for both tokenizers.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import regex

IMAGE_TOKEN = -200  # VILA's IMAGE_TOKEN_INDEX: where an image's embeddings are spliced in


# ----------------------------------------------------------------------------------------------
# Common interface


class Tokenizer:
    """What the runtime needs from a tokenizer; `BPETokenizer` and `SentencePieceTokenizer` fill it.

    Attributes: `bos_id`, `eos_id` (int or None), `vocab_size` (largest id + 1), `special_ids`
    (frozenset of ids that `decode(skip_special_tokens=True)` drops), `strip_leading_space`
    (sentencepiece drops the space its dummy prefix put before the first word when decoding).
    """

    bos_id: int | None = None
    eos_id: int | None = None
    vocab_size: int = 0
    special_ids: frozenset = frozenset()
    strip_leading_space: bool = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the tokenizer's BOS (and EOS) are added."""
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry spelled as the vocabulary spells it, or None."""
        raise NotImplementedError

    def id_to_bytes(self, token_id: int) -> bytes:
        """Raw bytes token `token_id` stands for (possibly part of a UTF-8 character)."""
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`: their bytes joined, decoded as UTF-8 with U+FFFD for invalid bytes."""
        dec = StreamDecoder(self, skip_special_tokens)
        return "".join(dec.push(i) for i in ids) + dec.flush()


class StreamDecoder:
    """Incremental decoding for streaming: `push(id)` returns only complete characters.

    The concatenation of every `push` and the final `flush` equals `tokenizer.decode(ids)`,
    because `decode` is defined through this class. Image sentinels (`IMAGE_TOKEN`) decode to "".
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False

    def push(self, token_id: int) -> str:
        """Feed one id; return the characters completed by it (maybe "")."""
        if token_id == IMAGE_TOKEN:
            return ""
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        data = self.tokenizer.id_to_bytes(token_id)
        if not self._started and data:
            self._started = True
            if self.tokenizer.strip_leading_space and data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Characters still held (an incomplete UTF-8 sequence becomes U+FFFD); resets the stream."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._started = False
        return text


# ----------------------------------------------------------------------------------------------
# Added (special) tokens, split out of the text before anything else sees it


@dataclass(frozen=True)
class AddedToken:
    content: str
    id: int
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False


class _AddedSplitter:
    """Finds added tokens in text, leftmost then longest first, like HF's AddedVocabulary.

    `lstrip`/`rstrip` let a match swallow the whitespace beside it; `single_word` only matches a
    token not glued to word characters.
    """

    def __init__(self, tokens: list[AddedToken]):
        self.by_content = {t.content: t for t in tokens}
        ordered = sorted(self.by_content, key=len, reverse=True)  # longest alternative wins
        self.pattern = regex.compile("|".join(regex.escape(c) for c in ordered)) if ordered else None

    def split(self, text: str) -> list[tuple[str, AddedToken | None]]:
        """[(piece, token or None)]: added tokens and the plain text between them (non-empty)."""
        if self.pattern is None:
            return [(text, None)] if text else []
        out, pos = [], 0
        for m in self.pattern.finditer(text):
            tok = self.by_content[m.group()]
            start, end = m.span()
            if start < pos or (tok.single_word and not self._alone(text, start, end)):
                continue
            if tok.lstrip:
                while start > pos and text[start - 1].isspace():
                    start -= 1
            if tok.rstrip:
                while end < len(text) and text[end].isspace():
                    end += 1
            if start > pos:
                out.append((text[pos:start], None))
            out.append((text[start:end], tok))
            pos = end
        if pos < len(text):
            out.append((text[pos:], None))
        return out

    @staticmethod
    def _alone(text: str, start: int, end: int) -> bool:
        before = start > 0 and regex.match(r"\w", text[start - 1])
        after = end < len(text) and regex.match(r"\w", text[end])
        return not before and not after


def _added_from_json(t: dict) -> AddedToken:
    return AddedToken(
        content=t["content"], id=int(t["id"]), special=bool(t.get("special", False)),
        lstrip=bool(t.get("lstrip", False)), rstrip=bool(t.get("rstrip", False)),
        single_word=bool(t.get("single_word", False)),
    )
