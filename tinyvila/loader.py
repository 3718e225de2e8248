"""Checkpoint folders (docs/checkpoint_format.md) <-> models: load, save, and synthetic weights.

`load_model` builds the `VLM` on the meta device, reads only the safetensors headers to check every
tensor's name, shape and dtype against the model, and only then memory-maps the data in with
`load_state_dict(assign=True)`. `save_checkpoint` writes a folder atomically (temp folder + rename),
sharding large state dicts. `random_state_dict` / `build_synthetic` make random-weight checkpoints
in any config's shapes for tests and the offline demo. The model itself is the one source of truth
for which tensors a config needs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import VLMConfig, preset
from .errors import CheckpointError, DeviceError, ModelNotFoundError, TokenizerError
from .quant import quantize_w4
from .tokenizer import Tokenizer, load_tokenizer
from .vlm import VLM

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DEFAULT_SHARD_BYTES = 4 * 2**30  # files under 4 GiB: what HF tooling and 32-bit offsets handle
MAX_LISTED = 20  # problems named in one error message; the rest are counted

# safetensors header dtype codes -> torch dtypes (the ones a tinyvila checkpoint may hold).
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

Spec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one tensor


def _hint(folder: Path) -> str:
    return (f"rebuild it with `python scripts/quantize.py import-vila SRC {folder}` "
            f"(or `python scripts/quantize.py synthetic --preset NAME {folder}` for random weights)")


def _fail(folder: Path, what: str, problems: list[str]) -> CheckpointError:
    """One error listing every problem found (the first MAX_LISTED of them) and what to do."""
    lines = problems[:MAX_LISTED]
    if len(problems) > MAX_LISTED:
        lines.append(f"... and {len(problems) - MAX_LISTED} more")
    return CheckpointError(f"{folder}: {what}:\n  " + "\n  ".join(lines) + f"\n{_hint(folder)}")


def _meta_model(cfg: VLMConfig) -> VLM:
    with torch.device("meta"):
        return VLM(cfg)


def expected_tensors(cfg: VLMConfig, model: VLM | None = None) -> dict[str, Spec]:
    """Name -> (shape, dtype) of every tensor a checkpoint of `cfg` holds, read off `VLM(cfg)`.

    Floating tensors are stored in `cfg.dtype`; others (packed integer weights) keep the module's dtype,
    and so do the tensors a module lists in `KEEP_DTYPE` (W4A16Linear's fp32 `zeros`).
    """
    model = _meta_model(cfg) if model is None else model
    dtype = getattr(torch, cfg.dtype)
    keep = {f"{p}.{n}" if p else n for p, m in model.named_modules() for n in getattr(m, "KEEP_DTYPE", ())}
    return {k: (tuple(v.shape), dtype if v.is_floating_point() and k not in keep else v.dtype)
            for k, v in model.state_dict().items()}


def _fmt(spec: Spec) -> str:
    shape, dtype = spec
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"


def check_tensors(found: Mapping[str, Spec], expected: Mapping[str, Spec], where: Mapping[str, str]) -> list[str]:
    """Problems (empty if none) of `found` tensors against `expected`; `where[name]` names the file."""
    problems = [f"{name}: missing (expected {_fmt(spec)})" for name, spec in expected.items() if name not in found]
    for name, spec in found.items():
        loc = f"{where.get(name, '?')}: {name}"
        if name not in expected:
            problems.append(f"{loc}: unexpected tensor {_fmt(spec)} (not in the model this config.json describes)")
        elif tuple(spec[0]) != expected[name][0] or spec[1] != expected[name][1]:
            problems.append(f"{loc}: found {_fmt(spec)}, expected {_fmt(expected[name])}")
    return problems


# -- reading ---------------------------------------------------------------------------------------
def _inside(folder: Path, name, field: str) -> Path:
    """folder / name, refused unless it is a relative path that stays inside `folder` with symlinks resolved
    (a checkpoint's files may not name /etc/passwd or ../other-model)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or \
            not (folder / name).resolve().is_relative_to(folder.resolve()):
        raise _fail(folder, "a file outside the checkpoint folder", [f"{field}: {name!r} must name a file inside {folder}"])
    return folder / name


def _open(path: Path, folder: Path):
    if not path.is_file():
        raise _fail(folder, "weights file missing", [f"{path.name}: {'not a file' if path.exists() else 'not found'}"])
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise _fail(folder, "weights file unreadable", [f"{path.name}: {e} (truncated or corrupt?)"]) from None


def _header(f, fname: str, folder: Path) -> dict[str, Spec]:
    specs = {}
    for k in f.keys():
        sl = f.get_slice(k)
        code = sl.get_dtype()
        if code not in _ST_DTYPES:
            raise _fail(folder, "unsupported tensor dtype", [f"{fname}: {k}: dtype {code}"])
        specs[k] = (tuple(sl.get_shape()), _ST_DTYPES[code])
    return specs


def _weight_files(folder: Path) -> dict[str, list[str] | None]:
    """File name -> tensor names the index assigns to it (None for a single unsharded file)."""
    single, index = folder / WEIGHTS, folder / INDEX
    if single.exists() and index.exists():
        raise _fail(folder, "ambiguous weights", [f"both {WEIGHTS} and {INDEX} exist; a checkpoint has one"])
    if single.exists():
        return {WEIGHTS: None}
    if not index.exists():
        raise _fail(folder, "no weights", [f"neither {WEIGHTS} nor {INDEX} found"])
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
        raise _fail(folder, "bad shard index", [f"{INDEX}: not a valid index ({e!r})"]) from None
    for fname in files:
        _inside(folder, fname, f"{INDEX}: weight_map")
    return files


def read_headers(folder: Path) -> tuple[dict[str, Spec], dict[str, str], list[str]]:
    """Reads only the safetensors headers: (name -> spec, name -> file, index problems)."""
    specs, where, problems = {}, {}, []
    for fname, listed in _weight_files(folder).items():
        with _open(folder / fname, folder) as f:
            header = _header(f, fname, folder)
        for name, spec in header.items():
            if listed is not None and name not in listed:
                problems.append(f"{fname}: {name}: in the shard but not in {INDEX}")
            elif name in where:
                problems.append(f"{fname}: {name}: also stored in {where[name]}")
            specs[name], where[name] = spec, fname
        problems += [f"{INDEX}: {n}: listed in {fname} but not stored there" for n in listed or () if n not in header]
    return specs, where, problems


def _read_tensors(folder: Path, where: Mapping[str, str]) -> dict[str, torch.Tensor]:
    sd = {}
    for fname in dict.fromkeys(where.values()):
        with _open(folder / fname, folder) as f:
            for name in f.keys():
                sd[name] = f.get_tensor(name)
    return sd


def _read_config(folder: Path) -> VLMConfig:
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder}: checkpoint folder not found (looked at {folder.resolve()}); "
                                 f"build one with `python scripts/quantize.py`")
    try:
        if not (folder / CONFIG).is_file():
            raise ModelNotFoundError(f"{folder}: no {CONFIG} (looked at {(folder / CONFIG).resolve()}); "
                                     f"not a tinyvila checkpoint; {_hint(folder)}")
        return VLMConfig.load(folder)
    except (ModelNotFoundError, CheckpointError):
        from .convert.detect import raw_source_hint  # a raw VILA / AWQ / GGUF source: name the command

        hint = raw_source_hint(folder)
        if hint is None:
            raise
        raise ModelNotFoundError(hint) from None


def read_tokenizer(folder: str | os.PathLike, cfg: VLMConfig) -> Tokenizer:
    """The checkpoint's tokenizer (`cfg.tokenizer`, a file inside `folder`), checked against the model: every
    id it can produce must be below text.vocab_size. Raises TokenizerError naming the file."""
    folder = Path(folder)
    path = _inside(folder, cfg.tokenizer, f"{CONFIG}: tokenizer")
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer file {'is not a file' if path.exists() else 'not found'} "
                             f"({CONFIG} names it as `tokenizer`); {_hint(folder)}")
    tok = load_tokenizer(path)
    if tok.vocab_size > cfg.text.vocab_size:
        raise TokenizerError(f"{path}: holds token ids up to {tok.vocab_size - 1}, but {CONFIG} text.vocab_size is "
                             f"{cfg.text.vocab_size}: this tokenizer does not belong to this model; {_hint(folder)}")
    return tok


def load_model(folder: str | os.PathLike, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = None, verify: bool | None = None) -> VLM:
    """A checkpoint folder -> `VLM` in eval mode on `device` (floating weights cast to `dtype` if given).

    Every tensor's presence, name, shape and dtype is checked from the file headers before any data
    is read; a mismatch raises `CheckpointError` naming the file, the tensor, found vs expected.
    `verify` also checks that every floating weight is finite; None (the default) does it on a GPU, where it is
    one read of the uploaded weights, not on the CPU, where it would read every page of the memory map (20x the
    load time; docs/checkpoint_format.md). Nothing on disk is ever written.
    """
    folder = Path(folder)
    return _load_weights(folder, _read_config(folder), resolve_device(device), dtype, verify)


def load_checkpoint(folder: str | os.PathLike, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | str | None = None, verify: bool | None = None,
                    shard=None) -> tuple[VLM, Tokenizer]:
    """`load_model` and `read_tokenizer` of a folder: the config, then the tokenizer (small, and the likelier
    to be wrong), then the weights, each checked before the next is read. `shard(model)`, when given, slices
    the loaded model in place before it moves to `device` (tensor parallelism: tinyvila/tp.py)."""
    folder = Path(folder)
    device = resolve_device(device)
    cfg = _read_config(folder)
    tok = read_tokenizer(folder, cfg)
    return _load_weights(folder, cfg, device, dtype, verify, shard), tok


def _load_weights(folder: Path, cfg: VLMConfig, device: torch.device, dtype, verify: bool | None,
                  shard=None) -> VLM:
    model = _meta_model(cfg)
    specs, where, problems = read_headers(folder)
    problems += check_tensors(specs, expected_tensors(cfg, model), where)
    if problems:
        raise _fail(folder, f"weights do not match {CONFIG}", problems)
    model.load_state_dict(_read_tensors(folder, where), assign=True, strict=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device after loading (a module holds state "
                           f"that is not in its state_dict): {', '.join(left)}")
    if shard is not None:  # on the memory map: only this rank's slice is read and moved
        shard(model)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = model.to(device=device, dtype=dtype).eval()
    bad = not_finite(model) if verify or (verify is None and device.type == "cuda") else []
    if bad:
        raise _fail(folder, "weights are not finite", [f"{where.get(k, '?')}: {k}: holds NaN or infinite values" for k in bad])
    return model


@torch.no_grad()
def not_finite(model: torch.nn.Module) -> list[str]:
    """Names of the floating tensors of `model` holding a NaN or an infinity, checked where they live (after the
    upload: on a GPU it is one pass at memory speed). One fp32 sum per tensor and one host sync; a NaN or inf sum
    is confirmed element-wise, since a sum of huge finite bf16 values can overflow."""
    tensors = {k: t for k, t in model.state_dict().items() if t.is_floating_point()}
    if not tensors:
        return []
    sums = torch.stack([torch.sum(t, dtype=torch.float32) for t in tensors.values()]).isfinite().tolist()
    return [k for (k, t), ok in zip(tensors.items(), sums) if not ok and not bool(torch.isfinite(t).all())]


def resolve_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device this machine has; DeviceError naming it (and what to use) otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    where = f"device {str(device)!r} (--device)"
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"{where}: tinyvila runs on cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"{where}: no CUDA GPU is available (or torch was built without CUDA); use cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise DeviceError(f"{where}: this machine has {torch.cuda.device_count()} CUDA devices, cuda:0 to "
                          f"cuda:{torch.cuda.device_count() - 1}")
    if dev.type == "cuda" and importlib.util.find_spec("triton") is None:  # the GPU kernels are Triton's
        raise DeviceError(f"{where}: the GPU kernels need Triton, which is not installed: pip install -e \".[gpu]\" "
                          "(CUDA builds of torch usually bring it)")
    return dev


# -- writing ---------------------------------------------------------------------------------------
def _plan_shards(sd: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Greedy, in state-dict order: a tensor larger than max_bytes gets a shard of its own."""
    shards, size = [[]], 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _unshared(part: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, no two tensors on one storage (safetensors refuses one tensor under two
    names). Copies only where needed, so a 16 GB state dict is not doubled in memory."""
    out, seen = {}, set()
    for k, t in part.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _write_weights(tmp: Path, sd: Mapping[str, torch.Tensor], max_bytes: int) -> None:
    shards = _plan_shards(sd, max_bytes)
    names = [WEIGHTS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, keys in zip(names, shards):
        save_file(_unshared({k: sd[k] for k in keys}), str(tmp / fname), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in sd.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: fname for fname, keys in zip(names, shards) for k in keys}}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _write_extras(tmp: Path, extra_files: Mapping[str, bytes | str]) -> None:
    for name, data in extra_files.items():
        if Path(name).name != name or name in (CONFIG, WEIGHTS, INDEX) or name.startswith("model-"):
            raise ValueError(f"extra file name {name!r} must be a plain file name that is not a weights/config file")
        if isinstance(data, bytes):
            (tmp / name).write_bytes(data)
        elif isinstance(data, str):
            (tmp / name).write_text(data)
        else:
            raise TypeError(f"extra file {name!r}: expected bytes or str, got {type(data).__name__}")


def _commit(tmp: Path, folder: Path) -> None:
    """Moves the finished temp folder into place; an existing folder is swapped out, then deleted. The folder and
    its files get the user's umask (mkdtemp makes the folder 0700, which other users of a shared checkpoint
    directory could not read)."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for f in tmp.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)
    if not folder.exists():
        try:
            os.rename(tmp, folder)
        except OSError:
            if folder.exists():  # another process committed the same folder first
                raise FileExistsError(f"{folder}: appeared while this checkpoint was being written") from None
            raise
        return
    old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
    os.rename(folder, old / folder.name)
    os.rename(tmp, folder)
    shutil.rmtree(old)


def save_checkpoint(folder: str | os.PathLike, cfg: VLMConfig, state_dict: Mapping[str, torch.Tensor],
                    extra_files: Mapping[str, bytes | str] | None = None, *, overwrite: bool = False,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Writes config.json, the weights (sharded above `max_shard_bytes`, with an index) and
    `extra_files` (name -> contents, e.g. tokenizer files) to `folder`, atomically.

    The state dict is checked against `cfg` first (as `load_model` will), so a folder that would not
    load is never written. Everything goes to a temp folder beside `folder`, renamed into place at the
    end; on any error the temp folder is removed. An existing non-empty `folder` is an error unless
    `overwrite`. Returns the folder.
    """
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or (any(folder.iterdir()) and not overwrite)):
        raise FileExistsError(f"{folder}: exists and is not empty; pass overwrite=True (scripts/quantize.py "
                              "--overwrite) to replace it")
    found = {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()}
    problems = check_tensors(found, expected_tensors(cfg), {k: "state_dict" for k in state_dict})
    if problems:
        raise _fail(folder, "refusing to save tensors that do not match the config", problems)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        cfg.save(tmp)
        _write_weights(tmp, state_dict, max_shard_bytes)
        _write_extras(tmp, extra_files or {})
        _commit(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


# -- synthetic checkpoints ---------------------------------------------------------------------------
def _init_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Small random values that keep activations sane at any depth: N(0, 0.02) matrices and
    embeddings, 1 + N(0, 0.02) norm scales, N(0, 0.02) biases. Not exactly 1/0, so a weight
    wired to the wrong slot still changes the output and tests can see it."""
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)  # packed integer weights: any bit pattern is valid
        return torch.randint(info.min, info.max + 1, shape, generator=g, dtype=torch.int64).to(dtype)
    t = torch.randn(shape, generator=g) * 0.02
    if len(shape) == 1 and name.endswith(".weight"):
        t += 1.0  # a 1-D weight is a norm's scale
    return t.to(dtype)


def random_state_dict(cfg: VLMConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of exactly the names, shapes and dtypes `load_model` expects for `cfg`.

    Deterministic in `seed`; tensors are drawn in state-dict order on the CPU. W4 linears (`X.qweight`,
    `X.scales`, `X.zeros`) are a random dense weight quantized with `quantize_w4`, so their scales and
    zero points are those a real quantizer would produce.
    """
    g = torch.Generator().manual_seed(seed)
    specs = expected_tensors(cfg)
    sd = {}
    for name, (shape, dtype) in specs.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "qweight":
            dense = torch.randn(shape[0], shape[1] * 8, generator=g) * 0.02  # (N, K)
            packed = quantize_w4(dense, cfg.quant.group_size, dtype=specs[f"{prefix}.scales"][1])
            sd.update({f"{prefix}.{k}": v for k, v in packed.items()})
        elif leaf not in ("scales", "zeros") or f"{prefix}.qweight" not in specs:
            sd[name] = _init_tensor(name, shape, dtype, g)
    return sd


def _iter_ids(tok: dict) -> Iterator[int]:
    yield from (t["id"] for t in tok.get("added_tokens", ()))
    vocab = tok.get("model", {}).get("vocab", {})
    yield from (vocab.values() if isinstance(vocab, dict) else range(len(vocab)))


# Whole words for a synthetic tokenizer (`synthetic_tokenizer(words=True)`: the demo's), most useful first: as
# " word", then as " Word", at the ids after the bytes, as many as a config's vocabulary holds. Prompts then take
# about as many tokens as with a real tokenizer, and a random model's answers are words.
_WORDS = """
the of and a to in is it that for on with as at by from this was are be or an not but all they we you he she
his her their its our one two three there here what which who when where why how can will would could should
may might must has have had do does did some many much more most few other such only own same very also just
then now still even again never always often every each both either into over under above below between behind
through across along around after before while because if so than too well yes no about near far picture image
photo scene view light color shape line edge corner side top bottom left right middle front back center red
blue green yellow orange purple pink brown black white gray dark bright small large big little long short tall
wide round flat old new young good great high low clear soft warm cold house home room door window wall floor
roof table chair bed car road street city town tree flower grass sky cloud sun moon star water river sea lake
hill mountain field garden park bridge tower boat train plane bird dog cat horse fish man woman child people
person face hand eye head hair arm leg foot body day night morning evening time year place part way thing
group number word name book paper box bag cup glass plate bottle ball toy robot gripper camera screen sign
letter text shadow surface pattern object see look show find make take get give go come know think want like
need use work call try ask seem feel leave put keep let begin help turn start run move live hold bring write
sit stand play learn change watch follow stop open close read walk grow said made went came
""".split()


def synthetic_tokenizer(cfg: VLMConfig, words: bool = False) -> dict:
    """A byte-level tokenizer.json: the 256 bytes, then (`words`) whole words (`_WORDS`), as many as the config's
    vocabulary holds, then the template's special tokens (adding its BOS, as the real tokenizer would). With words
    it is HF's `ignore_merges` BPE: a word found in the vocabulary is one token, any other text is bytes; the ids
    run on without a gap, as HF's tokenizers want. Raises ValueError if the bytes and specials do not fit the
    config's vocab."""
    from .tokenizer import TEMPLATES, byte_tokenizer_json
    from .tokenizer.bpe import bytes_to_unicode

    template = TEMPLATES[cfg.template]
    tok = byte_tokenizer_json(list(template.special_tokens), bos=template.bos)  # specials at 256..
    top = max(_iter_ids(tok), default=-1)
    if top >= cfg.text.vocab_size:
        raise ValueError(f"byte tokenizer needs {top + 1} ids but the config's vocab_size is {cfg.text.vocab_size}")
    if not words:
        return tok
    space = bytes_to_unicode()[ord(" ")]
    forms = list(dict.fromkeys([space + w for w in _WORDS] + [space + w.capitalize() for w in _WORDS]))
    forms = forms[:cfg.text.vocab_size - 1 - top]
    tok["model"]["vocab"].update({w: 256 + i for i, w in enumerate(forms)})
    tok["model"]["ignore_merges"] = True
    for added in tok["added_tokens"]:  # the specials move past the words
        added["id"] += len(forms)
    for special in tok["post_processor"]["special_tokens"].values():
        special["ids"] = [i + len(forms) for i in special["ids"]]
    return tok


def _synthetic_config(cfg_or_preset: VLMConfig | str) -> VLMConfig:
    cfg = preset(cfg_or_preset) if isinstance(cfg_or_preset, str) else cfg_or_preset
    return dataclasses.replace(cfg, synthetic=True, tokenizer="tokenizer.json", eos_ids=())


def build_synthetic(folder: str | os.PathLike, cfg_or_preset: VLMConfig | str, seed: int = 0, *,
                    overwrite: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES, words: bool = False) -> Path:
    """Writes a random-weight checkpoint (config with synthetic=True, weights, byte tokenizer.json).

    The template's stop tokens live in the byte tokenizer, so the preset's `eos_ids` (ids of a real
    tokenizer) are cleared. A real-size preset (vila-8b) writes ~16 GB and takes minutes. `words`: the tokenizer
    holds whole words too (`synthetic_tokenizer`), and the model prefers them to bytes (the demo's).
    """
    cfg = _synthetic_config(cfg_or_preset)
    tok = synthetic_tokenizer(cfg, words)
    sd = random_state_dict(cfg, seed)
    if words:  # the byte tokens' output rows scaled down: greedy answers are words, not stray (invalid) bytes
        sd["text.embed.weight" if cfg.text.tie_embeddings else "text.lm_head.weight"][:256] *= 0.25
    return save_checkpoint(folder, cfg, sd, {"tokenizer.json": json.dumps(tok, ensure_ascii=False)},
                           overwrite=overwrite, max_shard_bytes=max_shard_bytes)


def ensure_synthetic(folder: str | os.PathLike, cfg_or_preset: VLMConfig | str, seed: int = 0,
                     words: bool = False) -> Path:
    """`build_synthetic` unless `folder` already holds that checkpoint; safe when several processes run it at once
    (each builds in its own temp folder and the first rename wins; the others use its folder). A leftover partial
    folder (no config.json or no weights), or a synthetic one of another config or tokenizer, is rebuilt; a folder
    holding real weights is never touched."""
    folder = Path(folder)
    cfg = _synthetic_config(cfg_or_preset)
    for _ in range(5):
        state = _synthetic_state(folder, cfg, words)
        if state in ("current", "foreign"):
            return folder
        if state == "stale":
            _discard(folder)
        try:
            return build_synthetic(folder, cfg, seed, words=words)
        except FileExistsError:
            continue  # it appeared meanwhile: look at it again
    raise CheckpointError(f"{folder}: could not build the synthetic checkpoint (it keeps changing underneath); "
                          "remove the folder and try again")


def _synthetic_state(folder: Path, cfg: VLMConfig, words: bool = False) -> str:
    """'missing', 'current' (that exact config and tokenizer), 'stale' (partial, or synthetic but different) or
    'foreign' (a checkpoint with real weights)."""
    if not folder.exists():
        return "missing"
    if not (folder / CONFIG).is_file() or not ((folder / WEIGHTS).is_file() or (folder / INDEX).is_file()):
        return "stale"
    try:
        found = VLMConfig.load(folder)
        tok = json.loads((folder / found.tokenizer).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "stale"
    if found == cfg and tok == synthetic_tokenizer(cfg, words):
        return "current"
    return "stale" if found.synthetic else "foreign"


def _discard(folder: Path) -> None:
    """Moves `folder` aside (one atomic rename: a racing process sees it or not, never half of it), then deletes it."""
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
    try:
        os.rename(folder, trash / folder.name)
    except FileNotFoundError:
        pass  # another process moved it first
    shutil.rmtree(trash, ignore_errors=True)


@torch.no_grad()
def random_model(cfg: VLMConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> VLM:
    """A VLM with random weights made directly on `device`, no checkpoint written (benchmarks at
    real shapes: an 8B model is initialised on the GPU in a second instead of written to disk).

    Values follow `_init_tensor`'s scheme; quantized tensors get valid, sane values: random int4
    nibbles with scales ~ 0.02/8 and zero point 8 (W4), random int8 with scale 0.02/127 (W8A8).
    """
    # Modules are built in fp32; the checkpoint dtype is the config's (quantized modules keep their
    # fp32 zeros/scales through the cast, see quant.py).
    model = _meta_model(cfg).to(getattr(torch, cfg.dtype)).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in tensors.items():
        leaf = name.rpartition(".")[2]
        if leaf == "qweight":
            t.copy_(torch.randint(-2**31, 2**31, t.shape, generator=g, device=device, dtype=torch.int64).to(t.dtype))
        elif not t.dtype.is_floating_point:
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, device=device, dtype=t.dtype))
        elif leaf == "scales":
            t.copy_(torch.rand(t.shape, generator=g, device=device) * 0.002 + 0.002)
        elif leaf == "weight_scale":
            t.copy_(torch.rand(t.shape, generator=g, device=device) * 1e-4 + 1e-4)
        elif leaf != "zeros":
            t.copy_(torch.randn(t.shape, generator=g, device=device) * 0.02 + (1.0 if t.dim() == 1 and leaf == "weight" else 0.0))
    for name, t in tensors.items():  # zero point 8: w = (q - 8) * s, centred like a real quantizer's
        if name.endswith(".zeros"):
            t.copy_(-8.0 * tensors[name[: -len("zeros")] + "scales"].float())
    return model.eval()
