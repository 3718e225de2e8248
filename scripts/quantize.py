"""Build tinyvila checkpoints (docs/checkpoint_format.md).

    python scripts/quantize.py import-vila SRC DST [--dtype bfloat16] [--max-seq-len 4096] [--template llama_3]
    python scripts/quantize.py synthetic --preset tiny-siglip-llama DST [--seed 0] [--quant w4a16 --group-size 128]
    python scripts/quantize.py smoothquant-vision SRC DST [--alpha 0.5] [--calib DIR]   # W8A8 vision checkpoint

`import-vila` converts an fp16/bf16 VILA folder (`config.json`, `llm/`, `vision_tower/`, `mm_projector/`)
into the runtime layout without quantizing, and fails if any HF tensor is left unused or used twice.
`synthetic` writes random weights in a preset's shapes. Each subcommand is one entry of COMMANDS
(arguments + run function), so quantizing subcommands slot in beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tinyvila.config import PRESETS, VLMConfig
from tinyvila.errors import CheckpointError, TinyVilaError
from tinyvila.loader import build_synthetic, save_checkpoint
from tinyvila.projector import projector_config_from_hf, projector_weights_from_hf
from tinyvila.text import text_config_from_hf, text_weights_from_hf
from tinyvila.vision import vision_config_from_hf, vision_weights_from_hf

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules of the subcommands below
import awq_quant  # noqa: E402
import importers  # noqa: E402
import smoothquant  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json")


# -- progress ---------------------------------------------------------------------------------------
class Progress:
    """tqdm when installed (it is not a dependency), else a counter printed every 10%."""

    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="tensor")
        except ImportError:
            self.bar = None
        self.total, self.desc, self.n, self.shown = total, desc, 0, -1

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            return
        tenth = 10 * self.n // max(self.total, 1)
        if tenth != self.shown:
            self.shown = tenth
            print(f"{self.desc}: {self.n}/{self.total} tensors", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- HF weights ---------------------------------------------------------------------------------------
class HFTensors(Mapping):
    """The tensors of one HF model folder, read lazily from its safetensors file(s) on `[]`.

    Counts reads per key, so the importer can prove every tensor was used exactly once. Pickle
    checkpoints (`pytorch_model.bin`) are read with `torch.load(weights_only=True)`, never plain pickle.
    """

    def __init__(self, folder: Path, progress: Progress | None = None):
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


# -- import-vila ---------------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found; is {path.parent} part of a VILA checkpoint folder?") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def _source_dtype(llm_cfg: dict) -> str:
    """The LLM's stored dtype (`torch_dtype` in transformers 4, `dtype` in 5), float16 if unknown."""
    dt = str(llm_cfg.get("torch_dtype") or llm_cfg.get("dtype") or "float16").removeprefix("torch.")
    return dt if dt in DTYPES else "float16"


def detect_template(tok_dir: Path) -> str:
    """llama_3 for a Llama-3 tokenizer.json, vicuna_v1 for a sentencepiece (Llama-2) tokenizer."""
    tj = tok_dir / "tokenizer.json"
    if tj.is_file() and "<|begin_of_text|>" in tj.read_text(encoding="utf-8"):
        return "llama_3"
    if (tok_dir / "tokenizer.model").is_file():
        return "vicuna_v1"
    raise CheckpointError(f"{tok_dir}: cannot tell the chat template from the tokenizer files; pass --template")


def _tokenizer_dir(src: Path) -> Path:
    for d in (src / "llm", src):
        if (d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file():
            return d
    raise CheckpointError(f"{src}: no tokenizer.json or tokenizer.model in {src / 'llm'} or {src}")


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
    top = _read_json(src / "config.json")
    _check_top(top, src / "config.json")
    llm = _read_json(src / "llm" / "config.json")
    text = text_config_from_hf(llm, max_seq_len=max_seq_len)
    vision = vision_config_from_hf(
        _read_json(src / "vision_tower" / "config.json"), select_layer=top["mm_vision_select_layer"],
        select_feature=top["mm_vision_select_feature"],
        preprocessor=_read_json(src / "vision_tower" / "preprocessor_config.json"))
    for key, ours in (("hidden_size", text.dim), ("mm_hidden_size", vision.dim)):
        if key in top and top[key] != ours:
            raise CheckpointError(f"{src / 'config.json'}: {key} {top[key]} disagrees with the sub-model configs ({ours})")
    projector = projector_config_from_hf(_read_json(src / "mm_projector" / "config.json"), vision.dim, text.dim)
    tok_dir = _tokenizer_dir(src)
    template = template or detect_template(tok_dir)
    sp = (tok_dir / "tokenizer.model").is_file() and (template != "llama_3" or not (tok_dir / "tokenizer.json").is_file())
    gen = src / "llm" / "generation_config.json"
    eos = _read_json(gen).get("eos_token_id") if gen.is_file() else llm.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
    return VLMConfig(text=text, vision=vision, projector=projector, template=template,
                     dtype=dtype or _source_dtype(llm), tokenizer="tokenizer.model" if sp else "tokenizer.json",
                     eos_ids=eos_ids)


def vila_state_dict(src: Path, cfg: VLMConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the VILA folder in the tinyvila layout and `cfg.dtype`; raises CheckpointError
    listing HF tensors left unused or used twice."""
    parts: list[tuple[str, Callable, object]] = [
        ("llm", text_weights_from_hf, cfg.text), ("vision_tower", vision_weights_from_hf, cfg.vision),
        ("mm_projector", projector_weights_from_hf, cfg.projector)]
    progress = Progress(0, "import")
    sources = {name: HFTensors(src / name, progress) for name, _, _ in parts}
    progress.total = sum(len(s) for s in sources.values())
    sd, problems = {}, []
    try:
        for name, convert, sub_cfg in parts:
            out, used = convert(sources[name], sub_cfg)
            problems += account(name, sources[name], used)
            sd.update(out)
    finally:
        progress.close()
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
    cfg = vila_config(src, dtype=dtype, max_seq_len=max_seq_len, template=template)
    sd = vila_state_dict(src, cfg)
    tok_dir = _tokenizer_dir(src)
    extras = {f: (tok_dir / f).read_bytes() for f in TOKENIZER_FILES if (tok_dir / f).is_file()}
    return save_checkpoint(dst, cfg, sd, extras, overwrite=overwrite)


# -- commands -----------------------------------------------------------------------------------------
def _args_import_vila(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", type=Path, help="VILA folder with config.json, llm/, vision_tower/, mm_projector/")
    p.add_argument("dst", type=Path, help="tinyvila checkpoint folder to write")
    p.add_argument("--dtype", choices=DTYPES, help="storage dtype (default: the LLM's own)")
    p.add_argument("--max-seq-len", type=int, help="declared context (default: from the LLM config)")
    p.add_argument("--template", help="chat template (default: from the tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dst")


def _run_import_vila(a: argparse.Namespace) -> Path:
    return import_vila(a.src, a.dst, dtype=a.dtype, max_seq_len=a.max_seq_len, template=a.template,
                       overwrite=a.overwrite)


def _args_synthetic(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("dst", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, help="storage dtype (default: the preset's)")
    p.add_argument("--quant", choices=("none", "w4a16"), default="none",
                   help="w4a16: the LLM linears as packed W4 (random dense weights, round-to-nearest)")
    p.add_argument("--group-size", type=int, default=128, help="W4 group size: 32, 64 or 128")
    p.add_argument("--overwrite", action="store_true")


def _run_synthetic(a: argparse.Namespace) -> Path:
    cfg = PRESETS[a.preset] if a.dtype is None else dataclasses.replace(PRESETS[a.preset], dtype=a.dtype)
    if a.quant != "none":
        cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, llm=a.quant, group_size=a.group_size))
    return build_synthetic(a.dst, cfg, a.seed, overwrite=a.overwrite)


# name -> (help, add arguments, run). Quantizing subcommands are added here.
COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "import-vila": ("import an fp16/bf16 VILA folder without quantizing", _args_import_vila, _run_import_vila),
    "synthetic": ("random weights in a preset's shapes", _args_synthetic, _run_synthetic),
    "awq": ("W4A16-quantize a dense checkpoint's LLM (AWQ search, or --method rtn)", awq_quant.args_awq,
            awq_quant.run_awq),
    "import-awq-v2": ("repack a VILA AWQ folder (llm-awq *-w4-g128-awq-v2.pt)", importers.args_awq_v2,
                      importers.run_awq_v2),
    "import-autoawq": ("repack an AutoAWQ GEMM model (safetensors)", importers.args_autoawq, importers.run_autoawq),
    "import-gguf": ("dequantize a llama GGUF (e.g. SmolLM2) to a dense checkpoint", importers.args_gguf,
                    importers.run_gguf),
    "smoothquant-vision": ("W8A8-quantize a vision checkpoint with SmoothQuant calibration",
                           smoothquant.args_smoothquant_vision, smoothquant.run_smoothquant_vision),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        folder = COMMANDS[args.command][2](args)
    except (TinyVilaError, FileExistsError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
