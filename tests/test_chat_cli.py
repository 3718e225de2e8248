"""The chat CLI end to end on CPU: one-shot, the REPL's commands, the demo model, and bad input."""

import builtins
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import tinyvila
from tinyvila import chat as cli
from tinyvila.generate import Decoder
from tinyvila.loader import build_synthetic

DEMO_IMAGE = str(Path(tinyvila.__file__).parent / "assets" / "demo.png")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    build_synthetic(path, "tiny-clip-qwen2", seed=1)
    return str(path)


def test_one_shot_streams_an_answer_and_stats(folder, capsys):
    rc = cli.main(["--model", folder, "--image", DEMO_IMAGE, "-p", "What is this?", "--max-new-tokens", "6"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "RANDOM weights" in err
    assert "decode 6 tok" in err and "encode" in err and "prefill" in err


def test_repl_commands(folder, capsys, monkeypatch):
    lines = iter(["/image " + DEMO_IMAGE, "describe", "/stats", "/clear", "hello", "/bogus", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    rc = cli.main(["--model", folder, "--max-new-tokens", "3"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "[image added" in out and "[conversation cleared]" in out
    assert out.count("decode 3 tok") == 1  # the /stats line (the per-answer lines go to stderr)
    assert "commands:" in out  # help shown for /bogus


def test_repl_ends_on_ctrl_d_and_reports_errors_without_dying(folder, capsys, monkeypatch):
    def fake_input(prompt=""):
        if not hasattr(fake_input, "n"):
            fake_input.n = 0
        fake_input.n += 1
        if fake_input.n == 1:
            return "/image /nonexistent/picture.png"
        raise EOFError
    monkeypatch.setattr(builtins, "input", fake_input)
    rc = cli.main(["--model", folder])
    _, err = capsys.readouterr()
    assert rc == 0 and "picture.png" in err


def test_missing_model_names_the_places_looked_and_how_to_build(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TINYVILA_CHECKPOINTS", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # ./checkpoints is then not the repo's own checkpoints/
    rc = cli.main(["--model", "no-such-model", "-p", "hi"])
    _, err = capsys.readouterr()
    assert rc == 1
    places = tinyvila.api.checkpoint_dirs()
    assert len(places) == 3 and places[0] == tmp_path  # $TINYVILA_CHECKPOINTS, ./checkpoints, the repo's
    for place in places:  # every place looked is named
        assert str(place / "no-such-model") in err
    assert "scripts/quantize.py synthetic" in err and "scripts/quantize.py import-vila" in err


def _truncate_weights(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 3])


def _drop_tensor(folder: Path) -> None:
    sd = load_file(folder / "model.safetensors")
    del sd["text.layers.0.mlp.w2.weight"]
    save_file(sd, folder / "model.safetensors")


@pytest.mark.parametrize("corrupt, needles", [
    (_truncate_weights, ["model.safetensors", "truncated or corrupt"]),
    (_drop_tensor, ["text.layers.0.mlp.w2.weight: missing (expected (64, 128) float32)"]),
], ids=["truncated", "missing-tensor"])
def test_bad_checkpoint_exits_non_zero_and_changes_no_file(folder, tmp_path, capsys, corrupt, needles):
    bad = Path(shutil.copytree(folder, tmp_path / "bad"))
    corrupt(bad)
    before = {p.name: p.read_bytes() for p in bad.iterdir()}
    rc = cli.main(["--model", str(bad), "--image", DEMO_IMAGE, "-p", "hi"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert f"error: {bad}: " in err and "scripts/quantize.py" in err
    assert all(needle in err for needle in needles), err
    assert {p.name: p.read_bytes() for p in bad.iterdir()} == before


def test_ctrl_c_stops_an_answer_and_the_repl_goes_on(folder, capsys, monkeypatch):
    """A KeyboardInterrupt inside decoding (where Ctrl-C lands) ends that answer only."""
    real, calls = Decoder.greedy, []

    def interrupted(self, *args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, *args, **kw)

    monkeypatch.setattr(Decoder, "greedy", interrupted)
    lines = iter(["describe", "again", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    rc = cli.main(["--model", folder, "--max-new-tokens", "20"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.count("[stopped]") == 1
    stats = [x for x in err.splitlines() if "decode" in x and "tok/s" in x]
    assert len(stats) == 2
    assert "decode 1 tok" in stats[0] and stats[0].endswith("interrupted]")  # only the prefill's token
    assert "decode 20 tok" in stats[1] and stats[1].endswith("max_tokens]")


def test_no_huggingface_library_is_imported_at_run_time(folder):
    """A whole one-shot answer (load, tokenizer, image, generate) imports none of the test oracles."""
    code = ("import sys; from tinyvila import chat; "
            f"rc = chat.main(['--model', {folder!r}, '--image', {DEMO_IMAGE!r}, '-p', 'hi', '--max-new-tokens', '3']); "
            "hf = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('transformers', 'tokenizers', 'huggingface_hub', 'sentencepiece_model_pb2')); "
            "print('RC', rc, 'HF', hf)")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "RC 0 HF []" in run.stdout, run.stdout + run.stderr


def test_unreadable_image_exits_non_zero(folder, tmp_path, capsys):
    bad = tmp_path / "x.png"
    bad.write_bytes(b"\x89PNG garbage")
    rc = cli.main(["--model", folder, "--image", str(bad), "-p", "hi"])
    _, err = capsys.readouterr()
    assert rc == 1 and "x.png" in err


def test_prompt_over_the_context_exits_non_zero(folder, capsys):
    rc = cli.main(["--model", folder, "--max-seq-len", "40", "-p", "word " * 50])
    _, err = capsys.readouterr()
    assert rc == 1 and "context is 40" in err


def test_demo_model_is_built_on_first_use(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TINYVILA_CHECKPOINTS", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    # Only tmp_path: a demo built earlier in the repo's own checkpoints/ must not be found instead.
    monkeypatch.setattr(tinyvila.api, "checkpoint_dirs", lambda: [tmp_path])
    rc = cli.main(["--model", "demo", "--image", DEMO_IMAGE, "-p", "hi", "--max-new-tokens", "4"])
    _, err = capsys.readouterr()
    assert rc == 0 and "RANDOM weights" in err
    assert (tmp_path / "demo" / "config.json").is_file()


def test_benchmark_one_shot_prints_the_breakdown_after_a_hidden_warmup(folder, capsys):
    rc = cli.main(["--model", folder, "--image", DEMO_IMAGE, "-p", "What is this?", "--max-new-tokens", "5",
                   "--benchmark", "--warmup"])
    _, err = capsys.readouterr()
    assert rc == 0
    turn = [x for x in err.splitlines() if x.startswith("[benchmark: encode ms")]
    assert len(turn) == 1  # the warm-up answer is neither shown nor counted
    for field in ("prefill ms", "TTFT ms", "decode tok 5", "tok/s", "context", "visual kept", "decode rows",
                  "peak GB", "first-use loads"):
        assert field in turn[0]
    assert err.count("[benchmark: conversation]") == 1
    table = err.split("[benchmark: conversation]")[1].strip().splitlines()
    assert [x.split()[0] for x in table] == ["turn", "1", "total"]


def test_benchmark_repl_reports_each_conversation_when_it_ends(folder, capsys, monkeypatch):
    lines = iter(["/image " + DEMO_IMAGE, "describe", "more", "/clear", "hello", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    rc = cli.main(["--model", folder, "--max-new-tokens", "3", "--benchmark"])
    _, err = capsys.readouterr()
    assert rc == 0
    first, second = err.split("[benchmark: conversation]")[1:]
    assert [x.split()[0] for x in first.strip().splitlines()[:4]] == ["turn", "1", "2", "total"]
    assert [x.split()[0] for x in second.strip().splitlines()[:3]] == ["turn", "1", "total"]
    total = first.strip().splitlines()[3].split()
    assert total[5] == "6"  # decode tokens of the two answers (columns: turn, encode, prefill, tok, decode ms, tok)


def test_warmup_needs_a_prompt(folder, capsys):
    rc = cli.main(["--model", folder, "--warmup"])
    _, err = capsys.readouterr()
    assert rc == 1 and "--warmup needs -p" in err


def _bomb(path: Path) -> Path:
    """A 20000x10000 PNG header (200 megapixels, past Pillow's decompression-bomb limit) in a few bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", 20000, 10000, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def _repl(monkeypatch, capsys, lines, *argv):
    feed = iter(lines)
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(feed))
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err, [x for x in err.splitlines() if "tok/s" in x]


def test_repl_reports_a_bad_image_and_keeps_the_conversation(folder, tmp_path, capsys, monkeypatch):
    bomb = _bomb(tmp_path / "huge.png")
    rc, out, err, stats = _repl(monkeypatch, capsys, ["describe", f"/image {bomb}", "/image", "again", "/quit"],
                                "--model", folder, "--max-new-tokens", "3")
    assert rc == 0 and len(stats) == 2, err
    assert "error:" in err and "huge.png" in err and "usage: /image PATH" in out
    assert "context" in stats[1] and int(stats[1].split("context ")[1].split()[0]) > \
        int(stats[0].split("context ")[1].split()[0])  # the second answer followed the first: kept


def test_repl_in_eval_mode_explains_images_after_the_first_round(folder, capsys, monkeypatch):
    rc, out, err, stats = _repl(monkeypatch, capsys, [f"/image {DEMO_IMAGE}", "one", f"/image {DEMO_IMAGE}", "two",
                                                      "/quit"], "--model", folder, "--max-new-tokens", "3",
                                "--eval-multiturn")
    assert rc == 0 and len(stats) == 2, err
    assert "/clear" in err and "--eval-multiturn" in err and "clear()" not in err


def test_repl_says_unknown_command(folder, capsys, monkeypatch):
    rc, out, err, _ = _repl(monkeypatch, capsys, ["/foo", "/quit"], "--model", folder)
    assert rc == 0 and "unknown command /foo" in out


def test_repl_context_error_speaks_in_commands_and_discard_drops_the_image(folder, capsys, monkeypatch):
    lines = [f"/image {DEMO_IMAGE}", "hi", "/discard", "hi", "/quit"]
    rc, out, err, stats = _repl(monkeypatch, capsys, lines, "--model", folder, "--max-seq-len", "60",
                                "--max-new-tokens", "2")
    assert rc == 0 and len(stats) == 1, err
    refused = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(refused) == 1 and "/clear" in refused[0] and "--max-seq-len" in refused[0]
    assert "/discard" in refused[0] and "1 image" in refused[0] and "discard_pending" not in refused[0]


def test_one_shot_context_error_names_the_flags(folder, capsys):
    rc = cli.main(["--model", folder, "--max-seq-len", "40", "-p", "word " * 50])
    _, err = capsys.readouterr()
    assert rc == 1 and "--max-seq-len" in err and "-p" in err and "context is 40" in err
    assert "/clear" not in err and "max_seq_len" not in err and "clear()" not in err


@pytest.mark.parametrize("flags, flag", [(["--top-p", "1.5"], "--top-p"), (["--temperature", "-1"], "--temperature"),
                                         (["--max-new-tokens", "0"], "--max-new-tokens"),
                                         (["--max-seq-len", "0"], "--max-seq-len")])
def test_bad_sampling_flags_are_named_as_flags(folder, capsys, flags, flag):
    rc = cli.main(["--model", folder, "-p", "hi", *flags])
    _, err = capsys.readouterr()
    assert rc == 1 and err.splitlines()[-1].startswith(f"error: {flag} ") and "SamplingParams" not in err, err


def test_every_option_has_help(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    out = capsys.readouterr().out
    assert re.search(r"--device DEVICE[ \t]+\S", out), out


def test_the_cli_strips_control_characters_the_api_passes_through(folder, capsys, monkeypatch):
    monkeypatch.setattr(tinyvila.api.Chat, "ask", lambda self, q, sampling=None: (x for x in ["a\x1b[2Jb\x07\tc\n"]))
    rc = cli.main(["--model", folder, "-p", "hi", "--no-stats"])
    out, _ = capsys.readouterr()
    assert rc == 0 and out == "a[2Jb\tc\n\n"


@pytest.fixture
def demo_home(tmp_path, monkeypatch):
    """The demo built (or found) in tmp_path only, with the repository root as the working directory."""
    monkeypatch.setenv("TINYVILA_CHECKPOINTS", str(tmp_path))
    monkeypatch.setattr(tinyvila.api, "checkpoint_dirs", lambda: [tmp_path])
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    return tmp_path


def test_the_readme_python_example_runs_as_written_on_the_demo(demo_home, capsys):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    code = readme.split("From Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert 'tinyvila.load("demo")' in code and code.count("chat.ask(") == 2
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "tok/s" in out and "\ufffd" not in out
    assert len(out.split()) > 100  # two answers of words


def test_the_demo_answers_in_words_and_its_tokenizer_agrees_with_hf(demo_home):
    vlm = tinyvila.load("demo")
    assert vlm.cfg.text.max_seq_len >= 2048
    chat = vlm.chat(sampling=tinyvila.SamplingParams(max_new_tokens=64))
    chat.add_image(DEMO_IMAGE)
    text = "".join(chat.ask("What is in this picture?"))
    words = [t for t in chat.turns[0][2] if 256 <= t < 256 + 2 * len(tinyvila.loader._WORDS)]
    assert "\ufffd" not in text and len(words) >= 0.9 * len(chat.turns[0][2])
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(vlm.folder / "tokenizer.json"))
    prompt = "What is in the picture? The red house, on the left.<|eot_id|> théâtre"
    assert hf.encode(prompt).ids == vlm.tokenizer.encode(prompt)
    assert len(vlm.tokenizer.encode(prompt, add_special_tokens=False)) < len(prompt.encode()) / 2


def test_a_demo_of_the_old_format_is_rebuilt(demo_home):
    build_synthetic(demo_home / "demo", "tiny-siglip-llama", seed=0)  # a byte tokenizer and 512 tokens of context
    vlm = tinyvila.load("demo")
    assert vlm.cfg.text.max_seq_len == tinyvila.api.DEMO_PRESET.text.max_seq_len != 512
    assert vlm.tokenizer.encode(" the", add_special_tokens=False) == [256]  # the word vocabulary
