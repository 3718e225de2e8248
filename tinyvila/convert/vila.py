"""Import of fp16/bf16 VILA folders (`config.json`, `llm/`, `vision_tower/`, `mm_projector/`).

`import_vila` converts every tensor into the runtime layout without quantizing and fails if any HF
tensor is left unused or used twice. `HFTensors` reads a HF model folder lazily and counts reads, so
the published-format importers (awq_formats.py) prove the same for the parts they take from here.
CLI: `python scripts/quantize.py import-vila SRC DST`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from tqdm import tqdm
from safetensors import SafetensorError, safe_open

from tinyvila.config import VLMConfig
from tinyvila.convert.detect import RAW_KINDS, detect, wrong_layout
from tinyvila.convert.hf import (projector_config_from_hf, projector_weights_from_hf, text_config_from_hf,
                                 text_weights_from_hf, vision_config_from_hf, vision_weights_from_hf)
from tinyvila.errors import CheckpointError
from tinyvila.loader import _ST_DTYPES as ST_DTYPES, save_checkpoint

DTYPES = ("float16", "bfloat16", "float32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json")
# VILA sub-folder -> (its weight mapping, the VLMConfig field it maps with)
PARTS = {"llm": (text_weights_from_hf, "text"), "vision_tower": (vision_weights_from_hf, "vision"),
         "mm_projector": (projector_weights_from_hf, "projector")}


# -- HF weights ---------------------------------------------------------------------------------------
class HFTensors(Mapping):
    """The tensors of one HF model folder, read lazily from its safetensors file(s) on `[]`.

    Counts reads per key, so the importer can prove every tensor was used exactly once. Pickle
    checkpoints (`pytorch_model.bin`) are read with `torch.load(weights_only=True)`, never plain pickle.
    """

    def __init__(self, folder: Path, progress: tqdm | None = None):
        self.folder, self.progress, self.reads = folder, progress, Counter()
        self.where: dict[str, Path] = {}
        self.loaded: dict[str, torch.Tensor] = {}  # only for .bin files, which cannot be read lazily
        for path in _weight_files(folder):
            self._index(path)
        if not self.where:
            raise CheckpointError(f"{folder}: no tensors found (model.safetensors, shards, or pytorch_model.bin)")

    def _index(self, path: Path) -> None:
        if path.suffix == ".bin":
            self.loaded.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
            self.where.update(dict.fromkeys(self.loaded, path))
            return
        try:
            with safe_open(str(path), framework="pt") as f:
                self.where.update(dict.fromkeys(f.keys(), path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors file ({e}); re-download it") from None

    def __getitem__(self, key: str) -> torch.Tensor:
        path = self.where[key]
        self.reads[key] += 1
        if self.progress is not None:
            self.progress.update()
        if key in self.loaded:
            return self.loaded[key]
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)

    def dtype(self, key: str) -> torch.dtype:
        """A tensor's dtype from the file header, without reading it (not counted as a read)."""
        if key in self.loaded:
            return self.loaded[key].dtype
        with safe_open(str(self.where[key]), framework="pt") as f:
            return ST_DTYPES[f.get_slice(key).get_dtype()]

    def __contains__(self, key: object) -> bool:
        return key in self.where  # Mapping's default would call __getitem__ and count a read

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def _weight_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder: an index's shards, else the single file, else every shard."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text())["weight_map"]
            files = [folder / f for f in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{folder / index}: lists shards that are missing: {', '.join(missing)}")
            return files
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return [folder / single]
    return sorted(folder.glob("*.safetensors"))


def account(name: str, hf: HFTensors, used: set[str]) -> list[str]:
    """Problems with how `name`'s HF tensors were used: each must be read once or dropped on purpose."""
    problems = [f"{name}: {k}: never used (not mapped, not a known dropped tensor)" for k in hf if k not in used]
    problems += [f"{name}: {k}: claimed as used but not in the checkpoint" for k in used if k not in hf]
    problems += [f"{name}: {k}: read {n} times" for k, n in hf.reads.items() if n > 1]
    return problems


# -- configs and tokenizer files -------------------------------------------------------------------
def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found; is {path.parent} part of a VILA checkpoint folder?") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def source_dtype(hf_cfg: dict) -> str:
    """The LLM's stored dtype (`torch_dtype` in transformers 4, `dtype` in 5), float16 if unknown."""
    dt = str(hf_cfg.get("torch_dtype") or hf_cfg.get("dtype") or "float16").removeprefix("torch.")
    return dt if dt in DTYPES else "float16"


def eos_ids(folder: Path, hf_cfg: dict) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's eos_token_id (an int or a list) when the file
    exists, else config.json's."""
    gen = folder / "generation_config.json"
    eos = read_json(gen).get("eos_token_id") if gen.is_file() else hf_cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)


def detect_template(tok_dir: Path) -> str:
    """llama_3 for a Llama-3 tokenizer.json, vicuna_v1 for a sentencepiece (Llama-2) tokenizer."""
    tj = tok_dir / "tokenizer.json"
    if tj.is_file() and "<|begin_of_text|>" in tj.read_text(encoding="utf-8"):
        return "llama_3"
    if (tok_dir / "tokenizer.model").is_file():
        return "vicuna_v1"
    raise CheckpointError(f"{tok_dir}: cannot tell the chat template from the tokenizer files; pass --template")


def tokenizer_dir(src: Path) -> Path:
    for d in (src / "llm", src):
        if (d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file():
            return d
    raise CheckpointError(f"{src}: no tokenizer.json or tokenizer.model in {src / 'llm'} or {src}")


def tokenizer_files(tok_dir: Path) -> dict[str, bytes]:
    """The tokenizer files of `tok_dir` that a checkpoint carries, by name."""
    return {f: (tok_dir / f).read_bytes() for f in TOKENIZER_FILES if (tok_dir / f).is_file()}


def _check_top(top: dict, path: Path) -> None:
    """VILA options this runtime does not implement are errors, never silently ignored."""
    for key in ("mm_vision_select_layer", "mm_vision_select_feature"):
        if key not in top:
            raise CheckpointError(f"{path}: missing {key!r}; is this a VILA (llava_llama) config?")
    if top.get("image_aspect_ratio", "resize") != "resize":
        raise CheckpointError(f"{path}: image_aspect_ratio {top['image_aspect_ratio']!r} is not supported "
                              f"(only 'resize', as VILA1.5 uses)")
    if top.get("s2"):
        raise CheckpointError(f"{path}: s2 (multi-scale vision) is not supported")


def vila_config(src: Path, *, dtype: str | None = None, max_seq_len: int | None = None,
                template: str | None = None) -> VLMConfig:
    """The VLMConfig of a VILA folder: top config.json + llm/ + vision_tower/ + mm_projector/ configs."""
    top = read_json(src / "config.json")
    _check_top(top, src / "config.json")
    llm = read_json(src / "llm" / "config.json")
    text = text_config_from_hf(llm, max_seq_len=max_seq_len)
    vision = vision_config_from_hf(
        read_json(src / "vision_tower" / "config.json"), select_layer=top["mm_vision_select_layer"],
        select_feature=top["mm_vision_select_feature"],
        preprocessor=read_json(src / "vision_tower" / "preprocessor_config.json"))
    for key, ours in (("hidden_size", text.dim), ("mm_hidden_size", vision.dim)):
        if key in top and top[key] != ours:
            raise CheckpointError(f"{src / 'config.json'}: {key} {top[key]} disagrees with the sub-model configs ({ours})")
    projector = projector_config_from_hf(read_json(src / "mm_projector" / "config.json"), vision.dim, text.dim)
    tok_dir = tokenizer_dir(src)
    template = template or detect_template(tok_dir)
    sp = (tok_dir / "tokenizer.model").is_file() and (template != "llama_3" or not (tok_dir / "tokenizer.json").is_file())
    return VLMConfig(text=text, vision=vision, projector=projector, template=template,
                     dtype=dtype or source_dtype(llm), tokenizer="tokenizer.model" if sp else "tokenizer.json",
                     eos_ids=eos_ids(src / "llm", llm))


# -- weights ---------------------------------------------------------------------------------------
def vila_state_dict(src: Path, cfg: VLMConfig, parts: tuple[str, ...] = tuple(PARTS)) -> dict[str, torch.Tensor]:
    """The tensors of the VILA sub-folders `parts` in the tinyvila layout and `cfg.dtype`; raises
    CheckpointError listing HF tensors left unused or used twice."""
    sources = {name: HFTensors(src / name) for name in parts}
    sd, problems = {}, []
    with tqdm(total=sum(len(s) for s in sources.values()), desc="import", unit="tensor") as progress:
        for name, hf in sources.items():
            convert, field = PARTS[name]
            hf.progress = progress
            out, used = convert(hf, getattr(cfg, field))
            problems += account(name, hf, used)
            sd.update(out)
    if problems:
        raise CheckpointError(f"{src}: HF tensors not accounted for exactly once:\n  " + "\n  ".join(problems))
    dt = getattr(torch, cfg.dtype)
    return {k: v.to(dt) if v.is_floating_point() else v for k, v in sd.items()}


def import_vila(src: str | Path, dst: str | Path, *, dtype: str | None = None, max_seq_len: int | None = None,
                template: str | None = None, overwrite: bool = False) -> Path:
    """Imports an fp16/bf16 VILA folder into a dense tinyvila checkpoint at `dst`; returns `dst`."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: VILA folder not found")
    if detect(src).kind != "vila":
        raise wrong_layout(src, "import-vila", RAW_KINDS["vila"][0])
    cfg = vila_config(src, dtype=dtype, max_seq_len=max_seq_len, template=template)
    sd = vila_state_dict(src, cfg)
    return save_checkpoint(dst, cfg, sd, tokenizer_files(tokenizer_dir(src)), overwrite=overwrite)
