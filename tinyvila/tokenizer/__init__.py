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


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-export the {what}") from None


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
