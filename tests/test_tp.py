"""Tensor parallelism (tinyvila/tp.py) on CPU: two gloo ranks in two spawned processes equal one process.

One spawned pair runs every case (spawning costs seconds a process) and writes its results to a file per rank;
the test process computes TP=1 itself and compares: prefill logits to 1e-5 and greedy tokens identical, for
dense fp32, KV heads replicated (one KV head, Qwen2's q/k/v bias), SparseVILA (prefill and decode keep 0.5:
each rank's decode selection equals TP=1's for its own KV heads) and W4 (group 32, loaded from a checkpoint
through the loader's slicing); and rank 0 leading rank 1 through a video (decoded on rank 0, its frames sent),
sampled answers (one closed early), the HTTP server's engine over tp.LeadModel (chats opened, reused,
recycled) and a live session (frames encoded on rank 0, their embeddings sent). `python -m tinyvila.chat --tp 2`
and `python -m tinyvila.serve --tp 2` run as whole commands.
"""

import dataclasses
import os
import signal
import sys

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tinyvila import tp
from tinyvila.api import from_config, load
from tinyvila.config import QuantConfig, SparsityConfig, preset
from tinyvila.errors import ConfigError
from tinyvila.generate import SamplingParams
from tinyvila.loader import build_synthetic

GREEDY = SamplingParams(max_new_tokens=10)
PIXELS = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
SPARSE = SparsityConfig(prefill_keep=0.5, decode_keep=0.5, decode_window=0)
FRAMES = [np.random.default_rng(i).integers(0, 256, (48 + 8 * i, 64, 3), dtype=np.uint8) for i in range(3)]


def _video_turn(chat) -> tuple[list[float], str]:
    """Two of FRAMES as a video, then a greedy answer: (the frames' times, the answer's text)."""
    times = chat.add_video(FRAMES, 2)
    return times, "".join(chat.ask("What happens?", GREEDY))


def _configs():
    base = preset("tiny-siglip-llama")  # 4 heads, 2 KV heads, FFN 128: splits in two
    return {"dense": base, "kv_replicated": preset("tiny-clip-qwen2"),
            "w4": dataclasses.replace(base, quant=QuantConfig(llm="w4a16", group_size=32))}


def _conversation(model, sparsity=None) -> dict:
    """Two turns about one image: each turn's prefill logits, the answers' tokens and, with decode retrieval,
    the first turn's packed slots (n_layers, B, Hkv, rows)."""
    chat = model.chat(sampling=GREEDY, sparsity=sparsity)
    chat.add_image(PIXELS)
    out = {"logits": [], "tokens": [], "packed": None}
    for q in ("What is in the image?", "And the colours?"):
        answer = chat.ask(q)
        next(answer)
        if sparsity is not None and out["packed"] is None:
            out["packed"] = chat.decoder.retrieval.packed.idx.clone()
        list(answer)
        out["logits"].append(chat.last_logits.clone())
        out["tokens"].append(list(chat.turns[-1][2]))
    return out


def _ask(engine, messages: list[dict], max_tokens: int = 6) -> str:
    """One request through the HTTP server's engine (no HTTP): the answer's text."""
    import threading

    from tinyvila.serve.engine import Job
    from tinyvila.serve.protocol import Defaults, parse_request

    done, pieces = threading.Event(), []
    req = parse_request({"messages": messages, "max_tokens": max_tokens}, Defaults())
    engine.submit(Job(req, lambda kind, payload: pieces.append(payload) if kind == "text" else
                      done.set() if kind in ("done", "error") else None))
    assert done.wait(60)
    return "".join(pieces)


def _live_answers(vlm) -> list[str]:
    """A LiveSession (tinyvila.live: frames encoded as they come, a window asked about) over two frames, asked
    twice: the second question reuses the window's prefill."""
    from tinyvila.live import LiveSession

    with LiveSession(vlm, window=2, sample_fps=None) as live:
        for n, frame in enumerate(FRAMES[:2], 1):
            live.push(frame, float(n))
            assert live.wait_frames(n, timeout=60)
        return ["".join(live.ask(q, GREEDY)) for q in ("What happens?", "And now?")]


def _engine_answers(vlm) -> list[str]:
    """The engine answering three conversations with room for one chat: a first question, its follow-up (the
    cached chat, its prefix reused), and another conversation resent with its history (the chat recycled:
    cleared, its system prompt set, the history prefilled)."""
    from tinyvila.serve.engine import Engine

    engine = Engine(vlm, cache_size=1)
    try:
        first = _ask(engine, [{"role": "user", "content": "Hello?"}])
        texts = [first, _ask(engine, [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": first},
                                      {"role": "user", "content": "And then?"}]),
                 _ask(engine, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "More?"}])]
        assert engine.metrics.get("prefix_cache_hits_total") == 1 and engine.metrics.get("chats_recycled_total") == 1
    finally:
        engine.close()
    return texts


def _cases(rank, folder) -> dict:
    """Every case's conversation at this rank (None: TP=1)."""
    def shard(m):
        if rank is not None:
            tp.shard_model(m.model, rank)
        return m

    cfgs = _configs()
    results = {name: _conversation(shard(from_config(cfgs[name], seed=1))) for name in ("dense", "kv_replicated")}
    results["sparse"] = _conversation(shard(from_config(cfgs["dense"], seed=1)), SPARSE)
    w4 = load(folder) if rank is None else tp.load(folder, rank, device="cpu")
    results["w4"] = _conversation(w4)
    return results


def _worker(rank: int, world: int, store: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    r = tp.init(rank, world, torch.device("cpu"), init_method=f"file://{store}")
    results = _cases(r, folder)
    # Rank 0 leads rank 1 (tp.Leader / tp.follow): sampled answers stay in lock-step, one closed early.
    model = from_config(_configs()["dense"], seed=1)
    tp.shard_model(model.model, r)
    chat = model.chat(sampling=SamplingParams(temperature=1.0, max_new_tokens=12))
    if rank == 0:
        lead = tp.Leader(chat, r)
        results["video"] = _video_turn(lead)
        lead.clear()
        lead.add_image(PIXELS)
        stream = lead.ask("Describe it.")
        next(stream), next(stream)
        stream.close()
        list(lead.ask("More."))
        results["engine"] = _engine_answers(tp.LeadModel(model, r))
        results["live"] = _live_answers(tp.LeadModel(model, r))
        tp.quit(r)
    else:
        r.joined = True
        tp.follow(chat, r, model=model)
    results["led"] = [list(t[2]) for t in chat.turns]
    torch.save(results, f"{out}.{rank}")
    torch.distributed.destroy_process_group()
    # Leave without the interpreter's teardown: under load it once aborted a rank ("terminate called without an
    # active exception", exit -6, a C++ thread of torch's still joinable at finalisation) after everything above
    # had finished. A failure above still raises, and multiprocessing reports it as exit code 1.
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """TP=1 results here, and each of the two ranks' results from one spawned pair."""
    tmp = tmp_path_factory.mktemp("tp")
    folder = build_synthetic(tmp / "w4", _configs()["w4"], seed=2)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, 2, str(tmp / "store"), str(folder), str(tmp / "out")))
             for r in range(2)]
    for p in procs:
        p.start()
    single = _cases(None, folder)
    single["video"] = _video_turn(from_config(_configs()["dense"], seed=1).chat())
    single["engine"] = _engine_answers(from_config(_configs()["dense"], seed=1))
    single["live"] = _live_answers(from_config(_configs()["dense"], seed=1))
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    return single, [torch.load(tmp / f"out.{r}") for r in range(2)]


@pytest.mark.parametrize("case", ["dense", "kv_replicated", "sparse", "w4"])
def test_tp2_equals_tp1(ranks, case):
    single, pair = ranks
    want = single[case]
    for got in pair:
        assert got[case]["tokens"] == want["tokens"]
        for a, b in zip(got[case]["logits"], want["logits"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert all(len(t) > 1 for t in want["tokens"])  # the decode path ran, not only the prefill


def test_decode_retrieval_selects_per_rank_among_its_own_kv_heads(ranks):
    single, pair = ranks
    full = single["sparse"]["packed"]  # (n_layers, B, Hkv, rows)
    n = full.shape[2] // 2
    assert not torch.equal(full[:, :, :n], full[:, :, n:])  # heads choose differently: the split is visible
    for r, got in enumerate(pair):
        assert torch.equal(got["sparse"]["packed"], full[:, :, r * n:(r + 1) * n])


def test_a_video_under_tp_answers_as_tp1(ranks):
    single, (lead, _) = ranks
    assert lead["video"] == single["video"] and len(single["video"][0]) == 2 and single["video"][1]


def test_a_bad_video_fails_on_rank0_before_the_others_hear_of_it(monkeypatch, tmp_path):
    from tinyvila.errors import VideoError

    sent = []
    monkeypatch.setattr(tp, "_send", lambda rank, *request: sent.append(request))
    chat = from_config(_configs()["dense"], seed=1).chat()
    with pytest.raises(VideoError, match="missing.mp4"):
        tp.Leader(chat, tp.Rank(0, 2)).add_video(str(tmp_path / "missing.mp4"))
    assert sent == [] and chat.queued() == ""


def test_the_servers_engine_under_tp_answers_as_tp1(ranks):
    """Chats opened, reused, recycled and resent with their history (tp.LeadModel): the same answers as TP=1."""
    single, (lead, _) = ranks
    assert lead["engine"] == single["engine"] and all(single["engine"])


def test_a_live_session_under_tp_answers_as_tp1(ranks):
    """tinyvila.live over tp.LeadModel: rank 0 encodes the frames (the vision tower is replicated), their
    embeddings travel with the window's prefill."""
    single, (lead, _) = ranks
    assert lead["live"] == single["live"] and all(single["live"])


def test_rank0_leads_sampled_answers_in_lock_step(ranks):
    _, (lead, follow) = ranks
    assert len(lead["led"]) == 2 and 0 < len(lead["led"][0]) < 12  # the first answer closed after two pieces
    assert lead["led"] == follow["led"]


def test_tp1_is_todays_model():
    model = from_config("tiny-siglip-llama", seed=1).model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tp.shard_model(model, tp.Rank(0, 1))
    assert not any(isinstance(m, tp.RowParallel) for m in model.modules())
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("cfg, world, where", [
    (preset("tiny-siglip-llama"), 3, "text.layers.0.attn.wqkv: its 4 query heads"),
    (preset("tiny-clip-qwen2"), 4, None),  # 4 heads, 1 KV head replicated on 4 ranks: fine
    (dataclasses.replace(preset("tiny-siglip-llama"), quant=QuantConfig(llm="w4a16", group_size=64)), 2,
     "text.layers.0.attn.wo: its W4 input of 64 columns would split into parts of 32, not whole groups of 64"),
])
def test_bad_rank_counts_are_named(cfg, world, where):
    model = from_config(cfg).model
    if where is None:
        tp.shard_model(model, tp.Rank(0, world))
        assert model.text.layers[0].attn.n_kv_heads == 1 and model.text.cfg.n_heads == 1
        return
    with pytest.raises(ConfigError, match=f"{where}.*cannot be split over {world} ranks \\(--tp {world}\\)"):
        tp.shard_model(model, tp.Rank(0, world))
    assert model.text.layers[0].attn.n_heads == cfg.text.n_heads  # nothing was sliced


@pytest.mark.parametrize("n", ["0", "-2", "two"])
def test_a_rank_count_below_one_is_refused(n, capsys):
    """One argparse type (tp.world_size) checks --tp in the chat, the server and the camera demo."""
    from scripts import camera_demo
    from tinyvila.chat import parse_args
    from tinyvila.serve.cli import main as serve_main

    for parse in (parse_args, camera_demo.main, serve_main):
        with pytest.raises(SystemExit) as e:
            parse(["--model", "demo", "--tp", n])
        assert e.value.code == 2
        assert f"argument --tp: {n}: the rank count must be a whole number, 1 or more" in capsys.readouterr().err


def test_the_40b_preset_splits_up_to_8_ranks_at_w4_g128():
    text = preset("vila-40b").text
    for world in (2, 4, 8):
        tp.check_split(text, world, 128)
    with pytest.raises(ConfigError, match="56 query heads.*--tp 3"):
        tp.check_split(text, 3, 128)
    assert tp.local_config(text, 2).n_kv_heads == 4


def test_cli_tp2_spawns_its_ranks_and_answers_as_tp1():
    """`python -m tinyvila.chat --tp 2` on the demo: rank 0 in the command's own process, rank 1 spawned."""
    import subprocess
    from pathlib import Path

    import tinyvila

    image = str(Path(tinyvila.__file__).parent / "assets" / "demo.png")
    cmd = [sys.executable, "-m", "tinyvila.chat", "--model", "demo", "--device", "cpu", "--image", image,
           "-p", "Describe it.", "--max-new-tokens", "12", "--no-stats"]
    one, two = (subprocess.run(cmd + ["--tp", n], capture_output=True, text=True, timeout=120) for n in ("1", "2"))
    assert one.returncode == two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and len(one.stdout.split()) > 3


def _rank1_dies(rank: int, world: int, args) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


def test_a_rank_that_dies_fails_the_launch():
    """`--tp N`'s launcher: rank 0 answered, rank 1 was killed by a signal: the launch fails (128 + 9), not 0."""
    saved = dict(os.environ)
    try:
        assert tp.launch(2, _rank1_dies, None) == 128 + signal.SIGKILL
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_serve_tp2_answers_over_http_as_tp1():
    """`python -m tinyvila.serve --tp 2` on the demo: rank 0 serves on a free port, rank 1 (spawned) follows; a chat
    completion over HTTP equals the TP=1 engine's answer; Ctrl-C stops both ranks."""
    import json
    import subprocess
    import time
    import urllib.request

    pytest.importorskip("uvicorn")
    port = tp.free_port()
    server = subprocess.Popen([sys.executable, "-m", "tinyvila.serve", "--model", "demo", "--device", "cpu", "--tp", "2",
                               "--port", str(port)], stderr=subprocess.PIPE, text=True)
    body = json.dumps({"messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 8}).encode()
    try:
        for _ in range(240):
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    got = json.load(r)["choices"][0]["message"]["content"]
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()
                time.sleep(0.5)
        else:
            pytest.fail("the --tp 2 server did not answer within 120 s")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            raise
    from tinyvila.serve.engine import Engine

    engine = Engine(load("demo"))
    try:
        want = _ask(engine, [{"role": "user", "content": "Hello?"}], 8)
    finally:
        engine.close()
    assert got == want and got
    assert code == 0, server.stderr.read()
