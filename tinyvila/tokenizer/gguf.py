"""An HF tokenizer.json and tokenizer_config.json built from a GGUF file's `tokenizer.ggml.*` metadata.

Only llama.cpp's byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizers it
names smollm, llama-bpe, qwen2 and gpt2; `BPETokenizer` (bpe.py) then reads the result. Needs the
third-party `gguf` package, imported where a file is read (an absolute import, so it is that
package and not this module).
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..errors import TokenizerError
from .bpe import LLAMA3_PATTERN, QWEN2_PATTERN, _added_json, _byte_level, _template_processing, bytes_to_unicode


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
    try:
        import gguf
    except ImportError:
        raise TokenizerError(f"{path}: reading a GGUF tokenizer needs the gguf package: pip install gguf") from None

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
