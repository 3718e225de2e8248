"""What a source path holds, and the quantize.py command that converts it.

    detect(path) -> Source(kind, path, found)      # raises CheckpointError for a layout no importer reads

Kinds: "vila" (fp16/bf16 VILA1.5 folder: config.json, llm/, vision_tower/, mm_projector/), "vila-awq-v2"
(the published AWQ folders: llm/ holding a *-w4-g128-awq-v2.pt), "vila-autoawq" (a VILA folder whose
llm/ is AutoAWQ GEMM), "autoawq" (a bare AutoAWQ GEMM LLM), "gguf" (a .gguf file, or a folder holding
exactly one), "tinyvila" (already a checkpoint). Only json, pathlib and the config files are read, so
tinyvila.loader may ask from its error path why a folder is not a checkpoint (`raw_source_hint`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from tinyvila.errors import CheckpointError

RAW_KINDS = {  # kind -> (what it is, the explicit subcommand that imports it)
    "vila": ("an fp16/bf16 VILA folder (config.json, llm/, vision_tower/, mm_projector/)", "import-vila"),
    "vila-awq-v2": ("a VILA AWQ folder (llm/ holding an llm-awq *-w4-g128-awq-v2.pt, vision_tower/, "
                    "mm_projector/)", "import-awq-v2"),
    "vila-autoawq": ("a VILA folder whose llm/ is AutoAWQ GEMM (vision_tower/, mm_projector/ beside it)",
                     "import-autoawq"),
    "autoawq": ("an AutoAWQ GEMM LLM folder (config.json with an AWQ quantization_config)", "import-autoawq"),
    "gguf": ("a GGUF file", "import-gguf"),
}
EXPECTED = ("a VILA1.5 folder (config.json, llm/, vision_tower/, mm_projector/; llm/ fp16/bf16 safetensors, an "
            "llm-awq *-v2.pt or AutoAWQ GEMM), an AutoAWQ GEMM LLM folder, a .gguf file, or a tinyvila checkpoint")


class Source(NamedTuple):
    """A recognised source: its kind, the path its importer takes, and what was found, in words."""

    kind: str
    path: Path
    found: str


def _json(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _awq_quantized(cfg: dict | None) -> bool:
    qc = (cfg or {}).get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method", "awq") == "awq"


def _file(path: Path) -> Source:
    if path.suffix == ".gguf":
        return Source("gguf", path, f"{RAW_KINDS['gguf'][0]} ({path.name})")
    if path.name.endswith("-v2.pt"):
        folder = path.parent.parent if path.parent.name == "llm" else path.parent
        raise CheckpointError(f"{path}: the llm-awq .pt file of a VILA AWQ folder; pass the folder itself "
                              f"({folder}: config.json, llm/ holding this file, vision_tower/, mm_projector/)")
    raise CheckpointError(f"{path}: a file, not a model; expected {EXPECTED}")


def _vila(path: Path) -> Source:
    llm = path / "llm"
    missing = [d for d in ("vision_tower", "mm_projector") if not (path / d).is_dir()]
    if list(llm.glob("*-v2.pt")):
        kind = "vila-awq-v2"
    elif _awq_quantized(_json(llm / "config.json")):
        kind = "vila-autoawq"
    else:
        kind = "vila"
    if missing or not (path / "config.json").is_file():
        lacks = [*missing, *(["config.json"] if not (path / "config.json").is_file() else [])]
        raise CheckpointError(f"{path}: has llm/ but no {', '.join(lacks)}; expected {RAW_KINDS[kind][0]}")
    return Source(kind, path, RAW_KINDS[kind][0])


def detect(path: str | Path) -> Source:
    """What `path` holds; raises CheckpointError naming the path, what was found and what was expected."""
    path = Path(path)
    if path.is_file():
        return _file(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not found; expected {EXPECTED}")
    if (path / "llm").is_dir():
        return _vila(path)
    cfg = _json(path / "config.json")
    if cfg is not None and "text" in cfg and "model_type" not in cfg:
        return Source("tinyvila", path, "a tinyvila checkpoint")
    if _awq_quantized(cfg):
        return Source("autoawq", path, RAW_KINDS["autoawq"][0])
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return Source("gguf", ggufs[0], f"{RAW_KINDS['gguf'][0]} ({ggufs[0].name})")
    found = (f"{len(ggufs)} .gguf files (pass one)" if ggufs else
             f"an HF model config (model_type {cfg.get('model_type')!r}) without llm/ or an AWQ quantization_config"
             if cfg is not None and "model_type" in cfg else
             f"{'a config.json that is not valid JSON' if (path / 'config.json').is_file() else 'no config.json'}")
    raise CheckpointError(f"{path}: found {found}; expected {EXPECTED}")


def _slug(src: Source) -> str:
    name = src.path.stem if src.kind == "gguf" else src.path.name
    return name.lower().replace("_", "-") or "model"


def commands(src: Source, dst: str | Path | None = None) -> list[str]:
    """The quantize.py lines that turn `src` into a checkpoint: `build` (quantized), then `import` (as stored)."""
    slug = _slug(src)
    built = Path(dst) if dst is not None else Path("checkpoints") / (slug if slug.endswith("-awq") else f"{slug}-awq")
    imported = Path(dst) if dst is not None else Path("checkpoints") / slug
    return [f"python scripts/quantize.py build {src.path} {built}   # quantized: W4A16 LLM, W8A8 vision",
            f"python scripts/quantize.py import {src.path} {imported}   # as stored ({RAW_KINDS[src.kind][1]})"]


def raw_source_hint(path: str | Path) -> str | None:
    """For a path that is a raw source (not a tinyvila checkpoint): what it is and the exact commands that
    convert it; None when it is no source we know."""
    try:
        src = detect(path)
    except CheckpointError:
        return None
    if src.kind not in RAW_KINDS:
        return None
    lines = "\n  ".join(commands(src))
    return (f"{path} is {src.found}, not a tinyvila checkpoint. Convert it once, then pass the new folder "
            f"(or its name) to --model:\n  {lines}")


def wrong_layout(path: str | Path, command: str, wanted: str) -> CheckpointError:
    """The error for `quantize.py COMMAND` given a source of another layout: what was found, what the
    command expects, and the command that reads what was found."""
    try:
        src = detect(path)
        found, fix = src.found, (f"use `python scripts/quantize.py {RAW_KINDS[src.kind][1]}` or `import`"
                                 if src.kind in RAW_KINDS else "it needs no import")
    except CheckpointError as e:
        found, fix = str(e).split(": ", 1)[-1], "see `python scripts/quantize.py import --help`"
    return CheckpointError(f"{path}: {command} expects {wanted}; found {found}; {fix}")
