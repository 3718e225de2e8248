"""`quantize.py import` and `build` (tinyvila/convert/build.py, detect.py) on tiny sources in the published layouts.

Run: python -m pytest tests/test_build.py -q (skips without transformers, which writes the tiny HF models).
Fixtures: the fp VILA folder of tests/test_import.py with llm/config.json saying bfloat16, as
Llama-3-VILA1.5-8B's does; the llm-awq v2 and AutoAWQ folders of tests/test_importers.py. `build` uses its
offline defaults (pydoc calibration text, scikit-image's photos), cut short (--n-samples 2 --seqlen 64).
"""

import json

import pytest
import torch
import torch.nn.functional as F

import test_import as tim
import test_importers as tis
from scripts.quantize import main as quantize_main
import tinyvila
from tinyvila.convert import build as convert_build
from tinyvila.convert.detect import detect
from tinyvila.convert.smoothquant import bundled_photos
from tinyvila.errors import CheckpointError, TinyVilaError
from tinyvila.image import preprocess
from tinyvila.loader import load_model

# Measured 0.99995 mean (min 0.99980) per-token cosine of the W8A8 tower's features to the bf16 dense
# tower's, tiny random SigLIP, 13 held-out photos, CPU fp32 compute; a wrong scale or fold falls far below.
MIN_VISION_COS = 0.9995
FAST = ["--group-size", "32", "--n-samples", "2", "--seqlen", "64", "--device", "cpu"]


@pytest.fixture(scope="module")
def vila(tmp_path_factory):
    """A tiny fp VILA1.5 folder whose llm/config.json says bfloat16."""
    src = tmp_path_factory.mktemp("build") / "VILA-tiny"
    src.mkdir()
    tim._llm(src / "llm")
    tim._vision(src / "vision_tower")
    tim._projector(src / "mm_projector")
    tim._top(src)
    cfg = json.loads((src / "llm" / "config.json").read_text())
    (src / "llm" / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    return src


@pytest.fixture(scope="module")
def built(vila):
    dst = vila.parent / "checkpoints" / "vila-tiny-awq"
    assert quantize_main(["build", str(vila), str(dst), *FAST]) == 0
    return dst


def vision_features(folder, photos) -> torch.Tensor:
    """The vision tower's output features (B, T, D), fp32 compute, for image files."""
    model = load_model(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.vision(preprocess([str(p) for p in photos], model.cfg.vision))


def test_build_vila_folder_is_w4_and_w8a8(built, vila):
    cfg = load_model(built).cfg
    assert (cfg.quant.llm, cfg.quant.vision, cfg.quant.group_size, cfg.dtype) == ("w4a16", "w8a8", 32, "bfloat16")
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    dense = load_model(tinyvila.convert.import_vila(vila, vila.parent / "dense")).state_dict()
    ours = load_model(built).state_dict()
    for k in ("projector.fc1.weight", "projector.norm.bias", "text.embed.weight"):  # as imported
        assert torch.equal(ours[k], dense[k]), k


def test_build_runs_end_to_end_and_vision_stays_close(built, vila):
    vlm = tinyvila.load(built, dtype=torch.float32)
    chat = vlm.chat(sampling=tinyvila.SamplingParams(max_new_tokens=4))
    chat.add_image(str(bundled_photos()[0]))
    answer = "".join(chat.ask("What is in the picture?"))
    st = chat.stats
    assert st.images == 1 and st.visual_tokens > 0 and 1 <= st.decode_tokens <= 4 and isinstance(answer, str)
    held_out = bundled_photos()[8:]  # build calibrates on the first 8
    dense = tinyvila.convert.import_vila(vila, vila.parent / "dense16", dtype="bfloat16")
    ref, q = vision_features(dense, held_out), vision_features(built, held_out)
    cos = F.cosine_similarity(q.double(), ref.double(), dim=-1)  # (B, T)
    assert len(held_out) >= 5 and 0.5 < cos.mean() < 1 and cos.mean() >= MIN_VISION_COS, cos.mean()


@pytest.mark.parametrize("fmt", ["v2", "vila-autoawq"])
def test_build_w4_source_keeps_the_llm_as_imported(tmp_path, fmt, capsys):
    """Published AWQ folders (llm/config.json in bfloat16): the LLM tensors are exactly what import gives,
    the vision tower becomes W8A8."""
    if fmt == "v2":
        src, _ = tis._v2_folder(tmp_path, 64, torch_dtype="bfloat16")
    else:
        src, _ = tis._autoawq_folder(tmp_path, 64, torch_dtype="bfloat16", vila=True)
    assert quantize_main(["build", str(src), str(tmp_path / "q"), "--group-size", "64", "--device", "cpu"]) == 0
    assert detect(src).found in capsys.readouterr().err
    assert quantize_main(["import", str(src), str(tmp_path / "i"), "--group-size", "64"]) == 0
    q, i = load_model(tmp_path / "q"), load_model(tmp_path / "i")
    assert (q.cfg.quant.llm, q.cfg.quant.vision, q.cfg.dtype) == ("w4a16", "w8a8", "float16")
    assert i.cfg.quant.vision == "none"
    qs, is_ = q.state_dict(), i.state_dict()
    assert all(torch.equal(qs[k], v) for k, v in is_.items() if k.startswith("text."))


def test_import_detects_every_layout(tmp_path, vila, capsys):
    v2, _ = tis._v2_folder(tmp_path / "a", 128)
    vila_awq, _ = tis._autoawq_folder(tmp_path / "b", 64, vila=True)
    bare, _ = tis._autoawq_folder(tmp_path / "c", 64)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    kinds = {k: detect(p).kind for k, p in (("vila", vila), ("v2", v2), ("va", vila_awq), ("bare", bare), ("g", gguf))}
    assert kinds == {"vila": "vila", "v2": "vila-awq-v2", "va": "vila-autoawq", "bare": "autoawq", "g": "gguf"}
    for i, src in enumerate((vila, v2, vila_awq, bare)):
        assert quantize_main(["import", str(src), str(tmp_path / f"out{i}")]) == 0
        assert detect(src).found in capsys.readouterr().err
        assert (load_model(tmp_path / f"out{i}").vision is None) == (src == bare)


def test_build_failure_writes_nothing(tmp_path, vila, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("calibration failed")
    monkeypatch.setattr(convert_build, "smoothquant", broken)
    dst = tmp_path / "ckpt" / "vila-tiny-awq"
    with pytest.raises(RuntimeError, match="calibration failed"):
        convert_build.build_checkpoint(vila, dst, group_size=32, n_samples=2, seqlen=64, device="cpu")
    assert list((tmp_path / "ckpt").iterdir()) == []  # neither DST nor a temp folder


def test_wrong_layouts_name_path_found_and_command(tmp_path, vila):
    v2, _ = tis._v2_folder(tmp_path, 128)
    with pytest.raises(CheckpointError, match="import-vila expects an fp16/bf16 VILA folder.*found a VILA AWQ "
                                              "folder.*import-awq-v2") as e:
        tinyvila.convert.import_vila(v2, tmp_path / "out")
    assert str(v2) in str(e.value)
    with pytest.raises(CheckpointError, match="import-awq-v2 expects a VILA AWQ folder.*found an fp16/bf16 VILA "
                                              "folder.*import-vila"):
        tinyvila.convert.import_awq_v2(vila, tmp_path / "out")
    with pytest.raises(CheckpointError, match="import-autoawq expects .*found an fp16/bf16 VILA folder.*import-vila"):
        tinyvila.convert.import_autoawq(vila, tmp_path / "out")
    with pytest.raises(CheckpointError, match="import-gguf expects a .gguf file"):
        tinyvila.convert.import_gguf(vila, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["vila", "v2", "gguf"])
def test_chat_on_a_raw_source_names_the_command(tmp_path, vila, kind):
    """--model RAW_FOLDER fails with the exact quantize.py lines (it said "not a valid tinyvila config")."""
    src = {"vila": lambda: vila, "v2": lambda: tis._v2_folder(tmp_path, 128)[0],
           "gguf": lambda: tmp_path / "model.gguf"}[kind]()
    if kind == "gguf":
        src.write_bytes(b"GGUF")
    with pytest.raises(TinyVilaError) as e:
        tinyvila.load(src)
    msg = str(e.value)
    assert f"python scripts/quantize.py build {src} checkpoints/" in msg
    assert f"python scripts/quantize.py import {src} checkpoints/" in msg


def test_missing_awq_model_names_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYVILA_CHECKPOINTS", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TinyVilaError) as e:
        tinyvila.load("vila-8b-awq")
    msg = str(e.value)
    assert "quantize.py build /path/to/Llama-3-VILA1.5-8B checkpoints/vila-8b-awq" in msg
    assert "quantize.py build /path/to/Llama-3-VILA1.5-8B-Fix-AWQ checkpoints/vila-8b-awq" in msg


def test_build_a_dense_tinyvila_checkpoint(tmp_path):
    """A dense tinyvila checkpoint (here the demo's preset) is a source too: both halves get quantized."""
    from tinyvila.loader import build_synthetic

    src = build_synthetic(tmp_path / "dense", "tiny-siglip-llama", seed=0)
    assert quantize_main(["build", str(src), str(tmp_path / "q"), *FAST]) == 0
    assert quantize_main(["import", str(src), str(tmp_path / "i")]) == 1  # nothing to import: says so
    q = load_model(tmp_path / "q")
    assert (q.cfg.quant.llm, q.cfg.quant.vision) == ("w4a16", "w8a8") and q.cfg.text == load_model(src).cfg.text
