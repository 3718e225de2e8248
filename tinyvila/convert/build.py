"""Any source to a checkpoint in one command: `import` (as stored) and `build` (fully quantized).

    python scripts/quantize.py import SRC DST      # detects the layout (detect.py), runs its importer
    python scripts/quantize.py build SRC DST       # W4A16 LLM + W8A8 vision + the projector as is

`build` stages, each with a progress bar: read SRC in memory as its importer would convert it; the LLM
to W4A16 by the AWQ search on the bundled pydoc text (awq.py), or kept as imported when SRC is already
W4 (llm-awq, AutoAWQ); the vision tower to W8A8 by SmoothQuant calibrated on the photos bundled with
scikit-image (smoothquant.py); then one write. DST appears only when everything succeeded: the
checkpoint is written by loader.save_checkpoint (a temp folder beside DST, renamed at the end), and
the only other files, the tokenizer the AWQ search reads, live in a temp folder beside DST that is
always removed.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from tinyvila.config import VLMConfig
from tinyvila.convert.awq import check_calib, check_group_size, drop_dense_linears, quantize_llm, search_device
from tinyvila.convert.awq_formats import autoawq_checkpoint, awq_v2_checkpoint, import_autoawq, import_awq_v2
from tinyvila.convert.detect import Source, detect
from tinyvila.convert.gguf import gguf_checkpoint, import_gguf
from tinyvila.convert.smoothquant import DEFAULT_ALPHA, image_files, smoothquant
from tinyvila.convert.vila import import_vila, tokenizer_dir, tokenizer_files, vila_config, vila_state_dict
from tinyvila.errors import CheckpointError
from tinyvila.loader import CONFIG, WEIGHTS, _read_tensors, read_headers, save_checkpoint
from tinyvila.vlm import VLM

W4_KINDS = ("vila-awq-v2", "vila-autoawq", "autoawq")  # sources whose LLM is already W4 (imported as is)


def _refuse_dtype(src: Source, dtype: str | None) -> None:
    if dtype is not None:
        raise CheckpointError(f"{src.path}: --dtype does not apply to {src.found}: a W4 import keeps its scales' "
                              f"own precision (fp16), which no other dtype holds exactly")


def import_source(src: str | Path, dst: str | Path, *, dtype: str | None = None, group_size: int = 128,
                  max_seq_len: int | None = None, template: str | None = None, overwrite: bool = False
                  ) -> Path:
    """Detects what `src` is and runs its importer (import-vila, import-awq-v2, import-autoawq, import-gguf)."""
    s = detect(src)
    common = {"max_seq_len": max_seq_len, "template": template, "overwrite": overwrite}
    if s.kind == "vila":
        return import_vila(s.path, dst, dtype=dtype, **common)
    if s.kind == "gguf":
        return import_gguf(s.path, dst, dtype=dtype or "float16", **{**common, "max_seq_len": max_seq_len or 2048})
    if s.kind == "tinyvila":
        raise CheckpointError(f"{s.path}: already a tinyvila checkpoint; pass it to --model as it is, or "
                              f"`python scripts/quantize.py build {s.path} DST` to quantize it")
    _refuse_dtype(s, dtype)
    if s.kind == "vila-awq-v2":
        return import_awq_v2(s.path, dst, group_size=group_size, **common)
    return import_autoawq(s.path, dst, **common)


# -- build ----------------------------------------------------------------------------------------------
def read_source(s: Source, *, dtype: str | None, group_size: int, max_seq_len: int | None, template: str | None
                ) -> tuple[VLMConfig, dict[str, torch.Tensor], dict[str, bytes]]:
    """(config, state dict, extra files) of any source, converted in memory as its importer converts it."""
    if s.kind in W4_KINDS:
        _refuse_dtype(s, dtype)
        if s.kind == "vila-awq-v2":
            return awq_v2_checkpoint(s.path, group_size=group_size, max_seq_len=max_seq_len, template=template)
        return autoawq_checkpoint(s.path, max_seq_len=max_seq_len, template=template)
    if s.kind == "vila":
        cfg = vila_config(s.path, dtype=dtype, max_seq_len=max_seq_len, template=template)
        return cfg, vila_state_dict(s.path, cfg), tokenizer_files(tokenizer_dir(s.path))
    if s.kind == "gguf":
        return gguf_checkpoint(s.path, dtype=dtype or "float16", max_seq_len=max_seq_len or 2048, template=template)
    cfg = VLMConfig.load(s.path)  # a tinyvila checkpoint: quantize what is still dense
    sd = _read_tensors(s.path, read_headers(s.path)[1])
    if dtype is not None and dtype != cfg.dtype:
        raise CheckpointError(f"{s.path}: --dtype {dtype} differs from the checkpoint's {cfg.dtype}; "
                              f"import the source again with --dtype instead")
    extras = {p.name: p.read_bytes() for p in s.path.iterdir() if p.is_file() and p.name != CONFIG
              and p.suffix != ".safetensors" and not p.name.startswith(WEIGHTS)}
    return cfg, sd, extras


def _model(cfg: VLMConfig, sd: dict[str, torch.Tensor], device: str, dtype: torch.dtype | None) -> VLM:
    """The VLM holding `sd` (its tensors, not copies: the searches below change only tensors they replace)."""
    with torch.device("meta"):
        model = VLM(cfg)
    model.load_state_dict(sd, assign=True, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def _check_dst(dst: Path, overwrite: bool) -> None:
    """Fails before hours of search, not after: save_checkpoint checks the same at the end."""
    if dst.exists() and (not dst.is_dir() or (any(dst.iterdir()) and not overwrite)):
        raise FileExistsError(f"{dst}: exists and is not empty; pass --overwrite to replace it")


def build_checkpoint(src: str | Path, dst: str | Path, *, method: str = "awq", group_size: int = 128,
                     calib: Path | None = None, n_samples: int = 8, seqlen: int = 256,
                     calib_images: Path | None = None, n_calib: int = 8, alpha: float | None = DEFAULT_ALPHA,
                     dtype: str | None = None, max_seq_len: int | None = None, template: str | None = None,
                     device: str | None = None, overwrite: bool = False) -> Path:
    """Any source detect.py knows -> the W4A16 (LLM) + W8A8 (vision) checkpoint at `dst`; returns `dst`.

    method/group_size/calib/n_samples/seqlen: the LLM's AWQ search (ignored when the source is already W4);
    calib_images/n_calib/alpha: SmoothQuant's calibration (alpha None: plain round-to-nearest W8A8).
    """
    dst = Path(dst)
    _check_dst(dst, overwrite)
    check_calib(calib)
    s = detect(src)
    if s.kind != "gguf" and s.kind not in W4_KINDS and method not in ("awq", "rtn"):
        raise ValueError(f"--method must be 'awq' or 'rtn', got {method!r}")
    files = image_files(calib_images)[:n_calib]
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dst.name}.build-", dir=dst.parent))
    try:
        with tqdm(total=3, desc="build", unit="stage") as stages:
            stages.set_postfix_str(f"read {s.found}")
            cfg, sd, extras = read_source(s, dtype=dtype, group_size=group_size, max_seq_len=max_seq_len,
                                          template=template)
            stages.update()
            cfg, sd = _quantize(cfg, sd, extras, work, stages, device=device, method=method, group_size=group_size,
                                calib=calib, n_samples=n_samples, seqlen=seqlen, files=files, alpha=alpha)
            stages.set_postfix_str(f"write {dst}")
            out = save_checkpoint(dst, cfg, sd, extras, overwrite=overwrite)
            stages.update()
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _quantize(cfg: VLMConfig, sd: dict, extras: dict, work: Path, stages: tqdm, *, device: str | None, method: str,
              group_size: int, calib: Path | None, n_samples: int, seqlen: int, files: list[Path],
              alpha: float | None) -> tuple[VLMConfig, dict]:
    """The quantization stages on an in-memory checkpoint: W4A16 LLM (when dense), W8A8 vision (when dense)."""
    device, search_dtype = search_device(device)
    model = _model(cfg, sd, device, search_dtype)
    quant = cfg.quant
    if quant.llm == "none":
        stages.set_postfix_str(f"W4A16 LLM ({method}, group {group_size})")
        check_group_size(model.text, group_size, work)
        for name, data in extras.items():  # the tokenizer the calibration text is cut with
            (work / name).write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
        new = quantize_llm(model, work / cfg.tokenizer, method=method, group_size=group_size, calib=calib,
                           n_samples=n_samples, seqlen=seqlen)
        drop_dense_linears(sd)
        sd.update(new)
        quant = dataclasses.replace(quant, llm="w4a16", group_size=group_size)
    if cfg.vision is not None and quant.vision == "none":
        stages.set_postfix_str(f"W8A8 vision (SmoothQuant, {len(files)} images)")
        vision = smoothquant(model.vision, files, alpha, getattr(torch, cfg.dtype), progress=True)
        sd = {k: v for k, v in sd.items() if not k.startswith("vision.")} | {k: v.cpu() for k, v in vision.items()}
        quant = dataclasses.replace(quant, vision="w8a8")
    stages.update()
    return dataclasses.replace(cfg, quant=quant), sd
