"""Video input: files, bytes, frame folders and frame lists -> uniformly sampled RGB frames, as VILA1.5 reads them.

    video = read_video("clip.mp4", num_frames=8)        # Video(frames, timestamps, indices, frame_count, fps)
    chat.add_video("clip.mp4", num_frames=8, fps=2)      # the same sampling, encoded in batches (api.Chat)

Decoded with OpenCV (`pip install "tinyvila[video]"`), as VILA, TinyChat and vLLM do, so the frames picked are
theirs: `round(linspace(0, n - 1, N))` over a frame count verified by decoding (a container's count can lie: VILA
seeks back until a frame decodes; here a count whose last frame does not decode is recounted frame by frame).
Unreadable frames are skipped; a clip shorter than N gives all its frames. With `fps`, min(N, duration * fps)
frames are spread over the whole clip, not over its first N / fps seconds (a known bug of VILA's server).
Decoding streams: only the chosen frames are ever held, and `frame_batches` hands them on resized, a batch at a
time. Folders and lists of frames carry no clock: they are taken as FRAMES_FPS frames a second.
"""

from __future__ import annotations

import functools
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import VisionConfig
from .errors import ArgumentError, ImageError, VideoError
from .image import load_image, resize_uint8

FRAMES_FPS = 30.0  # the frame rate assumed for a folder or list of frames, and for a container that states none
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm")
STREAM_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "udp://", "tcp://", "srt://", "http://", "https://")
RESIZE_THREADS = max(1, min(8, (os.cpu_count() or 2) - 1))  # frame_batches' resize workers, beside the decoder
OPEN_TIMEOUT_MS = 10_000  # an unreachable stream fails after this long instead of FFmpeg's default minutes
# Picks closer than this many frames are reached by decoding forward: a seek decodes from the previous keyframe,
# which costs more than a short run of grabs (and MJPEG, where seeks are cheap, decodes fast either way).
SEEK_GAP = 32


@dataclass(frozen=True)
class Video:
    """Frames sampled from a video: `frames` (HxWx3 uint8 RGB), their `timestamps` (s) and `indices` in the
    clip, the clip's verified `frame_count` and its `fps` (FRAMES_FPS where the source states none)."""

    frames: list[np.ndarray]
    timestamps: list[float]
    indices: list[int]
    frame_count: int
    fps: float


def strip_video_tag(text: str) -> str:
    """The text without `<video>` placeholders (no VILA1.5 token: its video eval strips them; frames are images)."""
    return text.replace("<video>\n", "").replace("\n<video>", "").replace("<video>", "")


def sample_indices(frame_count: int, n: int) -> list[int]:
    """VILA1.5's uniform pick: round(linspace(0, frame_count - 1, n)); all frames when the clip is shorter."""
    if frame_count <= n:
        return list(range(frame_count))
    return np.round(np.linspace(0, frame_count - 1, n)).astype(int).tolist()


def read_video(source, num_frames: int = 8, fps: float | None = None, *, max_frames: int | None = None) -> Video:
    """Decode and sample a video. `source`: a video file path (or stream URL), a folder of frame images, the
    bytes of a video file, or a sequence of frames (HxWx3 uint8 RGB arrays, PIL images or paths, or one TxHxWx3
    array: pre-sampled, used as they are, at most num_frames of them chosen uniformly). `fps`: sample at most this
    many frames a second of video, spread over the whole clip. `max_frames`: a hard cap on the frames returned.
    Raises VideoError naming the source (missing, not a video, no frame decodes, unreachable, no OpenCV)."""
    _check_args(num_frames, fps, max_frames)
    frames, times, idx = [], [], []
    with _open(source) as reader:
        for i, t, frame in _picks(reader, num_frames, fps, max_frames):
            frames.append(frame)
            times.append(t)
            idx.append(i)
        return Video(frames, times, idx, reader.count, reader.fps)


def frame_batches(source, cfg: VisionConfig, num_frames: int = 8, fps: float | None = None, batch: int = 32,
                  max_frames: int | None = None) -> Iterator[tuple[list[float], torch.Tensor, float]]:
    """`read_video`'s frames, resized for the encoder a batch at a time: (timestamps, (n, S, S, 3) uint8 pixels,
    ms spent decoding and resizing them). At most one batch of frames is held (long videos stay in memory).
    Each frame is resized in a worker thread as soon as it is decoded (`resize_uint8`, the same bicubic resize:
    the same pixels), so resizing runs beside the decoding and on several cores: both release the GIL, and the
    resize of a 720p frame costs as much as decoding several."""
    _check_args(num_frames, fps, max_frames)
    t0 = time.perf_counter()
    pool = _resize_pool()
    with _open(source) as reader:
        picks = _picks(reader, num_frames, fps, max_frames)
        while True:
            jobs = [(t, pool.submit(resize_uint8, f, cfg)) for _, (_, t, f) in zip(range(batch), picks)]
            if not jobs:
                return
            pixels = torch.cat([job.result() for _, job in jobs])
            yield [t for t, _ in jobs], pixels, 1000 * (time.perf_counter() - t0)
            t0 = time.perf_counter()


@functools.cache
def _resize_pool() -> ThreadPoolExecutor:
    """The process's frame-resize threads (made on first use; at most RESIZE_THREADS)."""
    return ThreadPoolExecutor(RESIZE_THREADS, thread_name_prefix="tinyvila-resize")


def _check_args(num_frames: int, fps: float | None, max_frames: int | None) -> None:
    for name, v in (("num_frames", num_frames), ("max_frames", max_frames)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ArgumentError(name, f"{name} must be a positive whole number of frames, got {v!r}")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < math.inf):
        raise ArgumentError("fps", f"fps must be a positive number of frames a second, got {fps!r}")


def _picks(reader, num_frames: int, fps: float | None, max_frames: int | None) -> Iterator[tuple[int, float, np.ndarray]]:
    """The sampled frames of an opened reader: num_frames, capped by max_frames and (with fps) by
    ceil(duration * fps), spread uniformly; VideoError when none decodes."""
    n = min(num_frames, max_frames or num_frames)
    if fps is not None:
        n = min(n, max(1, math.ceil(reader.count / reader.fps * fps - 1e-9)))
    got = 0
    for item in reader.frames(sample_indices(reader.count, n)):
        got += 1
        yield item
    if not got:
        raise VideoError(f"{reader.label}: no frame decodes (an empty, truncated or corrupt video)")


def _open(source):
    """The reader for a source (each is a context manager with .label, .count, .fps and .frames(indices))."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _BytesReader(bytes(source))
    if isinstance(source, (str, os.PathLike)):
        if str(source).startswith(STREAM_SCHEMES):
            return _CapReader(str(source), stream=True)
        path = Path(source)
        if path.is_dir():
            return _ListReader(_folder_frames(path), str(path), load=True)
        if not path.is_file():
            raise VideoError(f"{path}: video file not found")
        return _CapReader(str(path))
    if isinstance(source, np.ndarray) and source.ndim == 4:  # (T, H, W, 3) frames
        source = list(source)
    if isinstance(source, Sequence) and not isinstance(source, str):
        if not source:
            raise VideoError("frames: empty list; pass at least one frame")
        return _ListReader(list(source), "frames", load=False)
    raise VideoError(f"video: expected a file path, a folder of frames, bytes or a list of frames, got "
                     f"{type(source).__name__}")


def cv2_module(what: str):
    """OpenCV, or VideoError naming `what` and the install command when it is not installed."""
    try:
        import cv2
    except ImportError:
        raise VideoError(f'{what}: reading video needs OpenCV, which is not installed: pip install "tinyvila[video]"'
                         ) from None
    return cv2


def open_capture(source, what: str, stream: bool = False):
    """An opened cv2.VideoCapture of a file, URL (`stream`: open and read timeouts set) or camera (an index or
    /dev/videoN), or VideoError naming `what`."""
    cv2 = cv2_module(what)
    if stream:
        cap = cv2.VideoCapture(source, cv2.CAP_FFMPEG, [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, OPEN_TIMEOUT_MS,
                                                        cv2.CAP_PROP_READ_TIMEOUT_MSEC, OPEN_TIMEOUT_MS])
    else:
        cap = cv2.VideoCapture(source)
    if not cap.isOpened():
        cap.release()
        camera = isinstance(source, int) or str(source).startswith("/dev/")
        raise VideoError(f"{what}: cannot open " + ("the stream (unreachable, or not a video)" if stream else
                         "the camera (no such device, busy, or no permission)" if camera else
                         "as a video (not a video file OpenCV's FFmpeg reads, or corrupt)"))
    return cap


class _CapReader:
    """A file or stream through OpenCV. Its frame count is trusted only when its last frame decodes; else the
    frames are counted by decoding them all, and picks are then reached by decoding forward (no seeks)."""

    def __init__(self, source: str, stream: bool = False):
        self.source, self.label, self.stream = source, source, stream
        self._cv2 = cv2_module(source)

    def __enter__(self):
        self.cap = open_capture(self.source, self.label, self.stream)
        fps = self.cap.get(self._cv2.CAP_PROP_FPS)
        self.fps = fps if math.isfinite(fps) and 0 < fps < 1000 else FRAMES_FPS
        self.count, self.seekable = int(self.cap.get(self._cv2.CAP_PROP_FRAME_COUNT) or 0), True
        if self.count > 0 and not self._decodes(self.count - 1):  # the count lies (e.g. a truncated file)
            self.count = 0
        if self.count <= 0:
            if self.stream:
                raise VideoError(f"{self.label}: a live stream has no frame count to sample from; use "
                                 "tinyvila.LiveSession(...).attach(url) for live streams")
            self._recount()
        if self.count == 0:
            raise VideoError(f"{self.label}: no frame decodes (an empty, truncated or corrupt video)")
        return self

    def __exit__(self, *exc) -> None:
        self.cap.release()

    def _decodes(self, i: int) -> bool:
        """Whether frame i decodes; the capture is reopened at the start after (seeking back from the last frame
        of some files leaves a capture that returns nothing)."""
        self.cap.set(self._cv2.CAP_PROP_POS_FRAMES, i)
        ok = self.cap.grab()
        self._reopen()
        return ok

    def _recount(self) -> None:
        """Count the frames that decode in order; picks are then reached by decoding forward (no seeks)."""
        n = 0
        while self.cap.grab():
            n += 1
        self._reopen()
        self.count, self.seekable = n, False

    def _reopen(self) -> None:
        self.cap.release()
        self.cap = open_capture(self.source, self.label, self.stream)

    def frames(self, indices: list[int]) -> Iterator[tuple[int, float, np.ndarray]]:
        """(index, timestamp s, HxWx3 RGB) of each pick that decodes, in order; unreadable ones are skipped."""
        cv2, cap, pos = self._cv2, self.cap, 0  # pos: the index the next grab() returns
        for i in indices:
            if self.seekable and i - pos > SEEK_GAP:
                cap.set(cv2.CAP_PROP_POS_FRAMES, i)
                pos = i
            while pos < i and cap.grab():
                pos += 1
            ok = pos == i and cap.grab()
            pos += 1
            ok, frame = cap.retrieve() if ok else (False, None)
            if ok and frame is not None:
                ms = cap.get(cv2.CAP_PROP_POS_MSEC)
                t = ms / 1000 if math.isfinite(ms) and (ms > 0 or i == 0) else i / self.fps
                yield i, t, cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)


class _BytesReader(_CapReader):
    """A video file's bytes: written to a temporary file for OpenCV (as VILA does), removed on exit."""

    def __init__(self, data: bytes):
        cv2_module("video bytes")
        fd, path = tempfile.mkstemp(prefix="tinyvila-", suffix=".video")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        super().__init__(path)
        self.label = f"video bytes ({len(data)} bytes)"

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            os.unlink(self.source)

    def __enter__(self):
        try:
            return super().__enter__()
        except BaseException:
            os.unlink(self.source)
            raise


def _folder_frames(path: Path) -> list[Path]:
    """The image files of a frame folder in natural order (frame2 before frame10)."""
    files = [p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
    if not files:
        raise VideoError(f"{path}: the folder holds no frame images ({', '.join(IMAGE_SUFFIXES)})")
    return sorted(files, key=lambda p: [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", p.name)])


class _ListReader:
    """Frames given one by one (a folder's files, or a list). A folder's unreadable files are skipped, as a
    video's unreadable frames are; a bad frame of a list is the caller's error (ImageError naming its index)."""

    def __init__(self, items: list, label: str, load: bool):
        self.items, self.label, self.load = items, label, load
        self.count, self.fps = len(items), FRAMES_FPS

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def frames(self, indices: list[int]) -> Iterator[tuple[int, float, np.ndarray]]:
        for i in indices:
            try:
                frame = np.asarray(load_image(self.items[i], f"{self.label}[{i}]"))
            except ImageError:
                if not self.load:
                    raise
                continue
            yield i, i / self.fps, frame
