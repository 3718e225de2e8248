"""Tokenizers, VILA chat templates, `<image>` expansion and streaming UTF-8 decoding.

base.py holds the `Tokenizer` interface and `StreamDecoder`; bpe.py a pure-Python byte-level BPE
reading HF tokenizer.json; sentencepiece.py a wrapper of `sentencepiece` for tokenizer.model;
gguf.py builds a tokenizer.json from a GGUF; templates.py the chat templates and id-level prompts.
`load_tokenizer` below picks among them. Imports only stdlib, `regex`, `sentencepiece` (and
`gguf` when a GGUF is read). Tests: tests/test_tokenizer.py, tests/test_templates.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import TinyVilaError, TokenizerError
from .base import IMAGE_TOKEN, AddedToken, StreamDecoder, Tokenizer
from .bpe import GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, BPETokenizer, byte_tokenizer_json, bytes_to_unicode
from .gguf import tokenizer_config_from_gguf, tokenizer_json_from_gguf
from .sentencepiece import SentencePieceTokenizer
from .templates import (
    IMAGE_PLACEHOLDER, TEMPLATES, Template, conversation_ids, expand_images, get_template, stop_ids,
    tokenizer_image_token, turn_ids,
)

__all__ = [
    "IMAGE_TOKEN", "IMAGE_PLACEHOLDER", "GPT2_PATTERN", "LLAMA3_PATTERN", "QWEN2_PATTERN", "TEMPLATES",
    "AddedToken", "BPETokenizer", "SentencePieceTokenizer", "StreamDecoder", "Template", "Tokenizer",
    "byte_tokenizer_json", "bytes_to_unicode", "conversation_ids", "expand_images", "get_template",
    "load_tokenizer", "stop_ids", "tokenizer_config_from_gguf", "tokenizer_image_token",
    "tokenizer_json_from_gguf", "turn_ids",
]


def _read_json(path: Path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, a nesting past the stack
        raise ValueError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None


SMOKE_TEXT = "Hello, world! 123 \u00e9\u65e5\U0001f600 <image>\n"


def load_tokenizer(path: str | Path, legacy: bool = False) -> Tokenizer:
    """Tokenizer from a folder (tokenizer.json preferred, else tokenizer.model) or a file.

    A file may be tokenizer.json, a sentencepiece *.model or a GGUF (its embedded vocabulary).
    tokenizer_config.json beside it is read when present. `legacy` only matters for sentencepiece.
    The tokenizer encodes and decodes a sample text before it is returned, so a broken file fails here,
    not mid-answer. Every problem raises `TokenizerError` naming the file.
    """
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return load_tokenizer(path / name, legacy)
        raise TokenizerError(f"no tokenizer.json or tokenizer.model in {path}; copy the LLM's tokenizer files there")
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer file not found; copy the LLM's tokenizer file there")
    try:
        tok = _read_tokenizer(path, legacy)
        tok.decode(tok.encode(SMOKE_TEXT))
        return tok
    except TinyVilaError:
        raise
    except Exception as e:  # noqa: BLE001 -- any fault of parsing an untrusted file (json, regex, sentencepiece)
        msg = str(e) if str(path) in str(e) else f"{path}: {type(e).__name__}: {e}"
        raise TokenizerError(f"{msg}\nnot a usable tokenizer; copy the original model's tokenizer file there "
                             "(or rebuild the checkpoint with scripts/quantize.py)") from None


def _read_tokenizer(path: Path, legacy: bool) -> Tokenizer:
    config_path = path.parent / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else None
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"{config_path}: not a JSON object")
    if path.suffix == ".gguf":
        return BPETokenizer(tokenizer_json_from_gguf(path), str(path), tokenizer_config_from_gguf(path))
    if path.suffix == ".json":
        spec = _read_json(path)
        if not isinstance(spec, dict):
            raise ValueError(f"{path}: not a JSON object")
        return BPETokenizer(spec, str(path), config)
    return SentencePieceTokenizer(path, config, legacy)
