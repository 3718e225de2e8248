"""Tokenizers, VILA chat templates, `<image>` expansion and streaming UTF-8 decoding.

Two tokenizers behind one interface (`Tokenizer`): a pure-Python byte-level BPE that reads a
HuggingFace `tokenizer.json` (Llama-3, Qwen2, SmolLM2/GPT-2 configurations, with HF `tokenizers`
semantics), and a wrapper of the `sentencepiece` library for `tokenizer.model` (Llama-2 family)
that splits special tokens out of the text like transformers' slow `LlamaTokenizer`.
Templates follow VILA's `llava/conversation.py` (`get_prompt`), and the image sentinel expansion
follows VILA's `tokenizer_image_token`. Imports only stdlib, `regex`, `sentencepiece` (and `gguf`
inside `tokenizer_json_from_gguf`). Tests: tests/test_tokenizer.py, tests/test_templates.py.
"""

from __future__ import annotations

import codecs
import functools
import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import regex

IMAGE_TOKEN = -200  # VILA's IMAGE_TOKEN_INDEX: where an image's embeddings are spliced in
IMAGE_PLACEHOLDER = "<image>"

# GPT-2's ByteLevel pre-tokenizer pattern (HF `tokenizers` ByteLevel with use_regex=True).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:  # unprintable bytes are moved above 255, in byte order
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


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


def _token_content(tok) -> str:
    """`bos_token` in a tokenizer_config.json is a string or an AddedToken dict."""
    return tok.get("content") if isinstance(tok, dict) else tok


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-export the {what}") from None


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


# ----------------------------------------------------------------------------------------------
# Byte-level BPE from tokenizer.json


def _find_matches(pattern, text: str, invert: bool = False) -> list[tuple[str, bool]]:
    """Text cut into (piece, is_match) runs, as HF's `find_matches` (empty matches dropped)."""
    out, pos = [], 0
    for m in pattern.finditer(text):
        start, end = m.span()
        if start == end:
            continue
        if start > pos:
            out.append((text[pos:start], invert))
        out.append((text[start:end], not invert))
        pos = end
    if pos < len(text):
        out.append((text[pos:], invert))
    return out


def _glues(behavior: str, is_match: bool, prev_match: bool) -> bool:
    """Whether a run joins the piece before it under HF's `SplitDelimiterBehavior`."""
    if behavior == "MergedWithPrevious":
        return is_match and not prev_match
    if behavior == "MergedWithNext":
        return prev_match
    if behavior == "Contiguous":
        return is_match == prev_match
    return False


def _apply_behavior(runs: list[tuple[str, bool]], behavior: str) -> list[str]:
    """HF `SplitDelimiterBehavior` applied to (piece, is_match) runs."""
    out: list[str] = []
    prev_match = False
    for piece, is_match in runs:
        if behavior == "Removed" and is_match:
            continue  # HF's Removed never looks at the previous run
        if out and _glues(behavior, is_match, prev_match):
            out[-1] += piece
        else:
            out.append(piece)
        prev_match = is_match
    return out


_BEHAVIORS = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


class _PreTokenizer:
    """A chain of pre-tokenizer steps: each maps one piece of text to a list of pieces."""

    def __init__(self, spec: dict | None, source: str):
        self.steps = []
        self._build(spec, source)

    def _build(self, spec, source):
        if spec is None:
            return
        kind = spec.get("type")
        if kind == "Sequence":
            for sub in spec["pretokenizers"]:
                self._build(sub, source)
        elif kind == "ByteLevel":
            self.steps.append(self._byte_level(spec.get("add_prefix_space", False), spec.get("use_regex", True)))
        elif kind == "Split":
            self.steps.append(self._split(spec, source))
        elif kind == "Digits":
            pattern = regex.compile(r"\p{N}")  # HF: Rust char::is_numeric (Nd, Nl, No), one per char
            behavior = "Isolated" if spec.get("individual_digits", False) else "Contiguous"
            self.steps.append(lambda s: _apply_behavior(_find_matches(pattern, s), behavior))
        else:
            raise ValueError(f"{source}: unsupported pre_tokenizer type {kind!r}")

    @staticmethod
    def _byte_level(add_prefix_space: bool, use_regex: bool):
        pattern = regex.compile(GPT2_PATTERN)
        table = bytes_to_unicode()

        def step(s: str) -> list[str]:
            # HF adds the prefix space to every piece reaching this step, not only the first
            if add_prefix_space and not s.startswith(" "):
                s = " " + s
            pieces = [m.group() for m in pattern.finditer(s)] if use_regex else [s]
            return ["".join(table[b] for b in p.encode("utf-8")) for p in pieces]

        return step

    @staticmethod
    def _split(spec: dict, source: str):
        pat = spec.get("pattern", {})
        if "Regex" in pat:
            pattern = regex.compile(pat["Regex"])
        elif "String" in pat:
            pattern = regex.compile(regex.escape(pat["String"]))
        else:
            raise ValueError(f"{source}: Split pre_tokenizer without a Regex or String pattern")
        behavior = spec.get("behavior", "Isolated")
        if behavior not in _BEHAVIORS:
            raise ValueError(f"{source}: unsupported Split behavior {behavior!r}")
        invert = bool(spec.get("invert", False))
        return lambda s: _apply_behavior(_find_matches(pattern, s, invert), behavior)

    def __call__(self, text: str) -> list[str]:
        pieces = [text]
        for step in self.steps:
            pieces = [q for p in pieces for q in step(p) if q]
        return pieces


def _normalizer(spec: dict | None, source: str):
    """A text -> text function for the normalizers we support (none, NFC, Sequence of those)."""
    if spec is None:
        return lambda s: s
    kind = spec.get("type")
    if kind == "NFC":
        return lambda s: unicodedata.normalize("NFC", s)
    if kind == "Sequence":
        fns = [_normalizer(sub, source) for sub in spec["normalizers"]]
        return lambda s: functools.reduce(lambda acc, f: f(acc), fns, s)
    raise ValueError(f"{source}: unsupported normalizer type {kind!r}")


def _post_processor_ids(spec: dict | None, source: str) -> tuple[list[int], list[int]]:
    """(prefix ids, suffix ids) the post-processor wraps a single sequence in."""
    if spec is None or spec.get("type") == "ByteLevel":
        return [], []
    kind = spec.get("type")
    if kind == "Sequence":
        prefix, suffix = [], []
        for sub in spec["processors"]:
            p, s = _post_processor_ids(sub, source)
            prefix, suffix = prefix + p, suffix + s
        return prefix, suffix
    if kind != "TemplateProcessing":
        raise ValueError(f"{source}: unsupported post_processor type {kind!r}")
    prefix, suffix, seen = [], [], False
    for item in spec["single"]:
        if "Sequence" in item:
            seen = True
        else:
            ids = spec["special_tokens"][item["SpecialToken"]["id"]]["ids"]
            (suffix if seen else prefix).extend(ids)
    return prefix, suffix


class BPETokenizer(Tokenizer):
    """Byte-level BPE with HF `tokenizers` semantics, built from a parsed tokenizer.json.

    `config` is an optional tokenizer_config.json dict (for `bos_token`/`eos_token`).
    Merges are applied lowest merge rank first (leftmost on ties), one pair at a time.
    """

    def __init__(self, spec: dict, source: str = "<tokenizer.json>", config: dict | None = None):
        model = spec.get("model") or {}
        if model.get("type", "BPE") != "BPE" or "vocab" not in model:
            raise ValueError(f"{source}: unsupported model type {model.get('type')!r} (only BPE)")
        for key in ("continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                raise ValueError(f"{source}: unsupported BPE option {key}={model[key]!r}")
        if model.get("byte_fallback"):
            raise ValueError(f"{source}: unsupported BPE option byte_fallback (sentencepiece-style BPE)")
        self.vocab: dict[str, int] = dict(model["vocab"])
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
        self.ranks = {pair: r for r, pair in enumerate(merges)}
        self.ignore_merges = bool(model.get("ignore_merges", False))
        self.unk_id = self.vocab.get(model.get("unk_token")) if model.get("unk_token") else None
        self.added = [_added_from_json(t) for t in spec.get("added_tokens", [])]
        for t in self.added:
            self.vocab.setdefault(t.content, t.id)
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self.splitter = _AddedSplitter(self.added)
        self.normalize = _normalizer(spec.get("normalizer"), source)
        self.pre_tokenize = _PreTokenizer(spec.get("pre_tokenizer"), source)
        self.prefix_ids, self.suffix_ids = _post_processor_ids(spec.get("post_processor"), source)
        decoder = spec.get("decoder")
        if decoder is not None and decoder.get("type") != "ByteLevel":
            raise ValueError(f"{source}: unsupported decoder type {decoder.get('type')!r}")
        self.special_ids = frozenset(t.id for t in self.added if t.special)
        self.vocab_size = max(self.id_to_token) + 1
        self._set_bos_eos(config or {})
        self._bpe = functools.lru_cache(maxsize=1 << 16)(self._bpe_word)

    def _set_bos_eos(self, config: dict):
        bos, eos = _token_content(config.get("bos_token")), _token_content(config.get("eos_token"))
        self.bos_id = self.vocab.get(bos) if bos else (self.prefix_ids[0] if self.prefix_ids else None)
        self.eos_id = self.vocab.get(eos) if eos else None

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        if self.ignore_merges and word in self.vocab:
            return (self.vocab[word],)
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        ids = []
        for p in parts:
            i = self.vocab.get(p, self.unk_id)
            if i is not None:  # a symbol outside the vocabulary without an unk token is dropped
                ids.append(i)
        return tuple(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self.prefix_ids) if add_special_tokens else []
        for piece, tok in self.splitter.split(text):
            if tok is not None:
                ids.append(tok.id)
                continue
            for word in self.pre_tokenize(self.normalize(piece)):
                ids.extend(self._bpe(word))
        return ids + (list(self.suffix_ids) if add_special_tokens else [])

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def id_to_bytes(self, token_id: int) -> bytes:
        token = self.id_to_token.get(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        table = _unicode_to_bytes()
        # HF ByteLevel decoder: a token spelled in the byte alphabet maps back to its bytes;
        # any other token (e.g. an added token with a space) stands for its own UTF-8.
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
        return token.encode("utf-8")


def _added_from_json(t: dict) -> AddedToken:
    return AddedToken(
        content=t["content"], id=int(t["id"]), special=bool(t.get("special", False)),
        lstrip=bool(t.get("lstrip", False)), rstrip=bool(t.get("rstrip", False)),
        single_word=bool(t.get("single_word", False)),
    )


# ----------------------------------------------------------------------------------------------
# SentencePiece (tokenizer.model)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if b < 0x80:
            return value, pos


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b, value = value & 0x7F, value >> 7
        out.append(b | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _without_dummy_prefix(proto: bytes) -> bytes:
    """The ModelProto with normalizer_spec.add_dummy_prefix set to false, without protobuf.

    ModelProto field 3 is normalizer_spec; in it field 3 is add_dummy_prefix. Protobuf keeps the
    last value of a repeated scalar, so appending `add_dummy_prefix = 0` overrides it.
    """
    out, pos = bytearray(), 0
    while pos < len(proto):
        start = pos
        key, pos = _varint(proto, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(proto, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = _varint(proto, pos)
            if key >> 3 == 3:
                body = proto[pos : pos + n] + b"\x18\x00"
                out += _encode_varint(key) + _encode_varint(len(body)) + body
                pos += n
                continue
            pos += n
        else:
            raise ValueError("unexpected protobuf wire type in sentencepiece model")
        out += proto[start:pos]
    return bytes(out)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `tokenizer.model`, with special tokens handled like HF's slow LlamaTokenizer.

    Special tokens written in the text (`<s>`, `</s>`, `<unk>`, added tokens from
    tokenizer_config.json) are split out and mapped to their ids. `legacy=False` is what VILA
    passes (`AutoTokenizer.from_pretrained(..., use_fast=False, legacy=False)`): only the start of
    the text gets sentencepiece's dummy-prefix space, not the text after each special token;
    `legacy=True` gives every piece between special tokens its own dummy prefix.
    """

    strip_leading_space = True

    def __init__(self, model_path: str | Path, config: dict | None = None, legacy: bool = False):
        import sentencepiece as spm

        self.path, config, self.legacy = Path(model_path), config or {}, legacy
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{self.path} is not a readable sentencepiece model ({e})") from None
        self.sp_plain = spm.SentencePieceProcessor()
        self.sp_plain.LoadFromSerializedProto(_without_dummy_prefix(self.sp.serialized_model_proto()))
        self.add_bos = bool(config.get("add_bos_token", True))
        self.add_eos = bool(config.get("add_eos_token", False))
        self.added = self._added_tokens(config)
        self.splitter = _AddedSplitter(self.added)
        self.special_ids = frozenset(t.id for t in self.added if t.special)
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.unk_text = self.sp.id_to_piece(self.sp.unk_id())
        self.vocab_size = max([self.sp.get_piece_size()] + [t.id + 1 for t in self.added])
        self._by_id = {t.id: t for t in self.added}

    def _added_tokens(self, config: dict) -> list[AddedToken]:
        """unk/bos/eos of the model, then tokenizer_config.json's added_tokens_decoder."""
        tokens = {}
        for i in (self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()):
            if i >= 0:
                tokens[i] = AddedToken(self.sp.id_to_piece(i), i, special=True)
        for key, t in (config.get("added_tokens_decoder") or {}).items():
            tokens[int(key)] = _added_from_json(dict(t, id=int(key)))
        return list(tokens.values())

    def _encode_plain(self, text: str) -> list[int]:
        """A piece after a special token or a leading space: no dummy prefix (HF's unk trick)."""
        n_unk = len(self.sp_plain.encode(self.unk_text))
        return self.sp_plain.encode(self.unk_text + text)[n_unk:]

    def _encode_piece(self, text: str) -> list[int]:
        if self.legacy:
            return self.sp.encode(text)
        if text.startswith(("▁", " ")):
            return self._encode_plain(text)
        return self.sp_plain.encode(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.legacy and text:
            text = "▁" + text.replace("▁", " ")  # the one dummy prefix, at the start only
        ids: list[int] = []
        parts = self.splitter.split(text)
        for i, (piece, tok) in enumerate(parts):
            if tok is not None:
                ids.append(tok.id)
            elif not (not self.legacy and i == 0 and piece == "▁" and len(parts) > 1 and parts[1][1].special):
                # (a lone prefix before a special token is dropped, as HF does)
                ids.extend(self._encode_piece(piece))
        if add_special_tokens:
            ids = ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + ids
            ids += [self.eos_id] if self.add_eos and self.eos_id is not None else []
        return ids

    def token_to_id(self, token: str) -> int | None:
        for t in self.added:
            if t.content == token:
                return t.id
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.unk_text else i

    def id_to_bytes(self, token_id: int) -> bytes:
        if token_id in self._by_id:
            return self._by_id[token_id].content.encode("utf-8")
        if not 0 <= token_id < self.sp.get_piece_size():
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        piece = self.sp.id_to_piece(token_id)
        if self.sp.is_byte(token_id):  # byte-fallback pieces are spelled <0xNN>
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode("utf-8")


# ----------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(path: str | Path, legacy: bool = False) -> Tokenizer:
    """Tokenizer from a folder (tokenizer.json preferred, else tokenizer.model) or a file.

    A file may be tokenizer.json, a sentencepiece *.model or a GGUF (its embedded vocabulary).
    tokenizer_config.json beside it is read when present. `legacy` only matters for sentencepiece.
    """
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return load_tokenizer(path / name, legacy)
        raise FileNotFoundError(
            f"no tokenizer.json or tokenizer.model in {path}; copy the LLM's tokenizer files there"
        )
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    config_path = path.parent / "tokenizer_config.json"
    config = _read_json(config_path, "tokenizer config") if config_path.is_file() else None
    if path.suffix == ".gguf":
        return BPETokenizer(tokenizer_json_from_gguf(path), str(path), tokenizer_config_from_gguf(path))
    if path.suffix == ".json":
        return BPETokenizer(_read_json(path, "tokenizer.json"), str(path), config)
    return SentencePieceTokenizer(path, config, legacy)


# ----------------------------------------------------------------------------------------------
# Synthetic and GGUF tokenizer.json builders


def _template_processing(bos: str | None, bos_id: int | None) -> dict:
    single = [{"Sequence": {"id": "A", "type_id": 0}}]
    special = {}
    if bos is not None:
        single.insert(0, {"SpecialToken": {"id": bos, "type_id": 0}})
        special[bos] = {"id": bos, "ids": [bos_id], "tokens": [bos]}
    pair = single + [{"Sequence": {"id": "B", "type_id": 1}}]
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}


def _added_json(content: str, i: int, special: bool = True) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def _byte_level(add_prefix_space=False, use_regex=True) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True,
            "use_regex": use_regex}


def byte_tokenizer_json(special_tokens: list[str], bos: str | None = None) -> dict:
    """A valid HF tokenizer.json: 256 byte tokens (ids 0..255), no merges, specials from 256.

    `bos`, if given, must be one of `special_tokens`; the post-processor then adds it.
    """
    if bos is not None and bos not in special_tokens:
        raise ValueError(f"bos {bos!r} is not among the special tokens {special_tokens}")
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    added = [_added_json(s, 256 + k) for k, s in enumerate(special_tokens)]
    bos_id = 256 + special_tokens.index(bos) if bos is not None else None
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": _byte_level(), "post_processor": _template_processing(bos, bos_id),
        "decoder": _byte_level(),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def _gguf_pre_tokenizer(pre: str, path) -> tuple[dict, bool]:
    """(pre_tokenizer json, ignore_merges) for llama.cpp's `tokenizer.ggml.pre` name."""
    split = lambda p: {"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
    if pre == "smollm":  # llama.cpp and SmolLM2's tokenizer.json: single digits, then GPT-2 regex
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, _byte_level()]}, False
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return {"type": "Sequence", "pretokenizers": [split(LLAMA3_PATTERN), _byte_level(use_regex=False)]}, True
    if pre == "qwen2":
        return {"type": "Sequence", "pretokenizers": [split(QWEN2_PATTERN), _byte_level(use_regex=False)]}, False
    if pre in ("default", "gpt2", "gpt-2"):
        return _byte_level(), False
    raise ValueError(f"{path}: unsupported GGUF pre-tokenizer {pre!r} (supported: smollm, llama-bpe, qwen2, gpt2)")


@functools.lru_cache(maxsize=2)
def _gguf_fields(path) -> dict:
    """The `tokenizer.ggml.*` metadata of a GGUF file as plain Python values (cached: the
    reader parses the whole file, seconds for a large vocabulary)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e})") from None
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}


def tokenizer_json_from_gguf(path: str | Path) -> dict:
    """HF tokenizer.json dict built from a GGUF's byte-level BPE vocabulary (`tokenizer.ggml.*`).

    Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
    tokens; BOS is added when `tokenizer.ggml.add_bos_token` says so. Needs the `gguf` package.
    """
    f = _gguf_fields(str(path))
    if f.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{path}: unsupported GGUF tokenizer {f.get('tokenizer.ggml.model')!r} (only gpt2 BPE)")
    table = bytes_to_unicode()
    alphabet = set(table.values())
    tokens, types = f["tokenizer.ggml.tokens"], f.get("tokenizer.ggml.token_type") or [1] * len(f["tokenizer.ggml.tokens"])
    vocab = {}
    for i, t in enumerate(tokens):
        vocab[t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8"))] = i
    added = [_added_json(t, i, special=(ty == 3)) for i, (t, ty) in enumerate(zip(tokens, types))
             if (ty == 3 and set(t) <= alphabet) or ty == 4]
    pre, ignore_merges = _gguf_pre_tokenizer(f.get("tokenizer.ggml.pre", "default"), path)
    bos_id = f.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre, "decoder": _byte_level(),
        "post_processor": _template_processing(tokens[bos_id] if add_bos else None, bos_id),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": list(f.get("tokenizer.ggml.merges", []))},
    }


def tokenizer_config_from_gguf(path: str | Path) -> dict:
    """The tokenizer_config.json fields a GGUF states: bos_token, eos_token, add_bos_token."""
    f = _gguf_fields(str(path))
    tokens = f["tokenizer.ggml.tokens"]
    name = lambda key: tokens[f[key]] if f.get(key) is not None else None
    return {"bos_token": name("tokenizer.ggml.bos_token_id"), "eos_token": name("tokenizer.ggml.eos_token_id"),
            "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", False))}


# ----------------------------------------------------------------------------------------------
# Chat templates (VILA llava/conversation.py, VILA1.5 era)


@dataclass(frozen=True)
class Template:
    """One of VILA's conversation templates; `render` is VILA's `Conversation.get_prompt()`.

    style: "two" (vicuna: `role: text` + alternating sep/sep2), "llama_3" (role headers, sep after
    each message, sep2 after the last filled one), "mpt" (ChatML: role + text + sep).
    `answer_end` is what follows a finished answer in the history; `bos` the BOS string the
    template's tokenizer adds (None: no BOS); `special_tokens` the strings a tokenizer must treat
    as special for this template.
    """

    name: str
    system: str
    roles: tuple[str, str]
    style: str
    sep: str
    sep2: str | None
    stop_strings: tuple[str, ...]
    special_tokens: tuple[str, ...]
    bos: str | None

    @property
    def answer_end(self) -> str:
        return self.sep2 if self.style == "two" else self.sep

    def render(self, turns: list[tuple[str, str | None]], system: str | None = None) -> str:
        """Prompt string for [(user_text, assistant_text or None)], exactly as get_prompt()."""
        messages = [(role, m) for u, a in turns for role, m in zip(self.roles, (u, a))]
        system = self.system if system is None else system
        ret = system + self.sep
        for i, (role, msg) in enumerate(messages):
            ret += self._message(i, role, msg, last=i == len(messages) - 1)
        return ret

    def _message(self, i: int, role: str, msg: str | None, last: bool) -> str:
        if self.style == "two":
            return role + ": " + msg + (self.sep, self.sep2)[i % 2] if msg else role + ":"
        if self.style == "llama_3":
            return role + msg + (self.sep2 if last else self.sep) if msg else role
        return role + msg + self.sep if msg else role

    def turn_text(self, user_text: str, first: bool, system: str | None = None) -> str:
        """The prompt text of one user turn up to the assistant header (system included if first)."""
        head = ((self.system if system is None else system) + self.sep) if first else ""
        return head + self._message(0, self.roles[0], user_text, last=False) + self._message(1, self.roles[1], None, True)


_LLAMA3_SYSTEM = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful language and vision "
    "assistant. You are able to understand the visual content that the user provides, and assist the user "
    "with a variety of tasks using natural language."
)

TEMPLATES: dict[str, Template] = {
    "llama_3": Template(
        name="llama_3", system=_LLAMA3_SYSTEM,
        roles=("<|start_header_id|>user<|end_header_id|>\n\n", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        style="llama_3", sep="<|eot_id|>", sep2="<|end_of_text|>",
        stop_strings=("<|eot_id|>", "<|end_of_text|>"),
        special_tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>",
    ),
    "vicuna_v1": Template(
        name="vicuna_v1",
        system="A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions.",
        roles=("USER", "ASSISTANT"), style="two", sep=" ", sep2="</s>",
        stop_strings=("</s>",), special_tokens=("<unk>", "<s>", "</s>"), bos="<s>",
    ),
    "hermes-2": Template(
        name="hermes-2", system="<|im_start|>system\nAnswer the questions.",
        roles=("<|im_start|>user\n", "<|im_start|>assistant\n"), style="mpt", sep="<|im_end|>", sep2=None,
        stop_strings=("<|im_end|>",), special_tokens=("<|im_start|>", "<|im_end|>"), bos=None,
    ),
    # ChatML as SmolLM2's embedded chat template writes it (newline after each <|im_end|>), with its
    # default system prompt. The newline leads the roles so that `answer_end` stays one token.
    "smollm2": Template(
        name="smollm2",
        system="<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face",
        roles=("\n<|im_start|>user\n", "\n<|im_start|>assistant\n"), style="mpt", sep="<|im_end|>", sep2=None,
        stop_strings=("<|im_end|>",), special_tokens=("<|im_start|>", "<|im_end|>"), bos=None,
    ),
}


def get_template(name: str) -> Template:
    """Template by name; a clear error listing the known ones otherwise."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def stop_ids(tokenizer: Tokenizer, template: Template) -> list[int]:
    """Ids of the template's stop strings that the tokenizer has as single tokens."""
    ids = [tokenizer.token_to_id(s) for s in template.stop_strings]
    return [i for i in ids if i is not None]


# ----------------------------------------------------------------------------------------------
# <image> expansion and id-level prompts


def expand_images(user_text: str, n_images: int) -> str:
    """VILA's rule: a message without `<image>` gets "<image>\\n" prepended once per image.

    A message that already holds placeholders is kept; their count must equal `n_images`.
    """
    count = user_text.count(IMAGE_PLACEHOLDER)
    if count == 0:
        return (IMAGE_PLACEHOLDER + "\n") * n_images + user_text
    if count != n_images:
        raise ValueError(f"user text holds {count} {IMAGE_PLACEHOLDER} placeholders but {n_images} images were given")
    return user_text


def _adds_bos(tokenizer: Tokenizer) -> bool:
    ids = tokenizer.encode("", add_special_tokens=True)
    return bool(ids) and ids[0] == tokenizer.bos_id


def tokenizer_image_token(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """VILA's `tokenizer_image_token`: chunks between `<image>` tokenized with special tokens,
    one BOS kept (when chunk 0 starts with BOS, the first token of every chunk is dropped), chunks
    joined by IMAGE_TOKEN. Kept as the reference the segment-wise functions are tested against.
    """
    chunks = [tokenizer.encode(c, add_special_tokens=True) for c in prompt.split(IMAGE_PLACEHOLDER)]
    offset = 1 if chunks[0] and tokenizer.bos_id is not None and chunks[0][0] == tokenizer.bos_id else 0
    ids = [tokenizer.bos_id] if offset else []
    for k, chunk in enumerate(chunks):
        if k:
            ids.append(IMAGE_TOKEN)
        ids.extend(chunk[offset:])
    return ids


def _encode_after(tokenizer: Tokenizer, text: str, after: str | None) -> list[int]:
    """Ids of `text` as it tokenizes right after the special token `after` (sentencepiece puts
    no dummy prefix there); `after` itself is not returned."""
    if after is None or tokenizer.token_to_id(after) is None:
        return tokenizer.encode(text, add_special_tokens=False)
    lead = tokenizer.encode(after, add_special_tokens=False)
    return tokenizer.encode(after + text, add_special_tokens=False)[len(lead):] if text else []


def _segment_ids(tokenizer: Tokenizer, text: str, with_bos: bool, after: str | None) -> list[int]:
    chunks = text.split(IMAGE_PLACEHOLDER)
    ids = [tokenizer.bos_id] if with_bos and _adds_bos(tokenizer) else []
    for k, chunk in enumerate(chunks):
        if k:
            ids.append(IMAGE_TOKEN)
            ids.extend(tokenizer.encode(chunk, add_special_tokens=False))
        else:
            ids.extend(tokenizer.encode(chunk, add_special_tokens=False) if with_bos else _encode_after(tokenizer, chunk, after))
    return ids


def turn_ids(tokenizer: Tokenizer, template: Template, user_text: str, n_images: int, first: bool,
             prev_answer_ids: list[int] | None = None, system: str | None = None) -> list[int]:
    """Ids to append to the cache for one user turn, ending with the assistant header.

    The first turn carries BOS and the system prompt. A later turn starts with the template's
    answer-end token (`<|eot_id|>`, `</s>`, `<|im_end|>`) unless `prev_answer_ids` (all in the
    cache already) ends with it. Images become IMAGE_TOKEN sentinels (`expand_images`).
    """
    text = template.turn_text(expand_images(user_text, n_images), first, system)
    if first:
        return _segment_ids(tokenizer, text, True, None)
    end_id = tokenizer.token_to_id(template.answer_end)
    ids = [end_id] if end_id is not None and (not prev_answer_ids or prev_answer_ids[-1] != end_id) else []
    return ids + _segment_ids(tokenizer, text, False, template.answer_end)


def conversation_ids(tokenizer: Tokenizer, template: Template,
                     turns: list[tuple[str, int, list[int] | None]], system: str | None = None) -> list[int]:
    """Ids of a whole conversation: [(user_text, n_images, answer_ids or None)], only the last
    answer may be None. Defined as the concatenation of `turn_ids` and the answers, so a cache
    built turn by turn equals it at every turn.
    """
    ids: list[int] = []
    prev = None
    for k, (user_text, n_images, answer) in enumerate(turns):
        if prev is None and k > 0:
            raise ValueError(f"turn {k - 1} has no answer but is followed by another turn")
        ids += turn_ids(tokenizer, template, user_text, n_images, k == 0, prev, system)
        ids += list(answer or [])
        prev = answer
    return ids
