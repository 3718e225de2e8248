"""A wrapper of the `sentencepiece` library for `tokenizer.model` (Llama-2 family).

Special tokens are split out of the text like transformers' slow `LlamaTokenizer`; the model
without its dummy prefix is made by editing the ModelProto bytes by hand, so protobuf is not
needed. The third-party `sentencepiece` package is imported where a model is loaded (an
absolute import, so it is that package and not this module).
"""

from __future__ import annotations

from pathlib import Path

from .base import AddedToken, Tokenizer, _added_from_json, _AddedSplitter


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
