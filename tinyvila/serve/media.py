"""Media content parts -> digests now, resized RGB pixels when they are prefilled, in the request's thread, off the engine.

URLs: `data:` (base64 or percent-encoded) always; `file://` only under the folder given by
--allowed-local-media-path (vLLM's flag); http(s) only with --allow-http-media. Images go through tinyvila.image
(its format allow-list and pixel limit). Video: `data:video/mp4;base64,...` (any container OpenCV reads) or a
file, through tinyvila.video.read_video; `data:video/jpeg;base64,<f1>,<f2>,...` is vLLM's form of frames a camera
client sampled itself. Each part's `max_frames` / `fps` (SGLang's fields) override the server's defaults. Every
fault is a RequestError (400, or 413 for a fetched file over the size limit) naming the part.
A medium's digest is taken from what was sent (a data URL's text, a file's or a fetched URL's bytes), so the media of
a history that a cached chat holds already are checked and digested but never decoded.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import ipaddress
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import VisionConfig
from ..errors import TinyVilaError
from ..image import resize_uint8
from .protocol import Part, RequestError, Turn

FRAME_TYPES = ("video/jpeg", "video/png", "video/webp")  # data URLs that hold a list of frames, not a container


@dataclass(frozen=True)
class MediaPolicy:
    """What media URLs a server may read, and how much."""

    local_root: Path | None = None      # file:// URLs only under this folder (None: refused)
    allow_http: bool = False            # http(s) URLs fetched by the server
    allow_private_hosts: bool = False   # ... also from loopback, private, link-local and other non-global addresses
    max_bytes: int = 64 * 2**20         # a file:// or http(s) medium's size limit
    timeout_s: float = 10.0             # http(s) fetch timeout
    video_frames: int = 8               # frames sampled from a video without max_frames (VILA1.5's default)
    max_frames: int = 64                # the most a request may ask for


@dataclass
class Media:
    """A medium of a request. `digest`, what prefix reuse compares, is SHA-256 over the medium as sent and the fields
    that choose its frames: equal digests mean equal pixels. A data URL's is taken on first use (a history's when the
    request is looked up, a new medium's after its answer, off the time to the first token); a file's or a fetched
    URL's when it is read. `pixels` (n, S, S, 3) uint8, resized for the vision tower (n = 1 for an image, the sampled
    frames for a video), are None until `decode()`."""

    kind: str
    load: Callable[[], tuple[np.ndarray, list[float] | None]] | None = field(repr=False, compare=False)
    hasher: Callable[[], str] | None = field(default=None, repr=False, compare=False)
    pixels: np.ndarray | None = None
    timestamps: list[float] | None = None
    _digest: str | None = field(default=None, repr=False)

    @property
    def digest(self) -> str:
        if self._digest is None:
            self._digest, self.hasher = self.hasher(), None
        return self._digest

    def decode(self) -> np.ndarray:
        """The pixels, decoded on the first call (RequestError on a bad medium)."""
        if self.pixels is None:
            (self.pixels, self.timestamps), self.load = self.load(), None  # a fetched medium's bytes go now
        return self.pixels


def read_media(turns: list[Turn], policy: MediaPolicy, cfg: VisionConfig | None) -> None:
    """Every media part of every turn -> `turn.media`: URLs checked, files read, nothing decoded (RequestError on
    any fault found so far)."""
    for turn in turns:
        if turn.parts and cfg is None:
            raise RequestError("this model is text-only: it takes no images or videos", turn.parts[0].where)
        turn.media = [read_part(p, policy, cfg) for p in turn.parts]


def decode_media(turns: list[Turn]) -> None:
    """Decode the pixels of the turns' media (each once; RequestError on a bad medium)."""
    for turn in turns:
        for m in turn.media:
            m.decode()


def read_part(part: Part, policy: MediaPolicy, cfg: VisionConfig) -> Media:
    """One part -> Media, its URL checked and (but for a data URL) its bytes read and hashed; no pixels yet."""
    scheme, mime, data = read_url(part, policy)
    # The fields that choose the pixels, then the medium: the tuple's repr ends where the data starts, so no two
    # (fields, data) pairs hash the same bytes.
    fields = repr((part.kind, scheme, mime, part.fps, part.max_frames, policy.video_frames, policy.max_frames))
    media = Media(part.kind, functools.partial(_pixels, part, policy, cfg, mime, data))
    if isinstance(data, str):  # a data URL: the request holds its text anyway
        media.hasher = functools.partial(_digest, fields, data)
    else:  # hashed in the request's thread, so the engine's neither reads a file nor keeps the bytes after decoding
        media._digest = _digest(fields, data)
    return media


def _digest(fields: str, data: str | bytes | Path) -> str:
    h = hashlib.sha256(fields.encode())
    if isinstance(data, Path):
        # A local video, hashed as read here and decoded from the path later: a file rewritten in between would pair
        # new pixels with the old digest (a race with the server's operator, who owns the folder, not with a client).
        with data.open("rb") as f:
            hashlib.file_digest(f, lambda: h)
    else:  # surrogatepass: a JSON string may hold lone surrogates, which utf-8 refuses
        h.update(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    return h.hexdigest()


def _pixels(part: Part, policy: MediaPolicy, cfg: VisionConfig, mime: str,
            data: str | bytes | Path) -> tuple[np.ndarray, list[float] | None]:
    """A medium as read_url gave it -> (pixels, a video's timestamps or None)."""
    if isinstance(data, str):  # a data URL, decoded only now
        mime, data = _data_url(data, f"{part.where}.{part.kind}_url.url")
    if part.kind == "image":
        return _image_pixels(data, part.where, cfg), None
    return _video_pixels(mime, data, part, policy, cfg)


# -- URLs ----------------------------------------------------------------------------------------------
def read_url(part: Part, policy: MediaPolicy) -> tuple[str, str, str | bytes | Path]:
    """(scheme, mime type or "", data) of a part's URL. data: a data: URL's own text (decoded later), a file:// video's
    checked path, else the medium's bytes."""
    url, where = part.url, f"{part.where}.{part.kind}_url.url"
    colon = url.find(":")  # not split: a data URL is the whole medium, and splitting copies it
    scheme = url[:colon].lower() if colon > 0 else ""
    if scheme == "data":
        comma = url.find(",", colon)
        if comma < 0:
            raise RequestError(f"{where}: a data: URL needs a ',' before its data", where, code="invalid_url")
        return scheme, url[5:comma].split(";")[0].strip().lower(), url
    if scheme == "file":
        path = _local_file(url, where, policy)
        return scheme, "", path if part.kind == "video" else path.read_bytes()  # an image decodes the bytes hashed
    if scheme in ("http", "https"):
        return ("http", *_fetch(url, where, policy))
    raise RequestError(f"{where}: unsupported URL scheme {scheme or url[:20]!r}; send the file as a data: URL "
                       "(data:image/png;base64,...)", where, code="invalid_url")


def _data_url(url: str, where: str) -> tuple[str, bytes]:
    comma = url.find(",")  # read_url checked there is one
    header, data = url[5:comma], url[comma + 1:]
    mime = header.split(";")[0].strip().lower()
    if not header.endswith(";base64"):
        return mime, urllib.parse.unquote_to_bytes(data)
    if mime in FRAME_TYPES:  # the frames stay separate: split later, each its own base64
        return mime, data.encode()
    return mime, _b64(data, where)


def _b64(data: str, where: str) -> bytes:
    """Strict base64 (b64decode(validate=True), on the str itself: no ASCII copy), whitespace allowed."""
    try:  # as sent, first: removing whitespace copies the data, and only MIME-style base64 has any
        return binascii.a2b_base64(data, strict_mode=True)
    except (binascii.Error, ValueError):
        pass
    try:
        return binascii.a2b_base64("".join(data.split()), strict_mode=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the data is not valid base64", where, code="invalid_base64") from None


def _local_file(url: str, where: str, policy: MediaPolicy) -> Path:
    if policy.local_root is None:
        raise RequestError(f"{where}: file:// URLs are off on this server (start it with --allowed-local-media-path "
                           "DIR to serve files under DIR)", where, code="invalid_url")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise RequestError(f"{where}: a file:// URL must name a local path (file:///path)", where, code="invalid_url")
    root = policy.local_root.resolve()
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise RequestError(f"{where}: {path} is outside the allowed folder {root}", where, code="invalid_url")
    if not path.is_file():
        raise RequestError(f"{where}: no file {path}", where, code="invalid_url")
    if path.stat().st_size > policy.max_bytes:
        raise RequestError(f"{where}: {path} is over the server's {policy.max_bytes} byte limit for media", where,
                           status=413, code="media_too_large")
    return path


def _fetch(url: str, where: str, policy: MediaPolicy) -> tuple[str, bytes]:
    if not policy.allow_http:
        raise RequestError(f"{where}: http(s) media URLs are off on this server (start it with --allow-http-media, "
                           "or send the file as a data: URL)", where, code="invalid_url")
    opener = urllib.request.build_opener(_CheckedRedirects(where, policy))
    try:
        _check_host(url, where, policy)
        with opener.open(url, timeout=policy.timeout_s) as r:
            data = r.read(policy.max_bytes + 1)
            mime = (r.headers.get_content_type() or "").lower()
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RequestError(f"{where}: cannot fetch {url[:200]} ({e})", where, code="invalid_url") from None
    if len(data) > policy.max_bytes:
        raise RequestError(f"{where}: {url[:200]} is over the server's {policy.max_bytes} byte limit for media",
                           where, status=413, code="media_too_large")
    return mime, data


def _check_host(url: str, where: str, policy: MediaPolicy) -> None:
    """RequestError unless every address the URL's host resolves to is a global one (or the policy allows private
    hosts): a client must not make the server read its own loopback services, the LAN or a cloud metadata endpoint.
    The fetch resolves the name again, so a DNS server that answers differently the second time (rebinding) is not
    stopped: with untrusted clients, keep http media off."""
    if policy.allow_private_hosts:
        return
    host = urllib.parse.urlsplit(url).hostname
    if not host:
        raise RequestError(f"{where}: {url[:200]} names no host", where, code="invalid_url")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as e:
        raise RequestError(f"{where}: cannot resolve {host} ({e})", where, code="invalid_url") from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0].split("%")[0])
        if not addr.is_global:
            raise RequestError(f"{where}: {host} is a non-public address ({addr}); this server fetches media from "
                               "public hosts only (start it with --allow-private-media-hosts to allow it)", where,
                               code="invalid_url")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an http(s) URL whose host passes `_check_host`."""

    def __init__(self, where: str, policy: MediaPolicy):
        super().__init__()
        self.where, self.policy = where, policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise RequestError(f"{self.where}: redirected to a URL that is not http(s)", self.where, code="invalid_url")
        _check_host(newurl, self.where, self.policy)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


# -- pixels ---------------------------------------------------------------------------------------------
def _image_pixels(data: bytes | Path, where: str, cfg: VisionConfig) -> np.ndarray:
    """An image file or its bytes -> (1, S, S, 3) uint8 through tinyvila.image, with the format and pixel checks
    `Chat.add_image` applies; a bad image is a 400 naming the part."""
    try:
        return resize_uint8(data, cfg).numpy()
    except TinyVilaError as e:  # ImageError: not an allowed format, corrupt, over the pixel limit
        raise RequestError(str(e).replace(str(data) if isinstance(data, Path) else "image", where, 1), where,
                           code="invalid_image") from None


def _video_pixels(mime: str, data: bytes | Path, part: Part, policy: MediaPolicy,
                  cfg: VisionConfig) -> tuple[np.ndarray, list[float]]:
    """A video (a container's bytes or file, or vLLM's list of frames) -> (n, S, S, 3) uint8 and the frames'
    timestamps (s; a frame list's are its frame numbers, as it carries no clock)."""
    from ..video import frame_batches, sample_indices  # OpenCV is imported only when a video comes

    frames = part.max_frames or policy.video_frames
    if frames > policy.max_frames:
        raise RequestError(f"{part.where}: max_frames {frames} is over the server's limit of {policy.max_frames} "
                           "(--max-frames)", f"{part.where}.video_url.max_frames")
    if mime in FRAME_TYPES:  # pre-sampled frames, each an image: only those picked are decoded
        items = data.decode().split(",")
        picks = sample_indices(len(items), min(len(items), part.max_frames or policy.max_frames))
        pixels = [_image_pixels(_b64(items[i], part.where), f"{part.where} frame {i}", cfg) for i in picks]
        return np.concatenate(pixels), [float(i) for i in picks]
    stamps, batches = [], []
    try:  # a batch at a time: only one batch of full-size frames is ever held
        for ts, pixels, _ in frame_batches(data, cfg, frames, part.fps, batch=8, max_frames=frames):
            stamps += ts
            batches.append(pixels.numpy())
    except TinyVilaError as e:  # VideoError: not a video, no frame decodes, no OpenCV
        raise RequestError(f"{part.where}: {e}", part.where, code="invalid_video") from None
    return np.concatenate(batches), [float(t) for t in stamps]
