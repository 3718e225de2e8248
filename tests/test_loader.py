"""tinyvila.loader: save/load round trips, synthetic weights, and every way a checkpoint can be bad.

Run: pytest tests/test_loader.py. Each bad-checkpoint case asserts that the error names the file and
tensor at fault and that loading left every file on disk byte-identical.
"""

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tinyvila
from tinyvila.config import PRESETS, preset
from tinyvila.errors import CheckpointError, DeviceError, ModelNotFoundError, TinyVilaError, TokenizerError
from tinyvila.image import preprocess
from tinyvila.loader import (INDEX, WEIGHTS, build_synthetic, expected_tensors, load_checkpoint, load_model,
                             random_state_dict, save_checkpoint, synthetic_tokenizer)
from tinyvila.tokenizer import TEMPLATES, load_tokenizer

TINY = [name for name in PRESETS if name.startswith("tiny")]
SHARD = 20_000  # bytes: splits the tiny presets into many shards


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return build_synthetic(tmp_path_factory.mktemp("ck") / "tiny", "tiny-siglip-llama", seed=0)


@pytest.fixture(scope="module")
def good_sharded(tmp_path_factory) -> Path:
    return build_synthetic(tmp_path_factory.mktemp("ck") / "tiny", "tiny-siglip-llama", seed=0, max_shard_bytes=SHARD)


@pytest.fixture
def copy(good, tmp_path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "bad"))


# -- round trips -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("shard", [None, SHARD], ids=["single", "sharded"])
def test_round_trip(tmp_path, name, shard):
    cfg = dataclasses.replace(preset(name), synthetic=True)
    sd = random_state_dict(cfg, seed=3)
    kw = {} if shard is None else {"max_shard_bytes": shard}
    folder = save_checkpoint(tmp_path / "ck", cfg, sd, {"note.txt": "hi", "blob.bin": b"\x00\x01"}, **kw)
    files = {p.name for p in folder.iterdir()}
    assert (INDEX in files) == (shard is not None) and (WEIGHTS in files) == (shard is None)
    n_files = len([f for f in files if f.endswith(".safetensors")])
    assert n_files == 1 if shard is None else n_files > 1
    assert (folder / "note.txt").read_text() == "hi" and (folder / "blob.bin").read_bytes() == b"\x00\x01"
    model = load_model(folder)
    assert model.cfg == cfg and not model.training
    loaded = model.state_dict()
    assert loaded.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k


def test_sharded_has_many_shards(good_sharded):
    shards = sorted(p.name for p in good_sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((good_sharded / INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in random_state_dict(load_model(good_sharded).cfg).values())


def test_load_dtype_and_device(good):
    model = load_model(good, device="cpu", dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    model = load_model(good, dtype="bfloat16")
    assert model.dtype == torch.bfloat16


def test_synthetic_folder(good):
    cfg = json.loads((good / "config.json").read_text())
    assert cfg["synthetic"] is True and cfg["tokenizer"] == "tokenizer.json" and cfg["eos_ids"] == []
    template = TEMPLATES[cfg["template"]]
    tok = load_tokenizer(good / cfg["tokenizer"])
    for s in template.special_tokens:  # each special token is one id inside the model's vocab
        ids = tok.encode(s, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] < cfg["text"]["vocab_size"]
    assert tok.encode("hi")[0] == tok.token_to_id(template.bos)  # BOS added like the real tokenizer


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_synthetic_tokenizer_fits_every_preset(name):
    tok = synthetic_tokenizer(preset(name))
    assert len(tok["added_tokens"]) == len(TEMPLATES[preset(name).template].special_tokens)


def test_synthetic_tokenizer_too_big_vocab():
    cfg = preset("tiny-siglip-llama")
    small = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, vocab_size=100))
    with pytest.raises(ValueError, match="vocab_size is 100"):
        synthetic_tokenizer(small)


def test_random_state_dict_is_deterministic_and_complete():
    cfg = preset("tiny-clip-qwen2")
    a, b, c = random_state_dict(cfg, 0), random_state_dict(cfg, 0), random_state_dict(cfg, 1)
    spec = expected_tensors(cfg)
    assert a.keys() == spec.keys()
    for k, (shape, dtype) in spec.items():
        assert a[k].shape == shape and a[k].dtype == dtype and torch.equal(a[k], b[k])
        assert not torch.equal(a[k], c[k]), k
    norm = a["text.layers.0.attn_norm.weight"]
    assert (norm - 1).abs().max() < 0.2 and a["text.embed.weight"].std() < 0.05


@pytest.mark.parametrize("name", TINY)
def test_synthetic_activations_are_sane(tmp_path, name):
    model = load_model(build_synthetic(tmp_path / "ck", name, seed=0))
    img = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    with torch.no_grad():
        emb = model.encode_images(preprocess(img, model.cfg.vision))
    assert emb.shape == (1, model.cfg.image_tokens, model.cfg.text.dim)
    assert torch.isfinite(emb).all() and 1e-3 < emb.std() < 10


# -- bad checkpoints ------------------------------------------------------------------------------
def _rewrite(folder: Path, edit) -> None:
    sd = load_file(folder / WEIGHTS)
    edit(sd)
    save_file(sd, folder / WEIGHTS)


def _truncate(folder):
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[:len(data) // 2])


def _corrupt_header(folder):
    data = bytearray((folder / WEIGHTS).read_bytes())
    data[8:20] = b"#" * 12  # inside the JSON header
    (folder / WEIGHTS).write_bytes(bytes(data))


BAD = {
    "truncated": (_truncate, [WEIGHTS, "truncated or corrupt"]),
    "corrupt header": (_corrupt_header, [WEIGHTS, "truncated or corrupt"]),
    "missing tensor": (lambda f: _rewrite(f, lambda sd: sd.pop("text.layers.1.mlp.w2.weight")),
                       ["text.layers.1.mlp.w2.weight: missing", "(64, 128) float32"]),
    "unexpected tensor": (lambda f: _rewrite(f, lambda sd: sd.update({"text.extra.weight": torch.ones(3)})),
                          [WEIGHTS, "text.extra.weight: unexpected tensor"]),
    "wrong shape": (lambda f: _rewrite(f, lambda sd: sd.update({"vision.pos_embed": torch.zeros(65, 48)})),
                    [WEIGHTS, "vision.pos_embed: found (65, 48) float32, expected (64, 48) float32"]),
    "wrong dtype": (lambda f: _rewrite(f, lambda sd: sd.update({"projector.fc1.bias": sd["projector.fc1.bias"].half()})),
                    [WEIGHTS, "projector.fc1.bias: found (64,) float16, expected (64,) float32"]),
    "no weights": (lambda f: (f / WEIGHTS).unlink(), [f"neither {WEIGHTS} nor {INDEX}"]),
    "bad config": (lambda f: (f / "config.json").write_text("{not json"), ["config.json", "not a valid tinyvila config"]),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoint(copy, case):
    corrupt, needles = BAD[case]
    corrupt(copy)
    before = _hashes(copy)
    with pytest.raises(CheckpointError) as e:
        load_model(copy)
    for needle in needles:
        assert needle in str(e.value)
    assert str(copy) in str(e.value)
    assert "scripts/quantize.py" in str(e.value)  # says what to do
    assert _hashes(copy) == before


def _shard_names(folder):
    return sorted(p.name for p in folder.glob("model-*.safetensors"))


def test_sharded_missing_shard(good_sharded, tmp_path):
    folder = Path(shutil.copytree(good_sharded, tmp_path / "bad"))
    victim = _shard_names(folder)[1]
    (folder / victim).unlink()
    before = _hashes(folder)
    with pytest.raises(CheckpointError, match=f"{victim}: not found"):
        load_model(folder)
    assert _hashes(folder) == before


def test_sharded_tensor_not_in_index(good_sharded, tmp_path):
    folder = Path(shutil.copytree(good_sharded, tmp_path / "bad"))
    index = json.loads((folder / INDEX).read_text())
    files = list(index["weight_map"].values())
    name = next(k for k, f in index["weight_map"].items() if files.count(f) > 1)  # its shard stays listed
    del index["weight_map"][name]
    (folder / INDEX).write_text(json.dumps(index))
    before = _hashes(folder)
    with pytest.raises(CheckpointError, match=f"{name}: in the shard but not in {INDEX}"):
        load_model(folder)
    assert _hashes(folder) == before


def test_missing_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match=str(tmp_path / "nowhere")):
        load_model(tmp_path / "nowhere")


def test_missing_config(good, tmp_path):
    folder = Path(shutil.copytree(good, tmp_path / "noconf"))
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=str(folder / "config.json")):  # ModelNotFoundError is one
        load_model(folder)


# -- atomic saving ----------------------------------------------------------------------------------
def test_save_refuses_to_overwrite(good, tmp_path):
    folder = Path(shutil.copytree(good, tmp_path / "ck"))
    cfg = load_model(folder).cfg
    before = _hashes(folder)
    with pytest.raises(FileExistsError, match="overwrite"):
        save_checkpoint(folder, cfg, random_state_dict(cfg, seed=5))
    assert _hashes(folder) == before
    save_checkpoint(folder, cfg, random_state_dict(cfg, seed=5), overwrite=True)
    assert _hashes(folder) != before and "tokenizer.json" not in _hashes(folder)  # replaced, not merged
    assert torch.equal(load_model(folder).state_dict()["text.norm.weight"],
                       random_state_dict(cfg, seed=5)["text.norm.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp or backup folders left


def test_save_into_empty_folder(tmp_path):
    (tmp_path / "ck").mkdir()
    cfg = preset("tiny-clip-qwen2")
    save_checkpoint(tmp_path / "ck", cfg, random_state_dict(cfg))
    assert load_model(tmp_path / "ck").cfg == cfg


def test_failure_mid_save_leaves_nothing(tmp_path):
    cfg = preset("tiny-siglip-llama")
    # The weights are written before the extra files, so this fails after most of the work.
    with pytest.raises(TypeError, match="bad.txt"):
        save_checkpoint(tmp_path / "ck", cfg, random_state_dict(cfg), {"ok.txt": "x", "bad.txt": 12})
    assert list(tmp_path.iterdir()) == []


def test_save_rejects_mismatched_state_dict(tmp_path):
    cfg = preset("tiny-siglip-llama")
    sd = random_state_dict(cfg)
    sd["text.norm.weight"] = torch.ones(65)
    del sd["vision.pos_embed"]
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path / "ck", cfg, sd)
    assert "text.norm.weight: found (65,)" in str(e.value) and "vision.pos_embed: missing" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_save_tensors_sharing_storage(tmp_path):
    """One tensor under two names (as tied or aliased weights are) is saved; safetensors alone refuses."""
    cfg = preset("tiny-siglip-llama")
    sd = random_state_dict(cfg)
    sd["vision.layers.0.norm2.weight"] = sd["vision.layers.0.norm1.weight"]
    loaded = load_model(save_checkpoint(tmp_path / "ck", cfg, sd)).state_dict()
    assert torch.equal(loaded["vision.layers.0.norm2.weight"], sd["vision.layers.0.norm1.weight"])


def test_saved_checkpoints_take_the_users_umask(tmp_path):
    """A built checkpoint folder and its files get the umask's permissions (not mkdtemp's 0700), so a shared
    checkpoints/ directory is readable by the others it is shared with."""
    import os

    old = os.umask(0o022)
    try:
        folder = build_synthetic(tmp_path / "ck", "tiny-siglip-llama")
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o755
    files = [f for f in folder.iterdir() if f.is_file()]
    assert files and all(f.stat().st_mode & 0o777 == 0o644 for f in files)


# -- paths stay inside the folder ---------------------------------------------------------------------
def _set_config(folder: Path, **values) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **values}))


def _as_sharded(folder: Path, shard: str = "model-00001-of-00001.safetensors") -> dict:
    """The single weights file moved to a one-shard layout with an index; returns the index (to edit)."""
    names = list(load_file(folder / WEIGHTS))
    (folder / WEIGHTS).rename(folder / shard)
    return {"metadata": {}, "weight_map": {n: shard for n in names}}


def test_tokenizer_may_not_leave_the_folder(copy, tmp_path):
    outside = tmp_path / "outside.json"
    shutil.copy(copy / "tokenizer.json", outside)
    _set_config(copy, tokenizer="/etc/passwd")
    with pytest.raises(CheckpointError, match="config.json.*tokenizer must be a file name inside"):
        load_checkpoint(copy)
    _set_config(copy, tokenizer="sub/../../outside.json")
    with pytest.raises(CheckpointError, match="tokenizer must be a file name inside"):
        load_checkpoint(copy)
    (copy / "tokenizer.json").unlink()
    (copy / "tokenizer.json").symlink_to(outside)  # a symlink out of the folder counts as outside
    _set_config(copy, tokenizer="tokenizer.json")
    with pytest.raises(CheckpointError, match="config.json: tokenizer: 'tokenizer.json' must name a file inside"):
        load_checkpoint(copy)


@pytest.mark.parametrize("name", ["ABSOLUTE", "../elsewhere.safetensors", "link.safetensors"])
def test_shard_index_may_not_leave_the_folder(copy, tmp_path, name):
    index = _as_sharded(copy)
    elsewhere = tmp_path / "elsewhere.safetensors"  # a valid shard, outside the checkpoint folder
    elsewhere.write_bytes((copy / "model-00001-of-00001.safetensors").read_bytes())
    name = str(elsewhere) if name == "ABSOLUTE" else name
    if name == "link.safetensors":
        (copy / name).symlink_to(elsewhere)
    index["weight_map"] = {k: name for k in index["weight_map"]}
    (copy / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{INDEX}: weight_map: '{name}' must name a file inside"):
        load_model(copy)


def test_one_shard_index_inside_the_folder_loads(copy):
    (copy / INDEX).write_text(json.dumps(_as_sharded(copy)))
    assert load_model(copy).cfg.text.dim == 64


# -- tokenizer first, and it must fit the model -----------------------------------------------------
def test_tokenizer_is_read_before_the_weights(copy, monkeypatch):
    import tinyvila.loader as loader

    opened = []
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: opened.append(a) or pytest.fail("weights read first"))
    (copy / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        tinyvila.load(copy)
    assert opened == []


def test_tokenizer_ids_beyond_the_vocabulary_fail_at_load(copy):
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][0], "id": 700, "content": "<|extra|>"})
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TokenizerError, match="tokenizer.json: holds token ids up to 700, but config.json "
                                             "text.vocab_size is 512"):
        tinyvila.load(copy)


# -- filesystem oddities --------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", ["config.json", WEIGHTS, "tokenizer.json"])
@pytest.mark.parametrize("oddity", ["directory", "broken symlink", "empty file"])
def test_filesystem_oddities_name_the_file(copy, tmp_path, victim, oddity):
    (copy / victim).unlink()
    if oddity == "directory":
        (copy / victim).mkdir()
    elif oddity == "broken symlink":
        (copy / victim).symlink_to(tmp_path / "gone")
    else:
        (copy / victim).write_bytes(b"")
    with pytest.raises(TinyVilaError) as e:
        tinyvila.load(copy)
    assert victim in str(e.value)


# -- finite weights (verify=) -----------------------------------------------------------------------------
def test_verify_finds_nan_weights(copy):
    _rewrite(copy, lambda sd: sd["text.layers.1.mlp.w2.weight"].view(-1)[7:9].fill_(float("nan")))
    tinyvila.load(copy)  # unchecked by default on the CPU: a memory map, no weight read
    with pytest.raises(CheckpointError, match=f"{WEIGHTS}: text.layers.1.mlp.w2.weight: holds NaN or infinite"):
        tinyvila.load(copy, verify=True)


@pytest.mark.gpu
def test_weights_are_verified_on_a_gpu_by_default(copy):
    _rewrite(copy, lambda sd: sd["vision.pos_embed"].view(-1)[3].fill_(float("inf")))
    with pytest.raises(CheckpointError, match="vision.pos_embed: holds NaN or infinite"):
        tinyvila.load(copy, device="cuda")
    tinyvila.load(copy, device="cuda", verify=False)


# -- devices --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["gpu", "tpu", "meta", "cuda:99"])
def test_bad_devices_are_refused_before_loading(good, device):
    with pytest.raises(DeviceError, match=f"device '{device}' \\(--device\\)"):
        tinyvila.load(good, device=device)


@pytest.mark.cpu_only
def test_cuda_without_cuda_is_a_clear_error(good):
    with pytest.raises(DeviceError, match="no CUDA GPU is available.*use cpu"):
        tinyvila.load(good, device="cuda")


def test_cuda_without_triton_is_refused_at_load_naming_the_extra(good, monkeypatch):
    """A CUDA device but no Triton (a CPU install later given a GPU): refused before loading, not at the first
    kernel launch mid-answer."""
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(DeviceError, match=r"need Triton.*pip install -e \"\.\[gpu\]\""):
        tinyvila.load(good, device="cuda")


# -- the first-use demo build ------------------------------------------------------------------------
def _build_demo(root: str, barrier, results) -> None:
    """One of several processes starting the demo at once (spawned: module level)."""
    import tinyvila.api as api

    api.checkpoint_dirs = lambda: [Path(root)]  # only the test's folder, not the user's checkpoints/
    barrier.wait()
    try:
        folder = api.resolve_model(api.DEMO_MODEL)
        results.put(("ok", str(folder), tinyvila.load(folder).cfg.text.dim))
    except Exception as e:  # noqa: BLE001 -- reported to the parent, which asserts there is none
        results.put(("error", type(e).__name__, str(e)))


def test_three_processes_building_the_demo_at_once(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_build_demo, args=(str(tmp_path), barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert got == [("ok", str(tmp_path / "demo"), 64)] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no temp or half-built folders left


def test_partial_or_stale_demo_is_rebuilt(tmp_path, monkeypatch):
    import tinyvila.api as api

    monkeypatch.setattr(api, "checkpoint_dirs", lambda: [tmp_path])
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.json").write_text("{}")  # a build killed half-way, before renames were atomic
    assert tinyvila.load("demo").cfg.text.dim == 64
    _set_config(tmp_path / "demo", sparsity={"prefill_keep": 0.5})  # an older demo: rebuilt to today's
    assert tinyvila.load("demo").cfg.sparsity.prefill_keep == 1.0
    _set_config(tmp_path / "demo", synthetic=False)  # real weights under that name are never touched
    assert tinyvila.load("demo").cfg.synthetic is False


def test_ctrl_c_during_a_checkpoint_write_prints_a_line(tmp_path, monkeypatch, capsys):
    import tinyvila.loader as loader
    from scripts import quantize

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_write_extras", interrupted)  # after the weights: most of the work is done
    assert quantize.main(["synthetic", "--preset", "tiny-siglip-llama", str(tmp_path / "ck")]) == 130
    assert capsys.readouterr().err.strip() == f"interrupted: nothing was written to {tmp_path / 'ck'}"
    assert list(tmp_path.iterdir()) == []  # the temp folder is gone too


def test_cli_refuses_a_context_past_the_declared_one(good, capsys):
    from tinyvila import chat as cli

    assert cli.main(["--model", str(good), "--max-seq-len", "513", "-p", "hi", "--device", "cpu"]) == 1
    assert "--max-seq-len 513 is past the model's declared context of 512 tokens" in capsys.readouterr().err
    assert cli.main(["--model", str(good), "--max-seq-len", "512", "-p", "hi", "--max-new-tokens", "2",
                     "--device", "cpu"]) == 0


@pytest.mark.parametrize("argv,words", [
    (["--device", "gpu"], "device 'gpu' (--device): tinyvila runs on cpu, cuda or cuda:N"),
    (["--verify"], "weights are not finite"),
])
def test_cli_load_errors_are_one_line(copy, capsys, argv, words):
    from tinyvila import chat as cli

    _rewrite(copy, lambda sd: sd["text.norm.weight"].fill_(float("inf")))
    assert cli.main(["--model", str(copy), "-p", "hi", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err
