"""Seeded fuzzing of `tinyvila.load`: corrupt the demo checkpoint's files, expect only clear errors.

Run: pytest tests/test_fuzz_load.py (350 cases, about 5 s on one CPU core). The demo-sized checkpoint is built once;
each case copies it, applies one seeded mutation to the safetensors header, config.json, tokenizer.json
or a sentencepiece tokenizer.model, and loads it. A failure must be a `TinyVilaError` whose message
names the mutated file (and, for a config value, the field). A mutation that loads must give a model that
answers: an image and a question give finite logits, or a `TinyVilaError` (e.g. a tiny context).
"""

import copy
import io
import json
import math
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import tinyvila
from tinyvila.api import DEMO_PRESET
from tinyvila.errors import TinyVilaError
from tinyvila.loader import WEIGHTS, build_synthetic

N_CASES = 100  # per family: header, config, tokenizer.json; sentencepiece gets 50
POOL = ["x", "", -1, 0, 1, 3, 0.5, -0.5, 512.5, 10**12, 1e308, math.nan, math.inf, None, True, False, [], [1, "a"],
        {}, {"a": 1}, "llama", "mistral", "float64", "../x", "/etc/passwd", 2**70]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return build_synthetic(tmp_path_factory.mktemp("fuzz") / "demo", DEMO_PRESET, seed=0)


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    """A small sentencepiece model (trained in ~50 ms), for checkpoints whose tokenizer is tokenizer.model."""
    spm = pytest.importorskip("sentencepiece")
    import pydoc_data.topics

    text = "\n".join(list(pydoc_data.topics.topics.values())[:5])[:20000]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_writer=out, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.99,
                                   normalization_rule_name="identity", minloglevel=2)
    return out.getvalue()


# -- JSON trees: every (container, key) place, and seeded edits of one of them -------------------------
def _places(node, out, field=None, depth=0):
    """[(container, key, name of the nearest enclosing dict key)] of every value under `node`."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        name = k if isinstance(node, dict) else field
        out.append((node, k, name))
        if depth < 6:
            _places(v, out, name, depth + 1)
    return out


def _edit_json(tree, rng: random.Random, skip=()) -> str:
    """One seeded edit of `tree` in place: set a value to a pool value, delete a key, or add one. Returns the
    field an error should name."""
    container, key, field = rng.choice([p for p in _places(tree, []) if p[1] not in skip])
    op = rng.random()
    if op < 0.7:
        container[key] = copy.deepcopy(rng.choice(POOL))
    elif op < 0.85 and isinstance(container, dict):
        del container[key]
    elif isinstance(container, dict):
        container["bogus_field"] = 1
        return "bogus_field"
    else:
        container.append(rng.choice(POOL))
    return field


# -- the mutations: each returns (file that must be named, field that should be named or None) ---------
def _header_mutation(folder: Path, rng: random.Random):
    data = (folder / WEIGHTS).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    kind = rng.randrange(5)
    if kind == 0:  # a byte of the JSON text
        raw = bytearray(data)
        raw[8 + rng.randrange(n)] = rng.choice(b'{}[]",:0 aZ\x00\xff')
        out = bytes(raw)
    elif kind == 1:  # the length prefix
        size = rng.choice([0, 1, n - 1, n + 1, len(data), 2**63, 2**64 - 1, rng.randrange(2**32)])
        out = struct.pack("<Q", size) + data[8:]
    elif kind == 2:  # cut anywhere up to just past the header
        out = data[:rng.randrange(8 + n + 64)]
    else:  # a structural edit of the header JSON (dtype, shape, data_offsets, names), re-serialised
        if kind == 3:
            name = rng.choice([k for k in header if k != "__metadata__"])
            field = rng.choice(["dtype", "shape", "data_offsets"])
            header[name][field] = rng.choice([*POOL, "F8_E4M3", "I4", [1, 2, 3], [-1], [0, 10**15], [5, 1]])
        else:
            _edit_json(header, rng)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        out = struct.pack("<Q", len(text)) + text + body
    (folder / WEIGHTS).write_bytes(out)
    return WEIGHTS, None


def _config_mutation(folder: Path, rng: random.Random):
    path = folder / "config.json"
    if rng.random() < 0.1:  # not JSON at all
        text = path.read_text()
        path.write_text(text[:rng.randrange(len(text))])
        return "config.json", None
    cfg = json.loads(path.read_text())
    field = _edit_json(cfg, rng)
    path.write_text(json.dumps(cfg))
    return "config.json", field


def _tokenizer_mutation(folder: Path, rng: random.Random):
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    kind = rng.randrange(8)
    if kind == 0:
        path.write_bytes(path.read_bytes()[:rng.randrange(200)] + rng.choice([b"", b"\xff\xfe"]))
    elif kind == 1:  # an added token past the model's vocabulary, or of a wrong type
        tok["added_tokens"][rng.randrange(len(tok["added_tokens"]))]["id"] = rng.choice([512, 10**6, -5, "7", None])
    elif kind == 2:  # a vocabulary entry past the model's vocabulary, or of a wrong type
        tok["model"]["vocab"][rng.choice(list(tok["model"]["vocab"]))] = rng.choice([600, -1, "a", 1.5, None])
    elif kind == 3:  # pre-tokenizers: a broken regex, a deep nesting, an unknown type
        tok["pre_tokenizer"] = rng.choice([
            {"type": "Split", "pattern": {"Regex": "(["}, "behavior": "Isolated"},
            {"type": "Split", "pattern": "x"}, {"type": "Sequence", "pretokenizers": 3}, {"type": "Whitespace"},
            "deep"])
    elif kind == 4:
        tok["model"]["merges"] = rng.choice([["a"], [1, 2], [["a", "b", "c"]], "ab", [None]])
    else:
        _edit_json(tok, rng, skip=set(tok["model"]["vocab"]))
        path.write_text(json.dumps(tok))
        return "tokenizer.json", None
    if kind:  # "deep": pre-tokenizers nested past Python's recursion limit
        deep = '{"type": "Sequence", "pretokenizers": [' * 3000 + '{"type": "ByteLevel"}' + "]}" * 3000
        path.write_text(json.dumps(tok).replace('"deep"', deep))
    return "tokenizer.json", None


def _sentencepiece_mutation(folder: Path, rng: random.Random, model: bytes):
    raw = bytearray(model)
    kind = rng.randrange(4)
    if kind == 0:
        raw = raw[:rng.randrange(len(raw))]
    elif kind == 1:
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif kind == 2:
        raw = bytearray(rng.randbytes(rng.randrange(1, 4000)))
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(bytes(raw))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tokenizer"] = "tokenizer.model"
    (folder / "config.json").write_text(json.dumps(cfg))
    return "tokenizer.model", None


CASES = ([("header", i) for i in range(N_CASES)] + [("config", i) for i in range(N_CASES)]
         + [("tokenizer", i) for i in range(N_CASES)] + [("sentencepiece", i) for i in range(N_CASES // 2)])


def _check_usable(vlm) -> None:
    """A checkpoint that loaded answers an image and a question with finite logits, or says clearly why not."""
    chat = vlm.chat(sampling=tinyvila.SamplingParams(max_new_tokens=2))
    try:
        chat.add_image(np.full((20, 30, 3), 128, np.uint8))
        "".join(chat.ask("hi"))
    except TinyVilaError:
        return
    assert chat.last_logits is not None and bool(chat.last_logits.isfinite().all()), "non-finite logits"


@pytest.mark.parametrize("family,seed", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_corrupt_checkpoint_fails_clearly(demo, sp_model, tmp_path, family, seed):
    folder = Path(shutil.copytree(demo, tmp_path / "ck"))
    rng = random.Random(f"{family}-{seed}")
    if family == "sentencepiece":
        fname, field = _sentencepiece_mutation(folder, rng, sp_model)
    else:
        fname, field = {"header": _header_mutation, "config": _config_mutation,
                        "tokenizer": _tokenizer_mutation}[family](folder, rng)
    try:
        vlm = tinyvila.load(folder)
    except TinyVilaError as e:
        msg = str(e)
        assert fname in msg, f"error does not name {fname}: {msg}"
        assert field is None or field in msg or "weights do not match" in msg, f"error does not name {field}: {msg}"
        return
    _check_usable(vlm)
