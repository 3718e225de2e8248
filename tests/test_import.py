"""import-vila (tinyvila/convert/vila.py, scripts/quantize.py) on a fake VILA folder of tiny random HF models.

Run: pytest tests/test_import.py (skips without transformers). The folder has VILA's layout: a
sharded Llama `llm/` with a byte-level tokenizer.json, a SigLIP `vision_tower/` with its
preprocessor_config.json, an `mm_projector/` with VILA's `layers.{1,2,4}` names, and a top config.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from scripts.quantize import main as quantize_main
from tinyvila.convert.hf import projector_weights_from_hf
from tinyvila.convert.vila import HFTensors, account, import_vila
from tinyvila.errors import CheckpointError
from tinyvila.image import preprocess
from tinyvila.loader import load_model
from tinyvila.tokenizer import TEMPLATES, byte_tokenizer_json

transformers = pytest.importorskip("transformers")

V_DIM, T_DIM, V_LAYERS, T_LAYERS = 48, 64, 3, 2


def _llm(folder: Path) -> None:
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=T_DIM, intermediate_size=96,
                                   num_hidden_layers=T_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True, max_shard_size="30KB")
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": [257, 260]}))
    template = TEMPLATES["llama_3"]
    tok = byte_tokenizer_json(list(template.special_tokens), bos=template.bos)
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))


def _vision(folder: Path):
    cfg = transformers.SiglipVisionConfig(hidden_size=V_DIM, intermediate_size=96, num_hidden_layers=V_LAYERS,
                                          num_attention_heads=4, image_size=32, patch_size=8)
    torch.manual_seed(1)
    model = transformers.SiglipVisionModel(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    processor = getattr(transformers, "SiglipImageProcessorPil", None) or transformers.SiglipImageProcessor
    processor(size={"height": 32, "width": 32}, image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.3, 0.4]
              ).save_pretrained(folder)
    return model


def _projector(folder: Path) -> None:
    folder.mkdir()
    g = torch.Generator().manual_seed(2)
    sd = {"layers.1.weight": 1 + 0.1 * torch.randn(4 * V_DIM, generator=g),
          "layers.1.bias": 0.1 * torch.randn(4 * V_DIM, generator=g),
          "layers.2.weight": 0.05 * torch.randn(T_DIM, 4 * V_DIM, generator=g),
          "layers.2.bias": 0.1 * torch.randn(T_DIM, generator=g),
          "layers.4.weight": 0.05 * torch.randn(T_DIM, T_DIM, generator=g),
          "layers.4.bias": 0.1 * torch.randn(T_DIM, generator=g)}
    save_file(sd, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"architectures": ["MultimodalProjector"],
                                                    "mm_projector_type": "mlp_downsample",
                                                    "model_type": "v2l_projector", "torch_dtype": "float32"}))


def _top(folder: Path) -> None:
    top = {"architectures": ["LlavaLlamaModel"], "model_type": "llava_llama", "hidden_size": T_DIM,
           "mm_hidden_size": V_DIM, "mm_vision_select_layer": -2, "mm_vision_select_feature": "cls_patch",
           "image_aspect_ratio": "resize", "num_video_frames": 8, "s2": False,
           "llm_cfg": {}, "vision_tower_cfg": {}, "mm_projector_cfg": {"mm_projector_type": "mlp_downsample"}}
    (folder / "config.json").write_text(json.dumps(top))


@pytest.fixture(scope="module")
def vila(tmp_path_factory):
    """(VILA source folder, HF vision model, imported tinyvila folder)."""
    src = tmp_path_factory.mktemp("vila") / "VILA-tiny"
    src.mkdir()
    _llm(src / "llm")
    hf_vision = _vision(src / "vision_tower")
    _projector(src / "mm_projector")
    _top(src)
    dst = import_vila(src, src.parent / "imported", dtype="float32")
    return src, hf_vision, dst


def _hf(folder: Path) -> dict[str, torch.Tensor]:
    sd = {}
    for f in folder.glob("*.safetensors"):
        sd.update(load_file(f))
    return sd


def _expected(src: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tinyvila tensors written out by hand from the HF ones, and the HF keys that may be unused."""
    llm, vis, proj = _hf(src / "llm"), _hf(src / "vision_tower"), _hf(src / "mm_projector")
    vp = "vision_model." if any(k.startswith("vision_model.") for k in vis) else ""
    out = {"text.embed.weight": llm["model.embed_tokens.weight"], "text.norm.weight": llm["model.norm.weight"],
           "text.lm_head.weight": llm["lm_head.weight"]}
    for i in range(T_LAYERS):
        h, t = f"model.layers.{i}.", f"text.layers.{i}."
        out[t + "attn_norm.weight"] = llm[h + "input_layernorm.weight"]
        out[t + "mlp_norm.weight"] = llm[h + "post_attention_layernorm.weight"]
        out[t + "attn.wqkv.weight"] = torch.cat([llm[h + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        out[t + "attn.wo.weight"] = llm[h + "self_attn.o_proj.weight"]
        out[t + "mlp.w13.weight"] = torch.cat([llm[h + "mlp.gate_proj.weight"], llm[h + "mlp.up_proj.weight"]])
        out[t + "mlp.w2.weight"] = llm[h + "mlp.down_proj.weight"]
    e = vp + "embeddings."
    out |= {"vision.patch_embed.weight": vis[e + "patch_embedding.weight"],
            "vision.patch_embed.bias": vis[e + "patch_embedding.bias"],
            "vision.pos_embed": vis[e + "position_embedding.weight"]}
    for i in range(V_LAYERS - 1):  # layer -2 of 3: two layers run
        h, t = f"{vp}encoder.layers.{i}.", f"vision.layers.{i}."
        for p in ("weight", "bias"):
            out[t + f"attn.wqkv.{p}"] = torch.cat([vis[h + f"self_attn.{n}_proj.{p}"] for n in "qkv"])
            for a, b in (("layer_norm1", "norm1"), ("self_attn.out_proj", "attn.wo"), ("layer_norm2", "norm2"),
                         ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
                out[t + f"{b}.{p}"] = vis[h + f"{a}.{p}"]
    for a, b in (("1", "norm"), ("2", "fc1"), ("4", "fc2")):
        for p in ("weight", "bias"):
            out[f"projector.{b}.{p}"] = proj[f"layers.{a}.{p}"]
    dropped = {k for k in vis if k.startswith((f"{vp}post_layernorm.", f"{vp}head.", f"{vp}encoder.layers.2."))}
    return out, dropped


def test_folder_contents(vila):
    src, _, dst = vila
    assert len(list((src / "llm").glob("model-*.safetensors"))) > 1  # the LLM really is sharded
    cfg = load_model(dst).cfg
    assert cfg.template == "llama_3" and cfg.tokenizer == "tokenizer.json" and cfg.eos_ids == (257, 260)
    assert cfg.vision.n_run_layers == V_LAYERS - 1 and cfg.vision.image_mean == (0.4, 0.5, 0.6)
    assert cfg.text.max_seq_len == 256 and cfg.projector.kind == "mlp_downsample" and not cfg.synthetic
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (dst / f).read_bytes() == (src / "llm" / f).read_bytes()


def test_every_tensor_matches_its_source(vila):
    src, _, dst = vila
    expected, dropped = _expected(src)
    loaded = load_model(dst).state_dict()
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k
    # Every HF tensor is used: each source tensor's values appear in what was loaded, or it is a dropped one.
    n_hf = sum(len(_hf(src / d)) for d in ("llm", "vision_tower", "mm_projector"))
    # Fusion turns 3 tensors into 1 (q, k, v) or 2 into 1 (gate, up): 3 fewer per LLM layer, and 2 x 2
    # fewer per vision layer (weights and biases).
    n_merged = 3 * T_LAYERS + 4 * (V_LAYERS - 1)
    assert n_hf == len(expected) + n_merged + len(dropped)


def test_vision_tower_matches_hf(vila):
    src, hf_vision, dst = vila
    model = load_model(dst)
    img = np.random.default_rng(0).integers(0, 256, (45, 61, 3), dtype=np.uint8)
    pixels = preprocess(img, model.cfg.vision)
    with torch.no_grad():
        ours = model.vision(pixels)
        ref = hf_vision(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
    assert ours.shape == ref.shape == (1, 16, V_DIM)
    assert (ours - ref).abs().max() < 1e-5


def _copy_with(src: Path, tmp: Path, edit) -> Path:
    bad = Path(shutil.copytree(src, tmp / "VILA-bad"))
    edit(bad)
    return bad


def test_unused_hf_tensor_is_an_error(vila, tmp_path):
    def add_tensor(folder):
        sd = load_file(folder / "mm_projector" / "model.safetensors")
        sd["layers.7.weight"] = torch.zeros(2)
        save_file(sd, folder / "mm_projector" / "model.safetensors")
    bad = _copy_with(vila[0], tmp_path, add_tensor)
    with pytest.raises(CheckpointError, match=r"mm_projector: layers.7.weight: never used"):
        import_vila(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_hf_tensor_read_twice_is_an_error(vila, tmp_path):
    def twice(hf, cfg):
        out, used = projector_weights_from_hf(hf, cfg)
        _ = hf["layers.2.weight"]
        return out, used
    hf = HFTensors(vila[0] / "mm_projector")
    out, used = twice(hf, load_model(vila[2]).cfg.projector)
    assert account("mm_projector", hf, used) == ["mm_projector: layers.2.weight: read 2 times"]


def test_pickle_weights_are_read_safely(vila, tmp_path):
    """A pytorch_model.bin projector imports the same (torch.load with weights_only=True)."""
    def to_bin(folder):
        proj = folder / "mm_projector"
        torch.save(load_file(proj / "model.safetensors"), proj / "pytorch_model.bin")
        (proj / "model.safetensors").unlink()
    bad = _copy_with(vila[0], tmp_path, to_bin)
    ours = load_model(import_vila(bad, tmp_path / "out", dtype="float32")).state_dict()
    ref = load_model(vila[2]).state_dict()
    assert torch.equal(ours["projector.fc1.weight"], ref["projector.fc1.weight"])


def test_unsupported_vila_options(vila, tmp_path):
    def pad(folder):
        top = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(top | {"image_aspect_ratio": "pad"}))
    bad = _copy_with(vila[0], tmp_path, pad)
    with pytest.raises(CheckpointError, match="image_aspect_ratio 'pad'"):
        import_vila(bad, tmp_path / "out")


def test_cli(vila, tmp_path, capsys):
    src = vila[0]
    assert quantize_main(["import-vila", str(src), str(tmp_path / "a"), "--dtype", "bfloat16",
                          "--max-seq-len", "64", "--template", "llama_3"]) == 0
    cfg = load_model(tmp_path / "a").cfg
    assert cfg.dtype == "bfloat16" and cfg.text.max_seq_len == 64
    assert quantize_main(["import-vila", str(src), str(tmp_path / "a")]) == 1  # exists: refuses
    assert "overwrite" in capsys.readouterr().err
    assert quantize_main(["import-vila", str(tmp_path / "missing"), str(tmp_path / "b")]) == 1
    assert "missing: VILA folder not found" in capsys.readouterr().err
    assert quantize_main(["synthetic", "--preset", "tiny-clip-qwen2", str(tmp_path / "s"), "--seed", "3"]) == 0
    assert load_model(tmp_path / "s").cfg.synthetic
