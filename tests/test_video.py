"""Video input (tinyvila/video.py, Chat.add_video, the CLI's --video and /video) on clips written here with OpenCV.

Each frame carries its index in its colour (R and G in steps of 16, B fixed), so a decoded frame names the frame
it is, through lossy codecs too, and an RGB/BGR mix-up shows. Picks are checked against VILA1.5's formula,
computed here with numpy.
"""

import builtins
import math
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from PIL import Image

import tinyvila
import tinyvila.api
from tinyvila import chat as cli
from tinyvila.api import from_config
from tinyvila.errors import ArgumentError, VideoError
from tinyvila.generate import SamplingParams
from tinyvila.loader import build_synthetic
from tinyvila.sparsity import keep_count
from tinyvila.video import read_video

cv2 = pytest.importorskip("cv2")  # the [video] extra; the [test] extra installs it, so CI runs these
FPS = 10
CODECS = [("MJPG", ".avi"), ("mp4v", ".mp4")]
GREEDY = SamplingParams(max_new_tokens=4)


def frame(i: int, size=(64, 48)) -> np.ndarray:
    """HxWx3 RGB uint8 frame i."""
    f = np.empty((size[1], size[0], 3), np.uint8)
    f[..., 0], f[..., 1], f[..., 2] = (i % 16) * 16 + 8, (i // 16 % 16) * 16 + 8, 200  # unique below 256
    return f


def index_of(f: np.ndarray) -> int:
    """The index frame() encoded in an RGB frame (channel means, rounded to the 16-step grid)."""
    assert abs(f[..., 2].mean() - 200) < 8, "channel 2 is not blue: frames came back as BGR"
    r, g = (round((f[..., c].mean() - 8) / 16) for c in (0, 1))
    return g * 16 + r


def write_clip(path, n: int, fourcc: str = "MJPG", size=(64, 48)) -> str:
    w = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), FPS, size)
    assert w.isOpened()
    for i in range(n):
        w.write(np.ascontiguousarray(frame(i, size)[..., ::-1]))  # the writer takes BGR
    w.release()
    return str(path)


def vila_picks(n: int, N: int) -> list[int]:
    return list(range(n)) if n <= N else np.round(np.linspace(0, n - 1, N)).astype(int).tolist()


@pytest.mark.parametrize("fourcc,ext", CODECS)
@pytest.mark.parametrize("n,N", [(37, 8), (13, 8), (101, 7), (8, 8), (5, 8), (1, 8)])
def test_picks_are_vilas_formula_and_decode_those_frames(tmp_path, fourcc, ext, n, N):
    video = read_video(write_clip(tmp_path / f"clip{ext}", n, fourcc), num_frames=N)
    assert video.frame_count == n and video.fps == pytest.approx(FPS)
    assert video.indices == vila_picks(n, N)
    assert [index_of(f) for f in video.frames] == video.indices
    assert all(f.shape == (48, 64, 3) and f.dtype == np.uint8 for f in video.frames)
    assert video.timestamps == pytest.approx([i / FPS for i in video.indices], abs=1e-3)


def test_fps_spreads_its_frames_over_the_whole_clip(tmp_path):
    path = write_clip(tmp_path / "long.avi", 61)  # 6.1 s
    video = read_video(path, num_frames=4, fps=2)  # min(4, 6.1 * 2) frames, not the first 4 / 2 seconds
    assert video.indices == vila_picks(61, 4) and video.indices[-1] == 60
    video = read_video(path, num_frames=8, fps=0.5)  # ceil(6.1 * 0.5) = 4 frames
    assert video.indices == vila_picks(61, math.ceil(6.1 * 0.5))
    assert read_video(path, num_frames=8, fps=2, max_frames=3).indices == vila_picks(61, 3)


def test_a_truncated_file_whose_count_lies_is_recounted(tmp_path):
    data = open(write_clip(tmp_path / "full.avi", 40), "rb").read()
    path = tmp_path / "cut.avi"
    path.write_bytes(data[: len(data) * 6 // 10])
    cap = cv2.VideoCapture(str(path))
    claimed, decoded = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), []
    while (got := cap.read())[0]:
        decoded.append(got[1][..., ::-1])
    cap.release()
    assert claimed == 40 and 8 < len(decoded) < 40  # the container still claims every frame
    video = read_video(path, num_frames=8)
    assert video.frame_count == len(decoded)
    assert video.indices == vila_picks(len(decoded), 8)
    # The frames a plain decode in order gives (FFmpeg repeats the last whole picture for the cut one).
    assert all((f == decoded[i]).all() for f, i in zip(video.frames, video.indices))
    assert [index_of(f) for f in video.frames[:-1]] == video.indices[:-1]


def test_frame_folders_lists_and_bytes(tmp_path):
    folder = tmp_path / "frames"
    folder.mkdir()
    for i in range(12):  # unpadded names: natural order puts frame2 before frame10
        Image.fromarray(frame(i)).save(folder / f"frame{i}.png")
    (folder / "notes.txt").write_text("not a frame")
    video = read_video(folder, num_frames=5)
    assert video.frame_count == 12 and video.indices == vila_picks(12, 5)
    assert all((f == frame(i)).all() for f, i in zip(video.frames, video.indices))  # PNG is lossless
    items = [frame(0), Image.fromarray(frame(1)), folder / "frame2.png", *map(frame, range(3, 10))]
    video = read_video(items, num_frames=4)
    assert video.indices == vila_picks(10, 4) and all((f == frame(i)).all() for f, i in zip(video.frames, video.indices))
    assert read_video(items[:3]).indices == [0, 1, 2]
    assert read_video(np.stack([frame(i) for i in range(9)]), num_frames=3).indices == vila_picks(9, 3)
    path = write_clip(tmp_path / "clip.avi", 23)
    from_bytes = read_video(open(path, "rb").read(), num_frames=6)
    assert from_bytes.indices == read_video(path, num_frames=6).indices == vila_picks(23, 6)


def test_bad_inputs_raise_video_error_naming_the_source(tmp_path):
    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video\n" * 50)
    empty = tmp_path / "empty.avi"
    cv2.VideoWriter(str(empty), cv2.VideoWriter_fourcc(*"MJPG"), FPS, (64, 48)).release()  # a header, no frame
    cut = tmp_path / "cut.mp4"
    data = open(write_clip(tmp_path / "whole.mp4", 20, "mp4v"), "rb").read()
    cut.write_bytes(data[: len(data) // 2])  # its index (moov) was at the end
    (tmp_path / "nothing").mkdir()
    for source in (tmp_path / "missing.mp4", text, empty, cut, tmp_path / "nothing", "rtsp://127.0.0.1:9/none"):
        with pytest.raises(VideoError, match=str(source).replace(".", r"\.")):
            read_video(source)
    with pytest.raises(VideoError, match="empty list"):
        read_video([])
    with pytest.raises(VideoError, match=r"bytes \(11 bytes\)"):
        read_video(b"not a video")
    with pytest.raises(ArgumentError, match="num_frames"):
        read_video(write_clip(tmp_path / "ok.avi", 3), num_frames=0)
    with pytest.raises(ArgumentError, match="fps"):
        read_video(tmp_path / "ok.avi", fps=float("nan"))


def test_without_opencv_the_error_names_the_pip_command(tmp_path, monkeypatch):
    path = write_clip(tmp_path / "clip.avi", 5)
    monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` raises ImportError
    with pytest.raises(VideoError, match=r'clip\.avi: .*pip install "tinyvila\[video\]"'):
        read_video(path)
    assert read_video([frame(0)]).indices == [0]  # frames given as images need no decoder


@pytest.fixture(scope="module")
def vlm():
    return from_config("tiny-siglip-llama")


def test_add_video_queues_one_image_per_frame_and_strips_the_video_tag(vlm, tmp_path):
    path = write_clip(tmp_path / "clip.mp4", 29, "mp4v")
    chat = vlm.chat()
    times = chat.add_video(path, num_frames=6)
    video = read_video(path, num_frames=6)
    assert times == video.timestamps and chat.queued() == "6 images stay"
    text = "".join(chat.ask("<video>\nWhat happens?", GREEDY))
    assert chat.stats.images == 6 and chat.stats.media_ms > 0 and chat.stats.encode_ms > 0
    same = vlm.chat()  # the frames as images, the question without the tag: the same prompt exactly
    for f in video.frames:
        same.add_image(f)
    assert "".join(same.ask("What happens?", GREEDY)) == text
    assert torch.equal(chat.last_logits, same.last_logits)


def test_a_failed_add_video_leaves_the_chat_as_it_was(vlm, tmp_path, monkeypatch):
    chat = vlm.chat()
    chat.add_image(frame(3))
    before = (list(chat.images), chat._encode_ms, chat._media_ms, chat._inputs)
    with pytest.raises(VideoError):
        chat.add_video(tmp_path / "missing.avi")
    monkeypatch.setattr(tinyvila.api, "ENCODE_BATCH", 4)
    calls = []

    def encode(pixels):  # the second batch is interrupted
        calls.append(len(pixels))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return type(chat)._encode(chat, pixels)

    monkeypatch.setattr(chat, "_encode", encode)
    with pytest.raises(KeyboardInterrupt):
        chat.add_video(write_clip(tmp_path / "clip.avi", 20), num_frames=10)
    assert calls == [4, 4]
    assert (list(chat.images), chat._encode_ms, chat._media_ms, chat._inputs) == before


def test_a_long_video_streams_through_the_encoder_in_batches(tmp_path, monkeypatch):
    """300 frames with prefill pruning on the demo's context: only about a batch of frames is ever held."""
    size, n = (160, 120), 300
    path = write_clip(tmp_path / "long.avi", n, size=size)
    vlm = from_config(tinyvila.api.DEMO_PRESET)  # a 4096-token context
    chat = vlm.chat(sparsity=tinyvila.Sparsity(prefill_keep=0.25))
    monkeypatch.setattr(tinyvila.api, "ENCODE_BATCH", 16)
    tracemalloc.start()
    try:
        times = chat.add_video(path, num_frames=n)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    every_frame = n * size[0] * size[1] * 3  # what holding the decoded clip would take
    assert len(times) == n and peak < every_frame / 4, (peak, every_frame)
    "".join(chat.ask("What happens?", GREEDY))
    assert chat.stats.images == n and chat.stats.visual_kept == n * keep_count(vlm.cfg.image_tokens, 0.25)


def test_frame_batches_resize_in_threads_to_the_pixels_and_order_of_one_thread(tmp_path, monkeypatch):
    """frame_batches resizes each frame in worker threads as it is decoded: the same pixels, timestamps and order
    as resizing read_video's frames in the caller's thread, batch by batch."""
    import tinyvila.video as video
    from tinyvila.image import resize_uint8

    path = write_clip(tmp_path / "clip.avi", 41, size=(96, 72))
    cfg = tinyvila.config.preset("tiny-siglip-llama").vision
    monkeypatch.setattr(video, "RESIZE_THREADS", 3)
    video._resize_pool.cache_clear()
    try:
        got = list(video.frame_batches(path, cfg, num_frames=23, batch=8))
        assert video._resize_pool()._max_workers == 3
    finally:
        video._resize_pool().shutdown()
        video._resize_pool.cache_clear()  # later callers get the default pool
    ref = read_video(path, num_frames=23)
    assert [len(t) for t, _, _ in got] == [8, 8, 7]
    assert [t for ts, _, _ in got for t in ts] == ref.timestamps
    assert torch.equal(torch.cat([px for _, px, _ in got]), resize_uint8(ref.frames, cfg))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    build_synthetic(path, "tiny-siglip-llama", seed=1)
    return str(path)


def test_cli_answers_about_a_clip_with_the_video_column(folder, tmp_path, capsys):
    path = write_clip(tmp_path / "clip.avi", 17)
    rc = cli.main(["--model", folder, "--video", path, "--num-frames", "5", "-p", "What happens?",
                   "--max-new-tokens", "3", "--benchmark"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    row = next(x for x in err.splitlines() if x.startswith("[benchmark: encode ms"))
    assert float(row.split("video ms ")[1].split()[0]) > 0 and "decode tok 3" in row
    assert cli.main(["--model", folder, "--video", path, "--num-frames", "0", "-p", "x"]) == 1
    assert "--num-frames must be a positive" in capsys.readouterr().err


def test_repl_video_command(folder, tmp_path, capsys, monkeypatch):
    path = write_clip(tmp_path / "clip.mp4", 11, "mp4v")
    lines = iter(["/video", f"/video {tmp_path / 'missing.mp4'}", f"/video {path}", "describe", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert cli.main(["--model", folder, "--max-new-tokens", "2", "--num-frames", "4"]) == 0
    out, err = capsys.readouterr()
    assert "usage: /video PATH" in out and "missing.mp4: video file not found" in err
    assert f"[video added: {path}, 4 frames at 0.0-1.0 s" in out and "decode 2 tok" in err


def test_cli_without_opencv_names_the_pip_command(folder, tmp_path, capsys, monkeypatch):
    path = write_clip(tmp_path / "clip.avi", 4)
    monkeypatch.setitem(sys.modules, "cv2", None)
    assert cli.main(["--model", folder, "--video", path, "-p", "x"]) == 1
    assert f'error: {path}: reading video needs OpenCV, which is not installed: pip install "tinyvila[video]"' in \
        capsys.readouterr().err
