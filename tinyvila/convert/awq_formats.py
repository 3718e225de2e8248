"""Published AWQ checkpoints repacked into tinyvila W4A16 checkpoints, without re-quantizing.

    python scripts/quantize.py import-awq-v2 VILA_AWQ_FOLDER DST      # llm-awq/TinyChat *-w4-g128-awq-v2.pt
    python scripts/quantize.py import-autoawq HF_AWQ_FOLDER DST       # AutoAWQ GEMM (bare, or a VILA's llm/)

Codes, scales and zeros are moved into the W4 layout of tinyvila/quant.py so every dequantized weight
is bit-identical to the source's own dequantization. The checkpoint takes the scales' dtype (fp16 for
both formats) whatever the source config.json's torch_dtype says: see `scale_dtype`. Layouts: ../shared/reference/quant_and_models.md
(AutoAWQ), vila_sparsevila.md 1.6 (v2).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tinyvila import quant
from tinyvila.config import QuantConfig, TextConfig, VLMConfig
from tinyvila.convert.detect import RAW_KINDS, wrong_layout
from tinyvila.convert.hf import text_config_from_hf
from tinyvila.convert.vila import (HFTensors, account, detect_template, eos_ids, read_json, tokenizer_dir,
                                   tokenizer_files, vila_config, vila_state_dict)
from tinyvila.errors import CheckpointError
from tinyvila.loader import save_checkpoint

LINEARS = {  # tinyvila fused linear -> the HF projections stacked into it, in row order
    "attn.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.wo": ("self_attn.o_proj",),
    "mlp.w13": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.w2": ("mlp.down_proj",),
}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a word holds logical column 8c + AWQ_ORDER[i]


# -- the W4 state dict shared by both formats ----------------------------------------------------------
def w4_entry(prefix: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{prefix.qweight, .scales, .zeros} from codes (N, K) in [0, 15], scales and zeros (N, K/G).

    Scales are stored as the source stores them: casting fp16 scales to bf16 would change every weight."""
    if scales.dtype != dtype:
        raise CheckpointError(f"{prefix}: scales are {scales.dtype}, the other linears' are {dtype}; a W4 "
                              f"checkpoint holds one scale precision")
    return {f"{prefix}.qweight": quant.pack_int4(codes), f"{prefix}.scales": scales, f"{prefix}.zeros": zeros.float()}


def exact_cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`, refusing a cast that overflows (bf16 values past fp16's 65504)."""
    out = t.to(dtype)
    if t.is_floating_point() and not torch.isfinite(out).all() and torch.isfinite(t).all():
        raise CheckpointError(f"{name}: values overflow {dtype} (max |x| {t.abs().max().item():.4g}); the "
                              f"W4 scales' precision cannot hold this tensor")
    return out


def scale_dtype(dtype: torch.dtype, where: str) -> str:
    """The checkpoint dtype of a W4 import: the source scales' own (fp16 for llm-awq and AutoAWQ).

    The W4 kernels read scales in the activations' dtype, and fp16 scales (11 significant bits) have no
    exact bf16 form (8 bits), so the LLM computes in the scales' precision, whatever the source
    config.json's torch_dtype (often the unquantized model's bfloat16) says."""
    name = str(dtype).removeprefix("torch.")
    if name not in ("float16", "bfloat16"):
        raise CheckpointError(f"{where}: W4 scales are {name}; only float16 or bfloat16 scales are supported")
    return name


def w4_text_state_dict(cfg: TextConfig, dtype: torch.dtype, linear, dense) -> dict[str, torch.Tensor]:
    """The `text.*` tensors of a W4A16 checkpoint.

    linear(hf_layer_prefix, proj) -> (codes (N, K), scales (N, K/G), zeros fp32 (N, K/G), bias or None)
    for one HF projection; dense(hf_name) -> an unquantized tensor (embeddings, norms, lm_head).
    """
    cast = lambda name: exact_cast(name, dense(name), dtype)  # noqa: E731
    out = {"text.embed.weight": cast("model.embed_tokens.weight"), "text.norm.weight": cast("model.norm.weight")}
    for i in range(cfg.n_layers):
        hp, tp = f"model.layers.{i}.", f"text.layers.{i}."
        out[tp + "attn_norm.weight"] = cast(hp + "input_layernorm.weight")
        out[tp + "mlp_norm.weight"] = cast(hp + "post_attention_layernorm.weight")
        for name, projs in LINEARS.items():
            parts = [linear(hp, p) for p in projs]
            codes, scales, zeros = (torch.cat([p[j] for p in parts]) for j in range(3))  # rows stacked
            out.update(w4_entry(tp + name, codes, scales, zeros, dtype))
            if name == "attn.wqkv" and cfg.qkv_bias:
                out[tp + name + ".bias"] = exact_cast(tp + name + ".bias", torch.cat([p[3] for p in parts]), dtype)
    if not cfg.tie_embeddings:
        out["text.lm_head.weight"] = cast("lm_head.weight")
    return out


def _check_group(name: str, K: int, n_groups: int, group_size: int) -> None:
    if K % group_size or K // group_size != n_groups or group_size not in quant.W4_GROUP_SIZES:
        raise CheckpointError(f"{name}: {n_groups} groups for K={K} do not fit group size {group_size} "
                              f"(supported: {quant.W4_GROUP_SIZES}); pass the right --group-size")


# -- llm-awq v2 (TinyChat 2.0) --------------------------------------------------------------------------
def unpack_awq_v2(qweight: torch.Tensor) -> torch.Tensor:
    """int16 (N/4, K) llm-awq v2 -> codes (N, K) uint8.

    Element qweight[r, 64c + m], nibble b, holds q[4r + m // 16, 64c + 32 ((m >> 3) & 1) + 8b + (m & 7)]
    (vila_sparsevila.md 1.6). The int16 is read as uint16: nibble 3 sets the sign bit.
    """
    R, K = qweight.shape
    if K % 64:
        raise ValueError(f"v2 qweight has K={K}, not a multiple of 64")
    w = qweight.to(torch.int32) & 0xFFFF
    shifts = torch.arange(0, 16, 4, dtype=torch.int32)
    nib = (w[..., None] >> shifts) & 0xF  # (R, K, 4): [r, 64c + m, b]
    nib = nib.view(R, K // 64, 4, 2, 8, 4)  # (r, c, m // 16, (m >> 3) & 1, m & 7, b)
    q = nib.permute(0, 2, 1, 3, 5, 4)  # (r, m // 16, c, h, b, i): row n = 4r + m // 16, k = 64c + 32h + 8b + i
    return q.reshape(4 * R, K).to(torch.uint8)


def _v2_linear(sd: dict, used: set, group_size: int):
    def linear(hp: str, proj: str):
        p = hp + proj
        for k in ("qweight", "scales", "scaled_zeros"):
            if f"{p}.{k}" not in sd:
                raise CheckpointError(f"{p}.{k}: missing from the v2 .pt (is it an llm-awq v2 checkpoint?)")
            used.add(f"{p}.{k}")
        codes = unpack_awq_v2(sd[p + ".qweight"])
        N, K = codes.shape
        scales, szeros = sd[p + ".scales"], sd[p + ".scaled_zeros"]  # (Gp, N), group axis padded to 8
        n_groups = K // group_size
        if K % group_size:
            raise CheckpointError(f"{p}: K={K} is not a multiple of the group size {group_size}")
        if scales.shape[1] != N or scales.shape[0] < n_groups or szeros.shape != scales.shape:
            raise CheckpointError(f"{p}: scales {tuple(scales.shape)} / scaled_zeros {tuple(szeros.shape)} "
                                  f"do not fit qweight (N={N}, K={K}, G={group_size})")
        if scales[n_groups:].any() or szeros[n_groups:].any():
            raise CheckpointError(f"{p}: the padding groups past K/G={n_groups} are not zero; "
                                  f"the group size is not {group_size} (pass --group-size)")
        bias = None
        if p + ".bias" in sd:
            used.add(p + ".bias")
            bias = sd[p + ".bias"]
        # fp16 scaled zeros widen exactly to fp32: q * s + sz is then the kernel's own FMA.
        return codes, scales[:n_groups].T, szeros[:n_groups].T.float(), bias
    return linear


def _find_v2(src: Path) -> Path:
    found = sorted((src / "llm").glob("*-v2.pt"))
    if not found:
        raise wrong_layout(src, "import-awq-v2", RAW_KINDS["vila-awq-v2"][0])
    if len(found) > 1:
        raise CheckpointError(f"{src / 'llm'}: expected exactly one *-w4-g128-awq-v2.pt file, found "
                              f"{[f.name for f in found]}")
    return found[0]


def import_awq_v2(src: str | Path, dst: str | Path, *, group_size: int = 128, max_seq_len: int | None = None,
                  template: str | None = None, overwrite: bool = False) -> Path:
    """A VILA AWQ folder (llm/*-v2.pt + fp16 vision_tower/ and mm_projector/) -> W4A16 checkpoint."""
    cfg, sd, extras = awq_v2_checkpoint(src, group_size=group_size, max_seq_len=max_seq_len, template=template)
    return save_checkpoint(dst, cfg, sd, extras, overwrite=overwrite)


def awq_v2_checkpoint(src: str | Path, *, group_size: int = 128, max_seq_len: int | None = None,
                      template: str | None = None) -> tuple[VLMConfig, dict[str, torch.Tensor], dict[str, bytes]]:
    """(config, state dict, tokenizer files) of `import_awq_v2`, nothing written."""
    src = Path(src)
    if src.is_file():  # the .pt itself, most often: name the folder the importer wants
        raise CheckpointError(f"{src}: a file; import-awq-v2 takes the VILA AWQ folder (config.json, llm/ holding the "
                              f"*-w4-g128-awq-v2.pt, vision_tower/, mm_projector/), e.g. {src.parent.parent}")
    if not src.is_dir():
        raise CheckpointError(f"{src}: VILA AWQ folder not found")
    pt = _find_v2(src)
    sd = torch.load(pt, map_location="cpu", weights_only=True)
    first = "model.layers.0.self_attn.q_proj.scales"
    if first not in sd:
        raise CheckpointError(f"{pt}: no {first}; is it an llm-awq v2 checkpoint?")
    cfg = vila_config(src, dtype=scale_dtype(sd[first].dtype, str(pt)), max_seq_len=max_seq_len, template=template)
    cfg = VLMConfig.from_dict({**cfg.to_dict(), "quant": {"llm": "w4a16", "group_size": group_size}})
    dtype = getattr(torch, cfg.dtype)
    used: set[str] = set()

    def dense(name: str) -> torch.Tensor:
        if name not in sd:
            raise CheckpointError(f"{pt}: {name} missing")
        used.add(name)
        return sd[name]

    out = w4_text_state_dict(cfg.text, dtype, _v2_linear(sd, used, group_size), dense)
    used |= {k for k in sd if k.endswith("rotary_emb.inv_freq")}
    left = sorted(set(sd) - used)
    if left:
        raise CheckpointError(f"{pt}: tensors not used: {', '.join(left[:10])}")
    out.update(vila_state_dict(src, cfg, ("vision_tower", "mm_projector")))  # as import-vila converts them
    return cfg, out, tokenizer_files(tokenizer_dir(src))


# -- AutoAWQ GEMM -----------------------------------------------------------------------------------------
def unpack_autoawq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM int32 (R, N/8) -> (R, N) uint8: nibble i of word c is column 8c + AWQ_ORDER[i]."""
    R, W = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = (packed[..., None] >> shifts) & 0xF  # (R, N/8, 8) in nibble order
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib  # nibble i -> logical column AWQ_ORDER[i]
    return out.reshape(R, 8 * W).to(torch.uint8)


def autoawq_group_size(hf_cfg: dict, path: Path) -> int:
    """The group size from config.json's quantization_config, checking it is a format we read."""
    qc = hf_cfg.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method", "awq") != "awq":
        raise CheckpointError(f"{path}: no AWQ quantization_config; is this an AutoAWQ checkpoint?")
    bits = qc.get("bits", qc.get("w_bit"))
    G = qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or not qc.get("zero_point", True) or version != "gemm":
        raise CheckpointError(f"{path}: quantization_config {qc} is not supported "
                              f"(only 4-bit, zero_point, version 'gemm')")
    if G not in quant.W4_GROUP_SIZES:
        raise CheckpointError(f"{path}: group size {G} not supported (supported: {quant.W4_GROUP_SIZES})")
    if qc.get("modules_to_not_convert"):
        raise CheckpointError(f"{path}: modules_to_not_convert {qc['modules_to_not_convert']} is not supported "
                              f"(every decoder linear must be W4)")
    return G


def _autoawq_linear(hf, used: set, G: int):
    def linear(hp: str, proj: str):
        p = hp + proj
        names = [f"{p}.{k}" for k in ("qweight", "qzeros", "scales")]
        missing = [n for n in names if n not in hf]
        if missing:
            raise CheckpointError(f"{', '.join(missing)}: missing (a dense {p}.weight cannot be mixed into W4)")
        used.update(names)
        codes = unpack_autoawq(hf[names[0]]).T  # (K, N) -> (N, K)
        z = unpack_autoawq(hf[names[1]]).T.float()  # (N, K/G)
        s = hf[names[2]].T  # (N, K/G)
        _check_group(p, codes.shape[1], s.shape[1], G)
        bias = None
        if p + ".bias" in hf:
            used.add(p + ".bias")
            bias = hf[p + ".bias"]
        # (q - z) * s == q * s + (-z * s): both products are exact in fp32, so is their sum.
        return codes.contiguous(), s.contiguous(), (-z * s.float()).contiguous(), bias
    return linear


def import_autoawq(src: str | Path, dst: str | Path, *, max_seq_len: int | None = None,
                   template: str | None = None, overwrite: bool = False) -> Path:
    """An AutoAWQ GEMM HF folder (config.json with quantization_config, safetensors) -> text-only W4A16; a VILA
    folder whose llm/ is one -> the W4A16 VLM, vision tower and projector converted as import-vila does."""
    cfg, sd, extras = autoawq_checkpoint(src, max_seq_len=max_seq_len, template=template)
    return save_checkpoint(dst, cfg, sd, extras, overwrite=overwrite)


def _autoawq_config(src: Path, llm: Path, hf_cfg: dict, dtype: str, G: int, max_seq_len: int | None,
                    template: str | None) -> VLMConfig:
    """The VLMConfig of a bare AutoAWQ LLM (src == llm) or of a VILA folder around one."""
    quant_cfg = QuantConfig(llm="w4a16", group_size=G)
    if src != llm:
        cfg = vila_config(src, dtype=dtype, max_seq_len=max_seq_len, template=template)
        return VLMConfig.from_dict({**cfg.to_dict(), "quant": quant_cfg.__dict__})
    return VLMConfig(text=text_config_from_hf(hf_cfg, max_seq_len=max_seq_len), quant=quant_cfg,
                     template=template or detect_template(src), dtype=dtype,
                     tokenizer="tokenizer.json" if (src / "tokenizer.json").is_file() else "tokenizer.model",
                     eos_ids=eos_ids(src, hf_cfg))


def autoawq_checkpoint(src: str | Path, *, max_seq_len: int | None = None, template: str | None = None
                       ) -> tuple[VLMConfig, dict[str, torch.Tensor], dict[str, bytes]]:
    """(config, state dict, tokenizer files) of `import_autoawq`, nothing written."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: AutoAWQ folder not found")
    llm = src / "llm" if (src / "llm" / "config.json").is_file() else src  # a VILA folder around it
    hf_cfg = read_json(llm / "config.json")
    if not isinstance(hf_cfg.get("quantization_config"), dict):
        raise wrong_layout(src, "import-autoawq", f"{RAW_KINDS['autoawq'][0]} or {RAW_KINDS['vila-autoawq'][0]}")
    G = autoawq_group_size(hf_cfg, llm / "config.json")
    hf = HFTensors(llm)
    first = "model.layers.0.self_attn.q_proj.scales"
    if first not in hf:
        raise CheckpointError(f"{llm}: no {first}; is it an AutoAWQ GEMM checkpoint?")
    cfg = _autoawq_config(src, llm, hf_cfg, scale_dtype(hf.dtype(first), str(llm)), G, max_seq_len, template)
    used: set[str] = set()

    def dense(name: str) -> torch.Tensor:
        if name not in hf:
            raise CheckpointError(f"{llm}: {name} missing")
        used.add(name)
        return hf[name]

    out = w4_text_state_dict(cfg.text, getattr(torch, cfg.dtype), _autoawq_linear(hf, used, G), dense)
    used |= {k for k in hf if k.endswith("rotary_emb.inv_freq")}
    if cfg.text.tie_embeddings and "lm_head.weight" in hf:
        used.add("lm_head.weight")
    problems = account("llm", hf, used)
    if problems:
        raise CheckpointError(f"{llm}: tensors not accounted for exactly once:\n  " + "\n  ".join(problems))
    if llm != src:
        out.update(vila_state_dict(src, cfg, ("vision_tower", "mm_projector")))
    return cfg, out, tokenizer_files(tokenizer_dir(src) if llm != src else src)
