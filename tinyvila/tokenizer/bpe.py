"""Pure-Python byte-level BPE that reads a HuggingFace tokenizer.json, with HF `tokenizers` semantics.

Covers the Llama-3, Qwen2 and SmolLM2/GPT-2 configurations: the normalizers, pre-tokenizers
(ByteLevel, Split, Digits), post-processors and BPE options those use; anything else is refused
with the file's name. `byte_tokenizer_json` builds the 256-byte tokenizer.json of synthetic
models; its JSON helpers are shared with gguf.py. Imports only stdlib and `regex`.
"""

from __future__ import annotations

import functools
import unicodedata

import regex

from .base import Tokenizer, _added_from_json, _AddedSplitter

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


def _token_content(tok) -> str:
    """`bos_token` in a tokenizer_config.json is a string or an AddedToken dict."""
    return tok.get("content") if isinstance(tok, dict) else tok


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
        for t, i in [*self.vocab.items(), *((t.content, t.id) for t in self.added)]:  # ids index the embedding
            if not isinstance(t, str) or type(i) is not int or i < 0:
                raise ValueError(f"{source}: token {t!r} has id {i!r}; ids must be non-negative integers")
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
            if 0 <= token_id < self.vocab_size:  # a gap in the ids: no text, as HF's decoders skip unknown ids
                return b""
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        table = _unicode_to_bytes()
        # HF ByteLevel decoder: a token spelled in the byte alphabet maps back to its bytes;
        # any other token (e.g. an added token with a space) stands for its own UTF-8.
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
        return token.encode("utf-8")


# ----------------------------------------------------------------------------------------------
# tokenizer.json builders: the synthetic byte vocabulary, and the JSON pieces gguf.py reuses


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
