"""scripts/bench_serve.py runs end to end on CPU on a tiny model (so the H200 run works the first time): the real
server on a loopback port, the HTTP client in its own process, every path's row, the prefix reuse it relies on, the
targets, and the server and client stopped afterwards."""

import json
import multiprocessing
import threading

import pytest

from scripts import bench_serve

NEW_TOKENS, REPEATS = 5, 2


def test_bench_serve_tiny_cpu(capsys):
    rc = bench_serve.main(["--device", "cpu", "--preset", "tiny-siglip-llama", "--group-size", "32",
                           "--new-tokens", str(NEW_TOKENS), "--repeats", str(REPEATS), "--image-size", "80"])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["bench"] == "serve" and report["args"]["new_tokens"] == NEW_TOKENS
    assert report["gpu"] == "cpu" and report["commit"] and "torch" in report
    rows = {r["path"]: r for r in report["rows"]}
    assert list(rows) == ["warm", "new", "http"] and "floor" not in report  # the floor only with --floor
    for r in rows.values():
        # every turn of every measured conversation answered exactly --new-tokens (stop tokens off)
        assert r["tokens"] == [NEW_TOKENS] * (bench_serve.ROUNDS * REPEATS) and len(r["runs"]) == REPEATS
        assert 0 < r["inner_ttft_ms"] < r["ttft_ms"] < r["total_ms"] and r["tok_s"] > 0
        assert r["first_token_ms"] <= r["ttft_ms"] and 0 < r["followup_ttft_ms"] < r["total_ms"]
        assert r["graph_captures"] == [0] * REPEATS and r["first_use"] == 0  # no CUDA graphs on CPU; warmed up
    http = rows["http"]
    assert "1 image 80x80 PNG" in report["image"]  # sent larger than the tiny encoder's 64 px: resized both ways
    # the server's share: more than the chat's own TTFT (it holds parsing, media and the queue too), less than the client's
    assert http["inner_ttft_ms"] < http["server_ttft_ms"] < http["ttft_ms"]
    assert 0 < http["server_followup_ttft_ms"] < http["followup_ttft_ms"]
    assert "server_ttft_ms" not in rows["warm"]
    # turns 2-4 came from the cached chat: only the new question was prefilled, not the resent history
    assert http["prefix_reused"] == (bench_serve.ROUNDS - 1) * REPEATS
    first, *later = http["prefill_tokens"]
    assert all(0 < n < first for n in later)
    assert report["same_answers"] is True
    checks = {c["what"]: c for c in report["targets"]}
    assert len(checks) == 3 and all(isinstance(c["met"], bool) for c in checks.values())
    assert checks["TTFT overhead, ms"]["value"] == pytest.approx(http["ttft_ms"] - rows["warm"]["ttft_ms"], abs=1e-3)
    assert checks["decode tok/s, HTTP over in-process"]["value"] == pytest.approx(
        http["tok_s"] / rows["warm"]["tok_s"], abs=1e-3)
    for label in ("in-process, one Chat", "in-process, new Chat", "HTTP, stateless", "target: TTFT overhead"):
        assert label in out
    # the server thread, the engine worker and the client process are gone
    assert not [t for t in threading.enumerate() if t.name in ("bench-serve-http", "tinyvila-engine")]
    assert not [p for p in multiprocessing.active_children() if p.name == "bench-serve-client"]


def test_bench_serve_floor_tiny_cpu(capsys):
    """--floor: the same requests to the no-model app give a row per floor, positive and in the JSON line, and the split
    against the real rows is computed from them."""
    rc = bench_serve.main(["--device", "cpu", "--preset", "tiny-siglip-llama", "--group-size", "32",
                           "--new-tokens", "2", "--repeats", "1", "--image-size", "64", "--floor"])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out.strip().splitlines()[-1])
    rows, floors = {r["path"]: r for r in report["rows"]}, {r["path"]: r for r in report["floor"]}
    assert list(rows) == ["warm", "new", "http"] and list(floors) == list(bench_serve.FLOORS)
    for r in floors.values():
        assert len(r["runs"]) == 1
        # the app's own time (received -> answer) is inside the client's
        assert 0 < r["server_ttft_ms"] < r["ttft_ms"] and 0 < r["server_followup_ttft_ms"] < r["followup_ttft_ms"]
    turn1, followups = report["floor_split"]
    assert turn1["floor ms"] == floors["floor"]["ttft_ms"]
    assert followups["floor ms"] == floors["floor"]["followup_ttft_ms"]
    assert turn1["floor + PNG ms"] == floors["floor_image"]["ttft_ms"]
    overhead = rows["http"]["ttft_ms"] - rows["warm"]["ttft_ms"]
    assert turn1["HTTP - in-process ms"] == pytest.approx(overhead)
    assert turn1["over the floor ms"] == pytest.approx(turn1["outside the chats ms"] - turn1["floor ms"])
    assert report["same_answers"] is True
    assert "payload floor" in out and "floor + PNG decode" in out
    assert not [t for t in threading.enumerate() if t.name in ("bench-serve-floor", "bench-serve-http")]
