"""Camera demo: frames from a plain OpenCV capture go into a tinyvila.LiveSession; a question is answered every N s.

    python -m scripts.camera_demo --model vila-8b-awq --source 0 --question "Is anyone at the door?" --every 2
    python -m scripts.camera_demo --model demo --source clip.mp4 --every 1 --max-answers 3   # a file plays as a camera
    python -m scripts.camera_demo --model vila-40b-awq --tp 2        # tensor parallel: rank 0 owns the camera

--source is a camera index, /dev/videoN, an rtsp:// (or http) URL or a video file. Needs OpenCV (pip install
"tinyvila[video]"). The capture is the loop a robot's own code would run (read, push with bgr=True) on a thread of
its own; `LiveSession.attach(source)` does the same inside the session. Each answer is printed with its TTFT.
With --tp N, rank 0 runs all of this over a tp.LeadModel (it encodes the frames; the window's embeddings go to
the other ranks, which follow its requests on their shards).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time

import torch

import tinyvila
from tinyvila import tp
from tinyvila.generate import SamplingParams
from tinyvila.video import STREAM_SCHEMES, open_capture


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.camera_demo", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder or name ('demo': tiny random weights)")
    p.add_argument("--source", default="0", help="camera index, /dev/videoN, stream URL or video file (default 0)")
    p.add_argument("--question", default="What is happening?", help="asked about the window every --every seconds")
    p.add_argument("--every", type=float, default=2.0, help="seconds between questions (default 2)")
    p.add_argument("--window", type=int, default=8, help="frames in the window asked about (default 8)")
    p.add_argument("--sample-fps", type=float, default=2.0, help="frames a second taken into the window (default 2)")
    p.add_argument("--max-answers", type=int, default=0, help="stop after this many answers (default 0: until Ctrl-C)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prefill-keep", type=float, help="SparseVILA: fraction of each frame's tokens kept")
    p.add_argument("--decode-keep", type=float, help="SparseVILA: fraction of the visual tokens each question reads")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tp", type=tp.world_size, default=1, metavar="N", help="tensor parallel over N ranks (spawned here)")
    return p.parse_args(argv)


def capture(cap, live: tinyvila.LiveSession, paced: bool, stop: threading.Event) -> None:
    """Read frames until the source ends or `stop`; a file is paced to its own frame rate, as a camera would be."""
    import cv2

    fps, start, i = cap.get(cv2.CAP_PROP_FPS) or 30.0, time.monotonic(), 0
    while not stop.is_set():
        ok, frame = cap.read()
        if not ok:
            break
        if paced:
            stop.wait(max(0.0, start + i / fps - time.monotonic()))
        live.push(frame, bgr=True)
        i += 1
    stop.set()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return tp.launch(args.tp, _tp_rank, args) if args.tp > 1 else run(args)


def _tp_rank(rank: int, world: int, args: argparse.Namespace) -> int:
    """One rank under --tp: each loads its shard; rank 0 runs the demo, the others follow its requests."""
    shard = lambda r: tp.load(args.model, r, device=tp.rank_device(args.device, r.rank))  # noqa: E731
    return tp.run_rank(rank, world, args.device, lambda r: run(args, lambda: tp.LeadModel(shard(r), r)),
                       lambda r: (None, shard(r)))


def run(args: argparse.Namespace, load=None) -> int:
    """The demo; `load` makes the model (default: tinyvila.load of --model on --device)."""
    source = int(args.source) if args.source.isdigit() else args.source
    paced = not isinstance(source, int) and not args.source.startswith((*STREAM_SCHEMES, "/dev/"))
    try:
        vlm = load() if load else tinyvila.load(args.model, device=args.device)
        keeps = {k: v for k, v in (("prefill_keep", args.prefill_keep), ("decode_keep", args.decode_keep))
                 if v is not None}
        sparsity = dataclasses.replace(vlm.cfg.sparsity, **keeps)
        cap = open_capture(source, args.source, stream=args.source.startswith(STREAM_SCHEMES))  # before any thread
        try:
            live = tinyvila.LiveSession(vlm, window=args.window, sample_fps=args.sample_fps, sparsity=sparsity,
                                        sampling=SamplingParams(max_new_tokens=args.max_new_tokens))
        except BaseException:
            cap.release()
            raise
    except tinyvila.TinyVilaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    reader = threading.Thread(target=capture, args=(cap, live, paced, stop), daemon=True)
    reader.start()
    answers = 0
    try:
        with live:
            live.wait_frames(1, timeout=30)
            while not stop.is_set() and (not args.max_answers or answers < args.max_answers):
                t0 = time.monotonic()
                stream = live.ask(args.question)
                print(f"[{live.timestamps[0]:.1f}-{live.timestamps[-1]:.1f} s] ", end="", flush=True)
                for piece in stream:
                    print(piece, end="", flush=True)
                print(f"   (TTFT {live.stats.ttft_ms:.0f} ms, {live.stats.decode_tok_s:.0f} tok/s)")
                answers += 1
                stop.wait(max(0.0, t0 + args.every - time.monotonic()))
    except KeyboardInterrupt:
        print()
    finally:
        stop.set()
        reader.join()
        cap.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
