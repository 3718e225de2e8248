"""Live frame streams (cameras, robots): a bounded window of recent frames that questions are asked about.

    with tinyvila.LiveSession(vlm, window=8, sample_fps=2) as live:
        live.attach("/dev/video0")          # or an rtsp:// URL or a video file; or live.push(frame) from your loop
        live.wait_frames(8)
        for piece in live.ask("Is the gripper open?"):
            print(piece, end="")

Threads. `push` may be called from any thread and never waits: it checks the frame, keeps it only when it is due
(`sample_fps`), and puts it in a one-frame slot, replacing a frame not yet taken (the newest wins; `counts` says how
many were dropped). One encoder thread takes the slot, encodes the frame once (under the model's device lock) and appends
its embedding to the window of the last `window` frames; `attach` adds one capture thread that pushes a source's
frames through OpenCV. `ask` (one thread at a time, as a Chat) snapshots the window and answers about it as it was
then, while frames keep arriving. The encoder and the answer take turns on the device (a lock per encode and per
piece; a waiting encode goes first): a CUDA graph captured in one thread must not see another thread's work.

Asking re-prefills the window from the cached frame embeddings (a sliding window encodes only its new frames). A
question about a window that has not moved since the last one (`reuse`, the default) is asked against the cached K/V
of the system prompt and frames instead, prefilling only the question: the chat runs in eval mode, so the tokens are
those of a re-prefill (the logits too, up to the rounding of a shorter batch: fp32's last bit on some CPUs). Reusing
the K/V of the frames still in a window that slid is not built: those frames' K/V were computed beside the frames that
left, so it would not be exact, and it needs the frames moved to fixed cache positions with their keys re-rotated.
SparseVILA's keeps apply as in a Chat: prefill_keep when a frame is encoded, decode_keep per question.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .api import Answer, Model, Stats
from .errors import ArgumentError, EvalModeError, ImageError, VideoError
from .generate import SamplingParams
from .image import resize_uint8
from .sparsity import keep_count
from .video import FRAMES_FPS, STREAM_SCHEMES, open_capture


@dataclass
class _Frame:
    timestamp: float
    emb: torch.Tensor  # (1, k, d) the frame's LLM-width embedding
    idx: torch.Tensor  # (1, k) its kept tokens' grid index
    seq: int = 0       # the session's count of encoded frames when this one came: tells windows apart


def as_rgb(frame, bgr: bool = False) -> np.ndarray:
    """A pushed frame -> an HxWx3 uint8 RGB array (a view where it can be). Takes numpy HxWx3 uint8 (RGB, or BGR
    with bgr=True as OpenCV gives), PIL images, torch uint8 tensors HxWx3 or 3xHxW; ImageError otherwise."""
    if isinstance(frame, Image.Image):
        return np.asarray(frame.convert("RGB"))
    if isinstance(frame, torch.Tensor):
        t = frame.detach()
        if t.dim() == 3 and t.shape[0] == 3 and t.shape[2] != 3:
            t = t.permute(1, 2, 0)  # (3, H, W) -> (H, W, 3)
        frame = t.cpu().numpy()
    if not isinstance(frame, np.ndarray):
        raise ImageError(f"frame: expected an HxWx3 uint8 array, a PIL image or a uint8 tensor, got {type(frame).__name__}")
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8 or 0 in frame.shape:
        raise ImageError(f"frame: expected HxWx3 uint8 ({'BGR' if bgr else 'RGB'}), got {frame.dtype} "
                         f"{tuple(frame.shape)}")
    return frame[..., ::-1] if bgr else frame


class LiveSession:
    """A window of the last `window` frames sampled at `sample_fps` (None: every frame the encoder keeps up with),
    each encoded once, and a Chat that answers about the window. The other arguments are `Model.chat`'s."""

    def __init__(self, vlm: Model, *, window: int = 8, sample_fps: float | None = 2.0, system: str | None = None,
                 sampling: SamplingParams | None = None, sparsity=None, max_seq_len: int | None = None,
                 reuse: bool = True):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ArgumentError("window", f"window must be a positive number of frames, got {window!r}")
        if sample_fps is not None and not (isinstance(sample_fps, (int, float)) and 0 < sample_fps < math.inf):
            raise ArgumentError("sample_fps", f"sample_fps must be a positive number or None, got {sample_fps!r}")
        if vlm.model.vision is None:
            raise ArgumentError("vlm", f"{vlm.folder}: this model is text-only and cannot take frames")
        self.vlm = vlm
        self.reuse, self._prefilled = reuse, None  # eval mode below; the frame seqs the chat's cache holds (ask)
        self.chat = vlm.chat(system=system, sampling=sampling, sparsity=sparsity, max_seq_len=max_seq_len,
                             mode="eval" if reuse else "chat")
        need = window * keep_count(vlm.cfg.image_tokens, self.chat.sparsity.prefill_keep)
        if need >= self.chat.decoder.max_len:
            raise ArgumentError("window", f"a window of {window} frames takes {need} tokens, past the chat's context of "
                                f"{self.chat.decoder.max_len}; use a smaller window, prefill_keep or a larger max_seq_len")
        self.window, self._period = window, 1 / sample_fps if sample_fps else 0.0
        self.counts = {"pushed": 0, "sampled": 0, "dropped": 0, "encoded": 0}
        self.timestamps: list[float] = []  # the window's frames the last ask() was about
        self.error: BaseException | None = None  # the encoder's last failure, raised by the next ask()
        self.capture_error: VideoError | None = None  # why the attached stream stopped, if it failed
        self._cond = threading.Condition()
        self._device = threading.Lock()  # one of: a frame's encode, the ask's set-up, one streamed piece
        self._frames: deque[_Frame] = deque(maxlen=window)
        self._slot: tuple[np.ndarray, float] | None = None
        self._due, self._last, self._busy, self._closed, self._waiting = -math.inf, -math.inf, False, False, False
        self._t0 = time.monotonic()
        self._capture: threading.Thread | None = None
        self._stop = threading.Event()
        self._encoder = threading.Thread(target=self._encode_loop, name="tinyvila-live-encoder", daemon=True)
        self._encoder.start()

    # -- frames in --------------------------------------------------------------------------------
    def push(self, frame, timestamp: float | None = None, *, bgr: bool = False) -> bool:
        """Offer a frame (see `as_rgb`; `timestamp` in seconds, default the time of arrival). Never waits. Returns
        whether it was sampled (due at sample_fps); a sampled frame not yet taken by the encoder when a newer one
        comes is dropped. Frames pushed after close() are ignored."""
        return self._offer(frame, timestamp, bgr, wait=False)

    def _offer(self, frame, timestamp: float | None, bgr: bool, wait: bool) -> bool:
        rgb = as_rgb(frame, bgr)
        t = time.monotonic() - self._t0 if timestamp is None else float(timestamp)
        with self._cond:
            if self._closed:
                return False
            self.counts["pushed"] += 1
            if t < self._last:  # the clock went back (a new source): sample from here
                self._due = -math.inf
            self._last = t
            if t < self._due - 1e-9:
                return False
            # On the sampling grid while frames come in time; after a gap, from the frame that ended it.
            self._due = self._due + self._period if self._due + self._period > t else t + self._period
        rgb = np.array(rgb)  # a contiguous copy: the caller may reuse its buffer (OpenCV, camera drivers do)
        with self._cond:
            while wait and self._slot is not None and not self._closed:
                self._cond.wait()
            self.counts["sampled"] += 1
            self.counts["dropped"] += self._slot is not None
            self._slot = (rgb, t)
            self._cond.notify_all()
        return True

    def _encode_loop(self) -> None:
        cfg = self.vlm.model.cfg.vision
        while True:
            with self._cond:
                while self._slot is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                (rgb, t), self._slot, self._busy = self._slot, None, True
                self._cond.notify_all()
            frame, error = None, None
            try:
                pixels = resize_uint8(rgb, cfg)
                with self._cond:
                    self._waiting = True  # for the device: a streaming answer lets us in before its next piece
                with self._device:
                    with self._cond:
                        self._waiting = False
                        self._cond.notify_all()
                    emb, idx, _ = self.chat._encode(pixels)
                frame = _Frame(t, emb, idx, self.counts["encoded"] + 1)
            except Exception as e:  # noqa: BLE001 - kept for the next ask(); the stream goes on
                error = e
            with self._cond:
                if frame is not None:
                    self._frames.append(frame)
                    self.counts["encoded"] += 1
                self.error = error or self.error
                self._busy = False
                self._cond.notify_all()

    def attach(self, source, *, realtime: bool = True) -> None:
        """Capture `source` in a thread through OpenCV: a camera index or /dev/videoN, a stream URL (rtsp://, ...)
        or a video file. It is opened now (VideoError naming it if it cannot be); a capture already running is
        stopped first. Files play at their own frame rate with their own clock; `realtime=False` reads a file as
        fast as the encoder takes its sampled frames, dropping none. Cameras and streams are stamped on arrival."""
        self.detach()
        name = str(source)
        is_file = not isinstance(source, int) and not name.startswith((*STREAM_SCHEMES, "/dev/"))
        if is_file and not Path(name).is_file():
            raise VideoError(f"{name}: video file not found")
        cap = open_capture(source if isinstance(source, int) else os.fspath(source), name,
                           stream=name.startswith(STREAM_SCHEMES))
        self._stop = threading.Event()
        self.capture_error = None
        self._capture = threading.Thread(target=self._capture_loop, args=(cap, name, is_file, realtime, self._stop),
                                         name="tinyvila-live-capture", daemon=True)
        self._capture.start()

    def _capture_loop(self, cap, name: str, is_file: bool, realtime: bool, stop: threading.Event) -> None:
        import cv2  # open_capture has imported it

        fps = cap.get(cv2.CAP_PROP_FPS)
        fps = fps if math.isfinite(fps) and 0 < fps < 1000 else FRAMES_FPS
        start, i = time.monotonic(), 0
        try:
            while not stop.is_set():
                ok, frame = cap.read()
                if not ok:
                    if not is_file:
                        self.capture_error = VideoError(f"{name}: the stream ended or stopped sending frames")
                    return
                t = i / fps if is_file else None
                if is_file and realtime and stop.wait(max(0.0, start + t - time.monotonic())):
                    return
                self._offer(frame, t, bgr=True, wait=is_file and not realtime)
                i += 1
        except Exception as e:  # noqa: BLE001 - e.g. a camera's greyscale frames: said, not a thread traceback
            self.capture_error = VideoError(f"{name}: capture stopped: {e}")
        finally:
            cap.release()

    def detach(self) -> None:
        """Stop the attached capture (if any) and release its source."""
        if self._capture is not None:
            self._stop.set()
            with self._cond:
                self._cond.notify_all()  # a capture waiting for the slot
            self._capture.join()
            self._capture = None

    @property
    def attached(self) -> bool:
        """Whether an attached source is still being read (a file ends, a stream may stop)."""
        return self._capture is not None and self._capture.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the attached source has ended and every frame sampled so far is encoded (or dropped);
        returns False on timeout."""
        if self._capture is not None:
            self._capture.join(timeout)
            if self._capture.is_alive():
                return False
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or (self._slot is None and not self._busy), timeout)

    def wait_frames(self, n: int = 1, timeout: float | None = None) -> bool:
        """Wait until the window holds at least min(n, window) frames; returns False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or len(self._frames) >= min(n, self.window), timeout)

    # -- asking -----------------------------------------------------------------------------------
    def ask(self, question: str, sampling: SamplingParams | None = None) -> Iterator[str]:
        """Answer about the window as it is now (its frames' timestamps: `timestamps`): an iterator of text pieces
        with `close()`, as Chat.ask's answer; frames keep arriving meanwhile. VideoError when no frame has been
        encoded yet, when the encoder failed since the last ask, or after close()."""
        with self._cond:
            if self._closed:
                raise VideoError("this LiveSession is closed; open a new one")
            frames, error, self.error = list(self._frames), self.error, None
        if error is not None:
            raise VideoError(f"live: encoding a frame failed: {error!r}") from error
        if not frames:
            raise VideoError("live: no frame has been encoded yet; push() frames or attach() a source first "
                             "(wait_frames() waits for them)")
        seqs = tuple(f.seq for f in frames)
        with self._device, self.chat._lock:  # one transaction: nothing of another thread's comes between
            answer = None
            if self.reuse and seqs == self._prefilled and self.chat.turns:
                with contextlib.suppress(EvalModeError):  # the question would change the kept prefix: prefill it all
                    answer = self.chat.ask(question, sampling)  # the window has not moved: only the question prefills
            if answer is None:
                self.chat.clear()
                self.chat._add_encoded([(f.emb, f.idx, 0.0) for f in frames])
                self._prefilled = seqs
                answer = self.chat.ask(question, sampling)
        self.timestamps = [f.timestamp for f in frames]
        return self._stream(answer)

    def _stream(self, answer: Answer) -> Iterator[str]:
        """The answer's pieces, each made under the device lock (a waiting encoder runs between them)."""
        try:
            while True:
                with self._device:
                    piece = next(answer, None)
                if piece is None:
                    return
                with self._cond:  # a Lock is not fair: the releasing thread would take it again before the encoder
                    self._cond.wait_for(lambda: not self._waiting or self._closed, timeout=1.0)
                yield piece
        finally:
            answer.close()

    @property
    def stats(self) -> Stats:
        """The last answer's numbers (Chat.stats); encode_ms is 0: its frames were encoded as they came."""
        return self.chat.stats

    # -- the end ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the capture and encoder threads, release the source and drop the window. Idempotent."""
        self.detach()
        with self._cond:
            self._closed = True
            self._slot = None
            self._cond.notify_all()
        self._encoder.join()
        self._frames.clear()

    def __enter__(self) -> LiveSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
