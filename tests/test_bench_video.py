"""scripts/bench_video.py runs end to end on CPU on the tiny model (so the script never rots): a tiny mp4v clip
through Chat.add_video at two frame counts, and a LiveSession fed by its paced producer, dense and sparse; the
JSON lines it prints carry consistent numbers."""

import json
import statistics

import numpy as np
import pytest

from scripts import bench_video
from tinyvila.config import preset
from tinyvila.sparsity import keep_count

pytest.importorskip("cv2")
TINY = ["--preset", "tiny-siglip-llama", "--device", "cpu", "--group-size", "32"]
CLIP = ["--frames", "2,4", "--repeats", "2", "--clip-size", "64x48", "--clip-seconds", "2", "--clip-fps", "10",
        "--clip-new-tokens", "4"]
LIVE = ["--window", "2", "--sample-fps", "10", "--push-fps", "30", "--seconds", "0.6", "--ask-every", "0.2",
        "--new-tokens", "3"]


def test_synthetic_clip_moves():
    a, b = bench_video.clip_frame(0, 64, 48, 10), bench_video.clip_frame(5, 64, 48, 10)
    assert a.shape == (48, 64, 3) and a.dtype == np.uint8
    assert a.std() > 20 and np.abs(a.astype(int) - b).mean() > 5  # not a constant frame, and not a still


def check_clip(report: dict) -> None:
    clip = report["clip"]
    assert (clip["width"], clip["height"], clip["frames"], clip["codec"]) == (64, 48, 20, "mp4v")
    rows = report["rows"]
    assert [(r["pipeline"], r["frames"]) for r in rows] == [("quant", 2), ("quant", 4), ("sparse", 2), ("sparse", 4)]
    per_frame = preset("tiny-siglip-llama").image_tokens
    by = {(r["pipeline"], r["frames"]): r for r in rows}
    for r in rows:
        n, sparse = r["frames"], r["pipeline"] == "sparse"
        assert r["visual_tokens"] == n * per_frame
        assert r["visual_kept"] == n * (keep_count(per_frame, 0.25) if sparse else per_frame)
        assert r["decode_tokens"] == 4 and len(r["runs"]) == 2 and r["first_use"] == 0
        assert r["media_ms"] == pytest.approx(statistics.median(run["media_ms"] for run in r["runs"]))
        for run in r["runs"]:
            assert run["media_ms"] > 0 and run["encode_ms"] > 0 and run["prefill_ms"] > 0
            assert run["ttft_ms"] == pytest.approx(run["encode_ms"] + run["prefill_ms"] + run["first_token_ms"])
            # add_video -> first piece spans the video decode, the encode, the prefill and the first token.
            assert run["wall_first_piece_ms"] >= run["media_ms"] + run["ttft_ms"] - 1e-6
            assert run["decode_tok_s"] > 0 and run["step_tok_s"] > 0
        assert r["context_tokens"] <= r["max_seq_len"]
        assert (0 < r["decode_rows"] < r["context_tokens"]) if sparse else r["decode_rows"] == 0
    for n in (2, 4):
        cut = n * (per_frame - keep_count(per_frame, 0.25))
        assert by["sparse", n]["prefill_tokens"] == by["quant", n]["prefill_tokens"] - cut
    speedups = report["sparse_vs_dense"]
    assert [(s["dense"], s["frames"]) for s in speedups] == [("quant", 2), ("quant", 4)]
    assert speedups[0]["prefill_ms"] == pytest.approx(by["quant", 2]["prefill_ms"] / by["sparse", 2]["prefill_ms"])


def check_live(report: dict) -> None:
    rows = report["rows"]
    assert [r["pipeline"] for r in rows] == ["quant", "sparse"]
    per_frame = preset("tiny-siglip-llama").image_tokens
    for r in rows:
        assert r["questions"] == 3 and len(r["ttfts_ms"]) == 3 and r["decode_tokens"] == 3
        assert r["ttft_p50_ms"] == pytest.approx(statistics.median(r["ttfts_ms"]))
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p95_ms"] <= max(r["ttfts_ms"])
        kept = keep_count(per_frame, 0.25) if r["pipeline"] == "sparse" else per_frame
        assert r["visual_kept"] == 2 * kept and r["window"] == 2 and r["sample_fps"] == 10
        assert r["seconds"] >= 0.6
        assert 0.5 * 30 * 0.6 <= r["pushed"] <= 30 * r["seconds"] + 2  # the producer keeps to its 30 fps
        assert 0 < r["encoded"] <= r["sampled"] + 1 <= r["pushed"] + 1  # one may have been sampled before the span
        assert r["ingest_fps"] == pytest.approx(r["encoded"] / r["seconds"]) and r["ingest_fps"] <= 10 * 1.5 + 2
    assert [t["met"] for t in report["targets"]] == [r["ttft_p50_ms"] <= 40 for r in rows]


def test_bench_video_on_cpu(capsys):
    rc = bench_video.main(TINY + CLIP + LIVE)
    out = capsys.readouterr().out
    assert rc == 0
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["bench"] for r in reports] == ["video_clip", "video_live"]
    for report in reports:
        assert report["failed"] == [] and report["gpu"] == "cpu" and report["commit"] and "torch" in report
        assert report["args"]["prefill_keep"] == 0.25 and report["args"]["decode_keep"] == 0.1
    check_clip(reports[0])
    check_live(reports[1])
    assert "add_video->1st piece ms" in out and "ttft_p50_ms" in out
