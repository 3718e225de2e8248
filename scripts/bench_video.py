"""Video and live input, measured through the public API: a real clip file, and a live frame stream.

    python -m scripts.bench_video                                   # both modes, vila-8b synthetic, H200 defaults
    python -m scripts.bench_video --mode clip --frames 8,64,256      # 1-minute 720p mp4v clip, dense vs SparseVILA
    python -m scripts.bench_video --mode live --seconds 20 --sample-fps 4   # LiveSession, a question a second
    python -m scripts.bench_video --clip /tmp/clip720.mp4 ...        # keep the written clip for later runs

clip: a 1280x720, 30 fps, 60 s clip (a scrolling gradient with moving shapes) written with OpenCV's mp4v writer
(into a temporary folder, or at --clip when that file does not exist yet). Per pipeline and frame count, one warm-up
conversation, then --repeats measured ones, each `chat.add_video(path, num_frames=N)` + `chat.ask(question)` as a
user writes it; rows are per-field medians: video decode + sampling (Stats.media_ms), encode, prefill, TTFT, decode.
live: a tinyvila.LiveSession (window --window, sampling --sample-fps) fed 720p frames at --push-fps by a paced
producer thread; after the window fills and every question is asked once unmeasured, a question every --ask-every s
for --seconds s. Reports the TTFT a user waits (ask() -> first streamed piece) at p50 / p95 and the frames sampled
and encoded meanwhile. Synthetic weights at the --preset's shapes; one model per pipeline serves both modes.
Prints a table per mode, then one JSON line per mode ({"bench": "video_clip"} / {"bench": "video_live"}).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

import tinyvila
from scripts import bench
from scripts.benches import common
from tinyvila import benchmark as bm
from tinyvila.api import from_config
from tinyvila.config import preset
from tinyvila.options import Options
from tinyvila.video import cv2_module

CLIP_QUESTION = "Describe what happens in the video."
LIVE_QUESTIONS = ["Is the gripper open?", "What is in front of the robot?", "Is the path ahead clear?"]
PIPELINES = ("fp16", "quant", "sparse")
TTFT_TARGET_MS = 40.0  # live question TTFT, p50


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="clip,live", help="comma-separated, from clip,live")
    p.add_argument("--preset", default="vila-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--pipelines", default="quant,sparse", help="comma-separated, from fp16,quant,sparse")
    p.add_argument("--prefill-keep", type=float, default=0.25, help="sparse: visual tokens kept per frame")
    p.add_argument("--decode-keep", type=float, default=0.1, help="sparse: cached visual tokens each question reads")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--options", default="", metavar="NAME=VALUE,...", help="tinyvila.options.Options fields")
    clip = p.add_argument_group("clip mode")
    clip.add_argument("--clip", help="the clip to read; written there first when it does not exist (default: a "
                      "temporary file)")
    clip.add_argument("--clip-size", default="1280x720", help="WxH of the written clip and of the live frames")
    clip.add_argument("--clip-fps", type=float, default=30.0, help="frame rate of the written clip")
    clip.add_argument("--clip-seconds", type=float, default=60.0, help="length of the written clip")
    clip.add_argument("--frames", type=common.ints, default=[8, 64, 256], help="frames sampled, e.g. 8,64,256")
    clip.add_argument("--clip-new-tokens", type=int, default=64, help="answer length of a clip question")
    clip.add_argument("--repeats", type=int, default=3, help="measured conversations per row (after one warm-up)")
    live = p.add_argument_group("live mode")
    live.add_argument("--window", type=int, default=8, help="frames a live question is about")
    live.add_argument("--sample-fps", type=float, default=4.0, help="frames a second the session samples")
    live.add_argument("--push-fps", type=float, default=30.0, help="frames a second the producer pushes")
    live.add_argument("--seconds", type=float, default=20.0, help="measured span of the live run")
    live.add_argument("--ask-every", type=float, default=1.0, help="seconds between live questions")
    live.add_argument("--new-tokens", type=int, default=16, help="answer length of a live question")
    args = p.parse_args(argv)
    try:
        args.opts = Options.parse(args.options, Options.from_env())
    except ValueError as e:
        p.error(str(e))
    args.modes = [m for m in args.mode.split(",") if m]
    args.pipeline_names = [n for n in args.pipelines.split(",") if n]
    bad = [m for m in args.modes if m not in ("clip", "live")] + [n for n in args.pipeline_names if n not in PIPELINES]
    if bad or not args.modes or not args.pipeline_names:
        p.error(f"unknown or missing --mode / --pipelines entries: {bad}")
    try:
        args.width, args.height = (int(v) for v in args.clip_size.lower().split("x"))
    except ValueError:
        p.error(f"--clip-size takes WxH, e.g. 1280x720, got {args.clip_size!r}")
    return args


# -- the clip ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def _background(width: int, height: int) -> np.ndarray:
    """(H, 2W, 3) uint8 colour gradients periodic in x with period W: a W-wide slice at any offset scrolls."""
    x = np.arange(2 * width) / width * 2 * np.pi
    y = np.linspace(0.0, 1.0, height)[:, None]
    r = 127.5 + 127.5 * np.sin(x)[None, :] * (1 - 0.5 * y)
    g = np.broadcast_to(255 * y, r.shape)
    b = 127.5 + 127.5 * np.cos(x[None, :] + 3 * np.pi * y)
    return np.stack([r, g, b], -1).astype(np.uint8)


def clip_frame(i: int, width: int, height: int, fps: float) -> np.ndarray:
    """Frame i (HxWx3 uint8 RGB) of the synthetic clip: a gradient scrolling sideways, a ball bouncing across it
    and a bar sweeping down, so that consecutive frames differ and the codec has motion to encode."""
    cv2, t = cv2_module("the benchmark clip"), i / fps
    off = int(0.25 * width * t) % width
    f = np.ascontiguousarray(_background(width, height)[:, off:off + width])
    r = max(2, height // 8)
    phase = (0.4 * t) % 2  # a triangle wave: there and back in 5 s
    cx = r + int((width - 2 * r) * (phase if phase < 1 else 2 - phase))
    cy = height // 2 + int((height // 2 - r) * np.sin(2 * np.pi * 0.3 * t))
    cv2.circle(f, (cx, cy), r, (255, 255 - (i * 7) % 256, 40), -1)
    by = int(height * ((0.2 * t) % 1))
    cv2.rectangle(f, (width // 5, by), (width // 5 + width // 6, by + max(1, height // 20)), (20, 20, 230), -1)
    return f


def write_clip(path: Path, width: int, height: int, fps: float, seconds: float) -> None:
    cv2 = cv2_module("the benchmark clip")
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"{path}: OpenCV cannot write an mp4v clip of {width}x{height} here")
    try:
        for i in range(round(fps * seconds)):
            writer.write(cv2.cvtColor(clip_frame(i, width, height, fps), cv2.COLOR_RGB2BGR))
    finally:
        writer.release()


def clip_info(path: Path, written_s: float | None) -> dict:
    """What the clip file is, as OpenCV reads it."""
    cv2 = cv2_module(str(path))
    cap = cv2.VideoCapture(str(path))
    try:
        info = {"path": str(path), "width": int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)),
                "height": int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)), "fps": cap.get(cv2.CAP_PROP_FPS),
                "frames": int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), "codec": "mp4v" if written_s is not None else None}
    finally:
        cap.release()
    return {**info, "bytes": path.stat().st_size, "written_s": written_s}


def prepare_clip(args, tmp: Path) -> dict:
    path = Path(args.clip) if args.clip else tmp / "clip.mp4"
    written = None
    if not path.is_file():
        t0 = time.perf_counter()
        write_clip(path, args.width, args.height, args.clip_fps, args.clip_seconds)
        written = time.perf_counter() - t0
    return clip_info(path, written)


# -- clip mode -----------------------------------------------------------------------------------------
def clip_conversation(chat, path: str, n: int, sampling) -> dict:
    """One user's conversation: add the video, ask, read the whole answer. Its Stats, and the wall time from the
    add_video call to the first streamed piece (video decode + encode + prefill + first token)."""
    chat.clear()
    t0 = time.perf_counter()
    chat.add_video(path, num_frames=n)
    first = None
    for _ in chat.ask(CLIP_QUESTION, sampling):
        first = first or time.perf_counter()
    s = chat.stats
    steps_ms = s.decode_ms - s.first_token_ms
    return {"frames": s.images, "media_ms": s.media_ms, "encode_ms": s.encode_ms, "prefill_ms": s.prefill_ms,
            "prefill_tokens": s.prefill_tokens, "first_token_ms": s.first_token_ms, "ttft_ms": s.ttft_ms,
            "wall_first_piece_ms": 1000 * (first - t0), "decode_ms": s.decode_ms, "decode_tokens": s.decode_tokens,
            "decode_tok_s": s.decode_tok_s,
            "step_tok_s": 1000 * (s.decode_tokens - 1) / steps_ms if steps_ms > 0 else None,
            "visual_tokens": s.visual_tokens, "visual_kept": s.visual_kept, "decode_rows": s.decode_rows,
            "context_tokens": s.context_tokens}


def _median(values: list):
    if values[0] is None:
        return None
    # Counts stay whole numbers (an even number of runs would average two).
    return statistics.median_low(values) if isinstance(values[0], int) else statistics.median(values)


def _medians(runs: list[dict]) -> dict:
    """Each field's median over the runs (the counts are the same in every run)."""
    return {k: _median([r[k] for r in runs]) for k in runs[0]}


def measure_clip(name: str, vlm, cfg, args, path: str, n: int) -> dict:
    turn = bench.Turn([None] * n, CLIP_QUESTION)  # context_needed counts the frames only
    max_seq_len = bench.context_needed(vlm.cfg, [turn], args.clip_new_tokens, vlm.tokenizer, vlm.template)
    chat = vlm.chat(sparsity=cfg.sparsity, max_seq_len=max_seq_len)
    sampling = tinyvila.SamplingParams(max_new_tokens=args.clip_new_tokens)
    clip_conversation(chat, path, n, sampling)  # compilation, autotuning, graph capture
    bm.reset_peak(args.device)
    with bm.FirstUse() as first_use:
        runs = [clip_conversation(chat, path, n, sampling) for _ in range(max(1, args.repeats))]
    row = {"pipeline": name, **_medians(runs), "visual": f"{runs[0]['visual_kept']}/{runs[0]['visual_tokens']}",
           "peak_gb": bm.peak_gb(args.device), "first_use": first_use.loads + first_use.tunings,
           "max_seq_len": max_seq_len, "runs": runs}
    del chat
    bench.free_device(args.device)
    return row


# -- live mode -----------------------------------------------------------------------------------------
def _produce(live, frames: list, fps: float, stop: threading.Event) -> None:
    """Push frames on a fixed 1/fps schedule, as a camera does: a push made late (the host was busy) goes out at
    once and the ones after it keep their times, so the rate over the run stays fps."""
    start, i = time.perf_counter(), 0
    while not stop.is_set():
        delay = start + i / fps - time.perf_counter()
        if delay > 0 and stop.wait(delay):
            return
        live.push(frames[i % len(frames)])
        i += 1


def _ask(live, question: str, sampling) -> tuple[float, object]:
    """(ms from ask() to the first streamed piece, the answer's Stats), the whole answer read."""
    t0 = time.perf_counter()
    answer = live.ask(question, sampling)
    next(answer, None)
    ttft = 1000 * (time.perf_counter() - t0)
    for _ in answer:
        pass
    return ttft, live.stats


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def measure_live(name: str, vlm, cfg, args, frames: list) -> dict:
    turns = [bench.Turn([None] * args.window, q) for q in LIVE_QUESTIONS]  # one-turn contexts: frames counted
    max_seq_len = max(bench.context_needed(vlm.cfg, [t], args.new_tokens, vlm.tokenizer, vlm.template) for t in turns)
    sampling = tinyvila.SamplingParams(max_new_tokens=args.new_tokens)
    stop = threading.Event()
    with tinyvila.LiveSession(vlm, window=args.window, sample_fps=args.sample_fps, sparsity=cfg.sparsity,
                              max_seq_len=max_seq_len) as live:
        producer = threading.Thread(target=_produce, args=(live, frames, args.push_fps, stop), daemon=True)
        producer.start()
        try:
            if not live.wait_frames(args.window, timeout=120):
                raise RuntimeError(f"the window did not fill in 120 s: {live.counts}")
            for q in LIVE_QUESTIONS:  # each question's prefill and decode shapes, before measuring
                _ask(live, q, sampling)
            row = _live_span(live, args, sampling)
        finally:
            stop.set()
            producer.join()
    return {"pipeline": name, **row, "max_seq_len": max_seq_len}


def _live_span(live, args, sampling) -> dict:
    """Questions every --ask-every s for --seconds s while frames stream in; the counts over that span."""
    n = max(1, int(args.seconds / args.ask_every + 1e-9))
    before, ttfts, stats, late = dict(live.counts), [], [], 0
    with bm.FirstUse() as first_use:
        t0 = time.perf_counter()
        for k in range(n):
            delay = t0 + k * args.ask_every - time.perf_counter()
            late += k > 0 and delay < 0  # the previous answer overran the question period
            time.sleep(max(0.0, delay))
            ttft, s = _ask(live, LIVE_QUESTIONS[k % len(LIVE_QUESTIONS)], sampling)
            ttfts.append(ttft)
            stats.append(s)
        time.sleep(max(0.0, t0 + args.seconds - time.perf_counter()))
        elapsed = time.perf_counter() - t0
        counts = {k: live.counts[k] - before[k] for k in before}
    last = stats[-1]
    return {"window": args.window, "sample_fps": args.sample_fps, "questions": n,
            "ttft_p50_ms": _pct(ttfts, 50), "ttft_p95_ms": _pct(ttfts, 95),
            "prefill_ms": statistics.median(s.prefill_ms for s in stats),
            "first_token_ms": statistics.median(s.first_token_ms for s in stats),
            "decode_tok_s": statistics.median(s.decode_tok_s for s in stats),
            "decode_tokens": last.decode_tokens, "prefill_tokens": last.prefill_tokens,
            "visual": f"{last.visual_kept}/{last.visual_tokens}", "visual_kept": last.visual_kept,
            "decode_rows": last.decode_rows, **counts, "seconds": elapsed,
            "push_fps": counts["pushed"] / elapsed, "ingest_fps": counts["encoded"] / elapsed, "late_questions": late,
            "first_use": first_use.loads + first_use.tunings, "ttfts_ms": ttfts}


# -- running and reporting -----------------------------------------------------------------------------
def run_pipeline(name: str, args, base, clip: dict | None, frames: list | None) -> tuple[list, dict | None, list]:
    """Build one pipeline's model, measure it in each mode, free it: (clip rows, live row, what failed)."""
    cfg = bench.pipeline_config(base, name, args)
    vlm = from_config(cfg, device=args.device, options=args.opts)
    vlm.stop_ids = frozenset()  # every answer is exactly its token budget
    clip_rows, live_row, failed = [], None, []
    jobs = [("clip", n) for n in args.frames] if clip else []
    jobs += [("live", None)] if frames else []
    for mode, n in jobs:
        try:
            if mode == "clip":
                clip_rows.append(measure_clip(name, vlm, cfg, args, clip["path"], n))
            else:
                live_row = measure_live(name, vlm, cfg, args, frames)
        except Exception:  # reported; the other rows still run (a GPU run is too dear to lose whole)
            traceback.print_exc()
            failed.append(f"{name} {mode}" + (f" {n} frames" if n else ""))
            print(f"FAILED: {failed[-1]} (above); going on", file=sys.stderr)
            bench.free_device(args.device)
    del vlm
    bench.free_device(args.device)
    return clip_rows, live_row, failed


def _args_record(args) -> dict:
    skip = ("opts", "modes", "pipeline_names", "width", "height")
    return {**{k: v for k, v in vars(args).items() if k not in skip}, "options": dataclasses.asdict(args.opts)}


def report_clip(args, rows: list[dict], clip: dict, failed: list[str]) -> None:
    print(f"{args.preset}: clip {clip['width']}x{clip['height']} {clip['fps']:g} fps, {clip['frames']} frames, "
          f"{args.clip_new_tokens} new tokens, median of {args.repeats}, {args.device}")
    extra = {"wall_first_piece_ms": ("add_video->1st piece ms", ".1f"), "step_tok_s": ("step tok/s", ".1f")}
    print(bm.table([{**r, "run": f"{r['pipeline']} {r['frames']}f"} for r in rows], "run", extra))
    by = {(r["pipeline"], r["frames"]): r for r in rows}
    dense_name = "quant" if any(r["pipeline"] == "quant" for r in rows) else "fp16"
    speedups = []
    for r in rows:
        dense = by.get((dense_name, r["frames"]))
        if r["pipeline"] == "sparse" and dense:
            x = {k: dense[k] / r[k] if r[k] else None for k in ("encode_ms", "prefill_ms", "ttft_ms", "decode_ms")}
            speedups.append({"dense": dense_name, "frames": r["frames"], **x})
            print(f"sparse over {dense_name}, {r['frames']} frames: " + " | ".join(
                f"{k[:-3]} {v:.2f}x" for k, v in x.items() if v is not None))
    for r in rows:
        if r["first_use"]:
            print(f"WARNING: {r['pipeline']} {r['frames']}f: {r['first_use']} kernel loads/autotunings while measured")
    print(json.dumps({"bench": "video_clip", "args": _args_record(args), "clip": clip, "rows": rows,
                      "sparse_vs_dense": speedups, "failed": failed, **bench.environment(args.device)}))


def report_live(args, rows: list[dict], failed: list[str]) -> None:
    print(f"{args.preset}: live, window {args.window}, sampled at {args.sample_fps:g} fps of {args.push_fps:g} pushed, "
          f"{args.width}x{args.height}, a question every {args.ask_every:g} s for {args.seconds:g} s, "
          f"{args.new_tokens} new tokens, {args.device}")
    extra = {k: (k, f) for k, f in (("ttft_p50_ms", ".1f"), ("ttft_p95_ms", ".1f"), ("questions", "d"),
                                    ("pushed", "d"), ("sampled", "d"), ("encoded", "d"), ("dropped", "d"),
                                    ("push_fps", ".1f"), ("ingest_fps", ".2f"), ("late_questions", "d"))}
    print(bm.table(rows, "pipeline", extra))
    targets = [{"what": f"{r['pipeline']} live question TTFT p50 (ms)", "value": r["ttft_p50_ms"],
                "target": f"<= {TTFT_TARGET_MS:g}", "met": r["ttft_p50_ms"] <= TTFT_TARGET_MS} for r in rows]
    for t in targets:
        print(f"target: {t['what']}: {t['value']:.1f} ({t['target']}: {'met' if t['met'] else 'MISSED'})")
    print(json.dumps({"bench": "video_live", "args": _args_record(args), "rows": rows, "targets": targets,
                      "failed": failed, **bench.environment(args.device)}))


def main(argv=None) -> int:
    args = parse_args(argv)
    base = preset(args.preset)
    clip_rows, live_rows, failed = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-video-") as tmp:
        clip = prepare_clip(args, Path(tmp)) if "clip" in args.modes else None
        frames = None
        if "live" in args.modes:  # one second of distinct frames, pushed in a loop
            frames = [clip_frame(i, args.width, args.height, args.push_fps) for i in range(max(1, round(args.push_fps)))]
        for name in args.pipeline_names:
            try:
                c, live, f = run_pipeline(name, args, base, clip, frames)
            except Exception:  # e.g. the model does not fit: the other pipelines still run
                traceback.print_exc()
                c, live, f = [], None, [f"{name} build"]
                bench.free_device(args.device)
            clip_rows += c
            live_rows += [live] if live else []
            failed += f
    if clip_rows:
        report_clip(args, clip_rows, clip, failed)
    if live_rows:
        report_live(args, live_rows, failed)
    return 1 if failed or not (clip_rows or live_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
