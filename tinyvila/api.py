"""The Python API: `load` a checkpoint, open a `Chat`, add images, `ask` questions (streamed text).

    vlm = tinyvila.load("vila-8b-awq", device="cuda")
    chat = vlm.chat()
    chat.add_image("x.jpg")                 # encoded once, prefilled with the next question
    for piece in chat.ask("What is in the image?"):
        print(piece, end="")
    chat.stats                              # encode / prefill / decode times and token counts

A chat keeps its KV cache across turns: every turn prefills only its own new tokens. The ids of the
whole conversation are always exactly `tokenizer.conversation_ids(...)` of its history, so a turn
sees the same logits as a fresh prefill of the conversation. The CLI (`tinyvila.chat`) uses this API.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import SparsityConfig, VLMConfig, preset
from .errors import (AnswerClosedError, ArgumentError, ChatBusyError, ContextLimitError, EvalModeError,
                     ModelNotFoundError)
from .generate import Decoder, SamplingParams, generate
from .kv_cache import changed_range, turn_spans
from .image import resize_uint8
from .loader import ensure_synthetic, load_checkpoint, random_model, resolve_device, synthetic_tokenizer
from .options import Options
from .tokenizer import IMAGE_TOKEN, TEMPLATES, BPETokenizer, StreamDecoder, stop_ids, turn_ids
from .video import frame_batches, strip_video_tag
from .vlm import ENCODE_BATCH, VLM

DEMO_MODEL = "demo"              # built on first use: tiny, random weights, for the README demo


def _demo_config() -> VLMConfig:
    """The tiny SigLIP + LLaMA preset with a 4096-token context: the README's conversation and several answers of
    the default length fit. (Its tokenizer has whole words: `ensure_synthetic(words=True)` in resolve_model.)"""
    cfg = preset("tiny-siglip-llama")
    return dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, max_seq_len=4096))


DEMO_PRESET = _demo_config()


def checkpoint_dirs() -> list[Path]:
    """Where model names are looked up, in order."""
    dirs = [Path(p) for p in os.environ.get("TINYVILA_CHECKPOINTS", "").split(os.pathsep) if p]
    dirs.append(Path.cwd() / "checkpoints")
    repo_dir = Path(__file__).resolve().parent.parent / "checkpoints"  # an editable install's tree
    if repo_dir not in dirs:
        dirs.append(repo_dir)
    return dirs


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A checkpoint folder for a path or a name (`checkpoints/<name>`); builds the demo on first use."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        from .convert.detect import raw_source_hint  # a .gguf: name the command that converts it

        raise ModelNotFoundError(raw_source_hint(path) or f"{path} is a file; --model takes a checkpoint folder or a "
                                 f"model name")
    looked = [d / str(name_or_path) for d in checkpoint_dirs()] if len(path.parts) == 1 else []
    if str(name_or_path) == DEMO_MODEL:
        # Where a demo was built before, else the first configured place that exists (env, ./checkpoints, the
        # repo's), else ./checkpoints; rebuilt if partial or stale (safe when several processes start at once).
        folder = next((p for p in looked if (p / "config.json").is_file()), None) or \
            next((p for p in looked if p.parent.is_dir()), Path.cwd() / "checkpoints" / DEMO_MODEL)
        return ensure_synthetic(folder, DEMO_PRESET, seed=0, words=True)
    for folder in looked:
        if (folder / "config.json").is_file():
            return folder
    where = "\n  ".join(str(p) for p in (looked or [path]))
    dst = Path("checkpoints") / path.name if looked else path  # ./checkpoints is on the search path
    if path.name.endswith("-awq"):  # a quantized model: built from the fp16 folder or imported from a published AWQ one
        how = (f"  python scripts/quantize.py build /path/to/Llama-3-VILA1.5-8B {dst}           (fp16 VILA folder: AWQ + "
               f"SmoothQuant)\n  python scripts/quantize.py build /path/to/Llama-3-VILA1.5-8B-Fix-AWQ {dst}   (published "
               f"llm-awq or AutoAWQ folder: its W4 LLM as is + SmoothQuant; `import` keeps the vision tower fp16)\n")
    else:
        how = (f"  python scripts/quantize.py import-vila /path/to/Llama-3-VILA1.5-8B {dst}   (fp16 VILA folder; "
               f"`import` reads any source: VILA, AWQ, GGUF)\n"
               f"  python scripts/quantize.py synthetic --preset vila-8b {dst}   (random weights)\n")
    raise ModelNotFoundError(f"model {str(name_or_path)!r} not found. Looked in:\n  {where}\n"
                             f"Build one with scripts/quantize.py, e.g.\n{how}or use --model {DEMO_MODEL} for the "
                             f"tiny random-weight demo.")


class Model:
    """A loaded checkpoint: the VLM, its tokenizer and chat template. Open conversations with `chat()`."""

    def __init__(self, folder: Path, model: VLM, tokenizer):
        self.folder, self.model, self.tokenizer = folder, model, tokenizer
        self.cfg: VLMConfig = model.cfg
        self.template = TEMPLATES[self.cfg.template]
        self.stop_ids = frozenset([*stop_ids(tokenizer, self.template), *self.cfg.eos_ids])

    def chat(self, *, system: str | None = None, sampling: SamplingParams | None = None,
             sparsity: SparsityConfig | None = None, max_seq_len: int | None = None,
             mode: str = "chat") -> "Chat":
        """mode "chat" keeps the Q&A history; "eval" evicts each round's question and answer and keeps
        system + visual KV (SparseVILA's multi-turn protocol: every round is answered as if asked alone)."""
        return Chat(self, system=system, sampling=sampling or SamplingParams(),
                    sparsity=sparsity or self.cfg.sparsity, max_seq_len=max_seq_len, mode=mode)


def load(name_or_path: str | os.PathLike, *, device: str | torch.device = "cpu",
         dtype: torch.dtype | None = None, options: Options | None = None, verify: bool | None = None) -> Model:
    """Load a checkpoint folder or a named model (see `resolve_model`). `options`: the runtime switches
    (tinyvila.Options; default: Options.from_env(), i.e. the defaults unless TINYVILA_CUDA_GRAPH / TINYVILA_PDL
    turn something off). `verify`: check that every weight is finite (None: on a GPU only). The device, config
    and tokenizer are checked before any weight is read; every problem raises a TinyVilaError naming it."""
    device = resolve_device(device)
    folder = resolve_model(name_or_path)
    model, tokenizer = load_checkpoint(folder, device=device, dtype=dtype, verify=verify)
    model.set_options(Options.from_env() if options is None else options)
    return Model(folder, model, tokenizer)


def from_config(cfg: VLMConfig | str, *, device: str | torch.device = "cpu", seed: int = 0,
                options: Options | None = None) -> Model:
    """A random-weight model of any config or preset, made in memory on `device`, with a byte-level
    tokenizer holding its template's special tokens: for benchmarks at real shapes and tests."""
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    cfg = dataclasses.replace(cfg, synthetic=True, eos_ids=())
    model = random_model(cfg, device=device, seed=seed)
    model.set_options(Options.from_env() if options is None else options)
    return Model(None, model, BPETokenizer(synthetic_tokenizer(cfg), source="<synthetic>"))


@dataclass
class Stats:
    """What the last turn cost and how large the conversation is; `line()` is the CLI's stats line.

    `finish`, why the answer ended: "stop" (the model emitted a stop token), "max_tokens" (the sampling's
    max_new_tokens reached), "context" (the KV cache is full: clear() or a larger max_seq_len to go on) or
    "interrupted" (the reader stopped early: close(), Ctrl-C, an error, or a later ask() or clear())."""

    encode_ms: float = 0.0          # vision encoder + projector for images added this turn
    prefill_ms: float = 0.0
    prefill_tokens: int = 0
    decode_ms: float = 0.0
    decode_tokens: int = 0
    context_tokens: int = 0         # tokens in the KV cache after the turn
    images: int = 0
    visual_tokens: int = 0          # LLM tokens of this turn's images before prefill pruning
    visual_kept: int = 0            # of those, kept (SparsityConfig.prefill_keep)
    decode_rows: int = 0            # KV rows per head decode attended over at the turn's start (decode_keep < 1)
    finish: str = ""                # "stop" | "max_tokens" | "context" | "interrupted"
    first_token_ms: float = 0.0     # end of the prefill -> the first answer token on the host (inside decode_ms)
    media_ms: float = 0.0           # decoding and sampling the turn's video frames (add_video; not in TTFT)

    @property
    def decode_tok_s(self) -> float:
        return 1000 * self.decode_tokens / self.decode_ms if self.decode_ms else 0.0

    @property
    def ttft_ms(self) -> float:
        """Time to first token: encode + prefill + the first token's sampling (what a user waits)."""
        return self.encode_ms + self.prefill_ms + self.first_token_ms

    @property
    def e2e_ms(self) -> float:
        return self.encode_ms + self.prefill_ms + self.decode_ms

    def line(self) -> str:
        return (f"encode {self.encode_ms:.1f} ms | prefill {self.prefill_tokens} tok {self.prefill_ms:.1f} ms"
                f" | TTFT {self.ttft_ms:.1f} ms | decode {self.decode_tokens} tok {self.decode_tok_s:.1f} tok/s"
                f" | context {self.context_tokens} tok"
                + (f" | visual {self.visual_kept}/{self.visual_tokens} kept" if self.visual_tokens else "")
                + (f" | decode over {self.decode_rows} KV rows" if self.decode_rows else "")
                + (f" | video decode {self.media_ms:.1f} ms" if self.media_ms else "")
                + f" | {self.finish}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Turn:
    """One question as `Chat.ask` planned it: its ids, inputs and layout (`Chat._layout`)."""

    question: str
    sampling: SamplingParams
    ids: list[int]
    images: torch.Tensor | None     # (n, k, d) the encoded images it takes
    n_images: int
    positions: torch.Tensor | None  # explicit RoPE positions (prefill_positions="original")
    layout: dict
    inputs: int                     # Chat._inputs when planned: images or documents changed since -> re-plan


class Answer:
    """The streamed text of one `Chat.ask`: an iterator of str pieces; `close()` stops it early.

    The turn starts when the stream is first read. Its bookkeeping runs under its chat's lock, one piece at a
    time, so no lock is held between pieces and a dropped stream blocks nothing. A later `ask()` or `clear()`
    of the chat ends it first, keeping the tokens it streamed as the answer; reading it after that raises
    AnswerClosedError, and closing it does nothing.
    """

    def __init__(self, chat: Chat, run: Iterator[str]):
        self._chat, self._run, self._ended_by = chat, run, None
        self.thread = threading.current_thread()  # who reads it (busy checks: Chat._claim)

    def __iter__(self) -> Answer:
        return self

    def __next__(self) -> str:
        with self._chat._lock:
            if self._ended_by is not None:
                raise AnswerClosedError(f"this answer was ended by a later {self._ended_by} of its chat (the text it "
                                        "streamed stays in the conversation); read the newer answer instead")
            if self._run is None:
                raise StopIteration
            self.thread = threading.current_thread()
            try:
                return next(self._run)
            except BaseException:  # its end, or an error: the turn has recorded itself (Chat._decode)
                self._run = None
                raise

    @property
    def streaming(self) -> bool:
        """Asked and not yet ended (it may not have started)."""
        return self._run is not None

    def close(self) -> None:
        """Stop here: the tokens streamed so far are the answer. Does nothing once the answer has ended."""
        with self._chat._lock:
            run, self._run = self._run, None
            if run is not None:
                run.close()  # runs the turn's bookkeeping (the generator's finally)

    def _end(self, by: str) -> None:
        """A later call of the chat (`by`) ends this answer (under the chat's lock)."""
        self.close()
        self._ended_by = by


class Chat:
    """One multi-turn conversation with its own KV cache.

    Threads: a Model may be shared by threads, each with its own Chat. A Chat serves one thread at a time: its
    calls are serialised by a lock, and while it streams an answer for one thread, a call from another thread
    that would change the conversation (`ask`, `clear`, `add_image`, `add_document`, `discard_pending`) raises
    ChatBusyError instead of waiting (an answer abandoned unclosed would make it wait forever).

    A turn is a transaction: when it fails before its first answer token (ContextLimitError, or any exception in
    its prefill: Ctrl-C, out of memory, ...), the chat is exactly as it was, its queued images and documents
    included. Once the answer streams, stopping it early (`close()`, Ctrl-C, a later `ask()` or `clear()`) keeps
    the tokens streamed so far as the answer.
    """

    def __init__(self, vlm: Model, *, system: str | None, sampling: SamplingParams,
                 sparsity: SparsityConfig, max_seq_len: int | None, mode: str = "chat"):
        if mode not in ("chat", "eval"):
            raise ArgumentError("mode", f"mode must be 'chat' or 'eval', got {mode!r}")
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                        or max_seq_len < 1):
            raise ArgumentError("max_seq_len", f"max_seq_len must be a positive number of tokens, got {max_seq_len!r}")
        self.mode = mode
        self.vlm, self.system, self.sampling, self.sparsity = vlm, system, sampling, sparsity
        self.decoder = Decoder(vlm.model.text, max_seq_len, device_lock=vlm.model.device_lock)
        self.stats = Stats()
        self.last_logits: torch.Tensor | None = None   # logits after the last prefill (tests, tools)
        self._lock = threading.RLock()
        self._active: weakref.ref[Answer] | None = None  # the last answer asked (weak: a dropped one goes)
        self._inputs = 0  # counts changes to the queued images and documents
        self.clear()

    # -- the conversation's state, one thread at a time -----------------------------------------
    def _claim(self, ending: str | None) -> None:
        """Before a call that changes the chat (the lock held): refuse it while another live thread's answer
        streams; else, when `ending` names the call, end the streaming answer first."""
        active = self._active() if self._active is not None else None
        if active is None or not active.streaming:
            return
        owner = active.thread
        if owner is not threading.current_thread() and owner.is_alive():
            raise ChatBusyError(f"this Chat is streaming an answer for thread {owner.name!r}; a Chat serves one thread "
                                "at a time: give each thread its own Chat (vlm.chat()), or finish or close() that "
                                "answer first")
        if ending is not None:
            active._end(ending)

    def clear(self) -> None:
        """Forget the conversation (images included); the cache memory is reused. A streaming answer ends."""
        with self._lock:
            self._claim("clear()")
            self.decoder.truncate(0)
            self.turns: list[tuple[str, int, list[int]]] = []  # (user text, n images, answer ids)
            self.pending: list[int] = []   # generated but not yet in the cache (the last answer token)
            self.images: list[torch.Tensor] = []  # encoded images waiting for the next question
            self.image_index: list[torch.Tensor] = []  # (n, k) grid index of each kept token of those
            self.documents: list[str] = []  # retrievable texts waiting for the next question
            self._anchor: tuple[int, list[int]] | None = None  # eval mode: (cache slots, ids) kept per round
            self._encode_ms = self._media_ms = 0.0
            self._inputs += 1

    def discard_pending(self) -> None:
        """Drop the images and documents waiting for the next question (e.g. after a ContextLimitError)."""
        with self._lock:
            self._claim(None)
            self.images, self.image_index, self.documents = [], [], []
            self._encode_ms = self._media_ms = 0.0
            self._inputs += 1

    def _refuse_in_eval(self, what: str) -> None:
        if self.mode == "eval" and self.turns:
            raise EvalModeError(f"eval mode answers every round against the first round's images and documents, so "
                                f"no {what} can be added after it: clear() starts a new evaluation, and a chat opened "
                                'with mode="chat" takes them as the conversation goes')

    def add_image(self, image) -> None:
        """Encode an image (path, the bytes of an image file, PIL image, HxWx3 uint8 array) now; it joins the next
        question."""
        with self._lock:
            self._check_media("image")
            # Resized uint8 pixels: encode_images uploads a quarter of preprocess's float32 bytes and normalises
            # them on the device to the same values (on some H200 hosts the CPU-side copy of the float32 pixels
            # took ~10 ms: docs/perf_notes.md, "Slow encodes").
            self._add_encoded([self._encode(resize_uint8(image, self.vlm.model.cfg.vision))])

    def add_video(self, source, num_frames: int = 8, fps: float | None = None) -> list[float]:
        """Decode a video (file path, bytes, folder of frames or list of frames; tinyvila.video.read_video) and
        sample it as VILA1.5 does: num_frames uniformly, or with `fps` at most that many a second spread over the
        whole clip. Its frames are encoded now, in batches, and join the next question as one image each.
        Returns the timestamps (s) of the frames used. A bad source raises VideoError and changes nothing."""
        with self._lock:
            self._check_media("video")
            encoded, times, media_ms = [], [], 0.0
            for ts, pixels, ms in frame_batches(source, self.vlm.model.cfg.vision, num_frames, fps, ENCODE_BATCH):
                encoded.append(self._encode(pixels))
                times += ts
                media_ms += ms
            self._add_encoded(encoded, media_ms)
            return times

    def _check_media(self, what: str) -> None:
        self._claim(None)
        self._refuse_in_eval(what)
        if self.vlm.model.vision is None:
            raise ArgumentError(what, f"{self.vlm.folder}: this model is text-only and cannot take {what}s")

    def _encode(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(n, S, S, 3) uint8 pixels -> ((n, k, d) embeddings, (n, k) grid index, ms), through the model's
        device lock; the chat is not changed."""
        model = self.vlm.model
        _sync(model.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            emb, idx = model.encode_images(pixels, self.sparsity, with_index=True)
        _sync(model.device)
        return emb, idx, 1000 * (time.perf_counter() - t0)

    def _add_encoded(self, encoded: list[tuple[torch.Tensor, torch.Tensor, float]], media_ms: float = 0.0) -> None:
        """Queue `_encode` results (encoded with this chat's sparsity) for the next question, one entry per image
        (tinyvila.live queues its cached frame embeddings here)."""
        with self._lock:
            self._claim(None)
            for emb, idx, ms in encoded:
                self.images += emb.split(1)
                self.image_index += idx.split(1)
                self._encode_ms += ms
            self._media_ms += media_ms
            self._inputs += 1

    def add_document(self, text: str) -> None:
        """A text (e.g. a long document) that goes before the next question in the same user message,
        marked retrievable: with decode_keep < 1 each question attends to its own subset of it."""
        with self._lock:
            self._claim(None)
            self._refuse_in_eval("document")
            self.documents.append(text)
            self._inputs += 1

    # -- asking ----------------------------------------------------------------------------------
    def ask(self, question: str, sampling: SamplingParams | None = None) -> Answer:
        """Prefill the question (and the images and documents added since the last one) against the cache,
        then stream the answer: an `Answer`, an iterator of text pieces, which runs the turn as it is read.

        A streaming answer of this chat ends first (its streamed tokens stay its answer). Raises
        ContextLimitError, changing nothing, when the turn does not fit; its images and documents stay queued
        (`discard_pending()` drops them). Pieces are the decoded text exactly, control characters included
        (escape sequences, bells): strip them before writing to a terminal, as `python -m tinyvila.chat` does.
        """
        with self._lock:
            self._claim("ask()")
            turn = self._plan(question, sampling or self.sampling)
            answer = Answer(self, self._run(turn))
            self._active = weakref.ref(answer)
            return answer

    def _plan(self, question: str, sampling: SamplingParams) -> _Turn:
        """The turn's ids, inputs and layout; ContextLimitError when it does not fit."""
        if self.mode == "eval" and self.turns:
            return self._plan_eval_round(question, sampling)
        model, decoder = self.vlm.model, self.decoder
        images = torch.cat(self.images) if self.images else None
        n_images = 0 if images is None else images.shape[0]
        prev = self.turns[-1][2] if self.turns else None
        ids = self.pending + turn_ids(self.vlm.tokenizer, self.vlm.template, self._user_text(question), n_images,
                                      first=not self.turns, prev_answer_ids=prev, system=self.system)
        layout = self._layout(ids, question, n_images, prev)
        per_image = None if images is None else images.shape[1]
        self._check_fits(decoder.length, model.n_embeds(ids, per_image) + 1)  # the prompt and one answer token
        positions = None
        if images is not None and self.sparsity.prefill_positions == "original":
            positions = model.positions(ids, torch.cat(self.image_index), decoder.position)
        return _Turn(question, sampling, ids, images, n_images, positions, layout, self._inputs)

    def _check_fits(self, kept: int, n_new: int) -> None:
        """ContextLimitError, naming what stays queued, unless n_new tokens fit after `kept` cached ones."""
        context, declared = self.decoder.max_len, self.vlm.cfg.text.max_seq_len
        if kept + n_new <= context:
            return
        larger = "a larger max_seq_len" + (f" (the model's context is {declared})" if declared > context else "")
        queued = self.queued()
        raise ContextLimitError(
            f"this turn needs {kept + n_new} tokens ({kept} cached + {n_new - 1} new + 1 to answer) but the chat's "
            f"context is {context}; ask a shorter question, clear() to start over, or open the chat with {larger}"
            + (f". The turn's {queued} queued for the next question (discard_pending() drops them)" if queued else ""))

    def queued(self) -> str:
        """The images and documents waiting for the next question, with their verb ("1 image stays", "2 images
        and 1 document stay"); "" when none."""
        parts = [f"{n} {what}{'s' if n > 1 else ''}" for n, what in
                 ((len(self.images), "image"), (len(self.documents), "document")) if n]
        if not parts:
            return ""
        return " and ".join(parts) + (" stays" if len(self.images) + len(self.documents) == 1 else " stay")

    # -- retrievable spans, decode sparsity, evaluation mode (SparseVILA decode) ---------------
    def _user_text(self, question: str, documents: list[str] | None = None) -> str:
        docs = self.documents if documents is None else documents
        return "\n\n".join([*docs, strip_video_tag(question)])  # <video> is no VILA1.5 token: its eval strips it

    def _layout(self, ids: list[int], question: str, n_images: int, prev) -> dict:
        """Where this turn's retrievable document lies in `ids`, and (first turn) the eval anchor."""
        tok, tmpl, first = self.vlm.tokenizer, self.vlm.template, not self.turns
        doc = None
        if self.documents:
            without = self.pending + turn_ids(tok, tmpl, self._user_text(question, [""] * len(self.documents)),
                                              n_images, first=first, prev_answer_ids=prev, system=self.system)
            doc = changed_range(ids, without)
        anchor = None
        if first and self.mode == "eval":  # ids every round shares: up to the last retrievable span
            sentinels = [i + 1 for i, t in enumerate(ids) if t == IMAGE_TOKEN]
            anchor = max([*sentinels, doc[1] if doc else 0])
            if not anchor:  # nothing retrievable: the prompt up to the question text
                anchor, _ = changed_range(ids, turn_ids(tok, tmpl, self._user_text(""), n_images, True,
                                                        system=self.system))
        return {"doc": doc, "first": first, "anchor": anchor, "evict_to": None}

    def _plan_eval_round(self, question: str, sampling: SamplingParams) -> _Turn:
        """Eval mode after the first round: evict back to the anchor (system + visual KV) and ask the
        question as the first turn would have, so the round equals a fresh session with only it."""
        slots, prefix, docs, n_images = self._anchor
        full = turn_ids(self.vlm.tokenizer, self.vlm.template, self._user_text(question, docs), n_images,
                        first=True, system=self.system)
        if full[:len(prefix)] != prefix:
            raise EvalModeError("eval mode: this question changes the tokens of the kept prefix; "
                                "start it with a space or newline, or use chat mode")
        ids = full[len(prefix):]
        self._check_fits(slots, len(ids) + 1)
        layout = {"doc": None, "first": False, "anchor": None, "evict_to": slots}
        return _Turn(question, sampling, ids, None, n_images, None, layout, self._inputs)

    # -- one turn: a transaction up to its first token, then the stream ----------------------------
    def _run(self, turn: _Turn) -> Iterator[str]:
        """The turn, run by its Answer under the chat's lock: the prefill (undone on any exception), then
        the stream."""
        if turn.inputs != self._inputs:  # images or documents came or went since ask(): this turn takes them
            turn = self._plan(turn.question, turn.sampling)
        saved = self._save(turn.layout["evict_to"])
        try:
            logits, stats, t1 = self._prefill(turn)
        except BaseException:
            self._restore(saved)
            raise
        yield from self._decode(turn, logits, stats, t1, saved)

    def _save(self, evict_to: int | None) -> dict:
        """What a turn changes, to put back if it fails before its first token. An eval round's prefill
        overwrites the evicted round's K/V, so those slots are copied too."""
        d = self.decoder
        kv = None
        if evict_to is not None and evict_to < d.length:
            kv = (evict_to, d.length, d.cache.k_stack[:, :, :, evict_to:d.length].clone(),
                  d.cache.v_stack[:, :, :, evict_to:d.length].clone())
        chat = {k: getattr(self, k) for k in ("pending", "images", "image_index", "documents", "_anchor",
                                              "_encode_ms", "_media_ms", "stats", "last_logits")}
        return {"chat": chat, "turns": list(self.turns), "kv": kv,
                "decoder": (d.length, d.position, list(d._explicit), [dataclasses.replace(s) for s in d.cache.spans],
                            d.retrieval.scoring, d.retrieval.packed, d.fastv.scoring, d.fastv.key_mask)}

    def _restore(self, saved: dict) -> None:
        d = self.decoder
        for k, v in saved["chat"].items():
            setattr(self, k, v)
        self.turns = saved["turns"]
        (d.length, d.position, d._explicit, d.cache.spans, d.retrieval.scoring, d.retrieval.packed,
         d.fastv.scoring, d.fastv.key_mask) = saved["decoder"]
        if saved["kv"] is not None:
            a, b, k, v = saved["kv"]
            d.cache.k_stack[:, :, :, a:b] = k
            d.cache.v_stack[:, :, :, a:b] = v

    def _begin_turn(self, ids: list[int], images, layout: dict) -> bool:
        """Record this prefill's spans; start retrieval scoring when decode_keep < 1. Returns whether
        the turn decodes over a packed buffer."""
        decoder = self.decoder
        if layout["evict_to"] is not None:
            decoder.truncate(layout["evict_to"])  # the last round's question and answer go
            self.turns, self.pending = [], []
        start, per_image = decoder.length, 0 if images is None else images.shape[1]
        spans = turn_spans(ids, start, per_image, layout["doc"], first=layout["first"])
        for kind, a, b in spans:
            decoder.cache.add_span(kind, a, b, retrievable=kind in ("visual", "text"))
        if layout["anchor"] is not None:
            slots = start + layout["anchor"] + (per_image - 1) * ids[:layout["anchor"]].count(IMAGE_TOKEN)
            self._anchor = (slots, ids[:layout["anchor"]], list(self.documents), images.shape[0] if images is not None else 0)
        self.documents = []
        retr_end = max([b for kind, a, b in spans if kind in ("visual", "text")], default=start)
        return self.sparsity.decode_keep < 1.0 and decoder.retrieval.begin_scoring(retr_end) > 0

    def _prefill(self, turn: _Turn) -> tuple[torch.Tensor, Stats, float]:
        """Spans, prefill and (decode_keep < 1) packing of the turn -> (logits, its stats so far, end time)."""
        model, decoder, images = self.vlm.model, self.decoder, turn.images
        sparse = self._begin_turn(turn.ids, images, turn.layout)
        stats = Stats(encode_ms=self._encode_ms, images=turn.n_images,
                      visual_tokens=turn.n_images * model.cfg.image_tokens,
                      visual_kept=0 if images is None else images.shape[0] * images.shape[1])
        stats.media_ms, self._encode_ms, self._media_ms = self._media_ms, 0.0, 0.0
        start = decoder.length
        _sync(model.device)
        t0 = time.perf_counter()
        logits = decoder.prefill(model.embed(turn.ids, images), turn.positions)
        if sparse:  # this turn decodes over the top decode_keep of the scored retrievable tokens
            stats.decode_rows = decoder.retrieval.pack(self.sparsity.decode_keep, decoder.length,
                                                       self.sparsity.decode_window)
        _sync(model.device)
        t1 = time.perf_counter()
        stats.prefill_ms, stats.prefill_tokens = 1000 * (t1 - t0), decoder.length - start
        self.last_logits, self.images, self.image_index, self.pending = logits, [], [], []
        return logits, stats, t1

    def _decode(self, turn: _Turn, logits: torch.Tensor, stats: Stats, t1: float, saved: dict) -> Iterator[str]:
        decoder, stop = self.decoder, self.vlm.stop_ids
        start, answer = decoder.length, []
        self.turns.append((turn.question, turn.n_images, answer))
        stream = StreamDecoder(self.vlm.tokenizer, skip_special_tokens=True)
        try:
            for token in generate(decoder, logits, turn.sampling, stop, self.vlm.tokenizer.vocab_size):
                if not answer:  # the token is a host int: its sampling has finished on the device
                    stats.first_token_ms = 1000 * (time.perf_counter() - t1)
                answer.append(token)
                if token not in stop:
                    yield stream.push(token)
            yield stream.flush()
        finally:  # also when the reader stops early, or drops the stream (finalised in any thread)
            with self._lock:
                if answer:
                    self._end_turn(start, answer, stats, turn.sampling, t1)
                else:  # failed before its first token: as if never asked
                    self._restore(saved)

    def _end_turn(self, start: int, answer: list[int], stats: Stats, sampling: SamplingParams, t1: float) -> None:
        """Record the answer (all but its last token are in the cache; that one is fed with the next turn)."""
        decoder = self.decoder
        decoder.retrieval.unpack()  # the full cache keeps every token for the next question
        if decoder.length > start:
            decoder.cache.add_span("answer", start, decoder.length)
        _sync(self.vlm.model.device)
        stats.decode_ms = 1000 * (time.perf_counter() - t1)
        stats.decode_tokens = len(answer)
        self.pending = answer[-1:]
        stats.context_tokens = decoder.length + len(self.pending)
        stats.finish = ("stop" if answer[-1] in self.vlm.stop_ids else
                        "max_tokens" if len(answer) == sampling.max_new_tokens else
                        "context" if decoder.length >= decoder.max_len else "interrupted")
        self.stats = stats

    def add_turn(self, question: str, answer: str) -> None:
        """Record a past exchange without generating it (e.g. a conversation a stateless HTTP client resends):
        the question, with the images and documents queued, and the answer text are prefilled now, as if this
        chat had asked and answered them. A transaction like `ask`: ContextLimitError (or any failure) changes
        nothing."""
        with self._lock:
            self._claim("add_turn()")
            if self.mode == "eval":
                raise EvalModeError('eval mode evicts every round\'s question and answer, so none can be recorded: '
                                    'open the chat with mode="chat"')
            turn = self._plan(question, self.sampling)
            answer_ids = self.vlm.tokenizer.encode(answer, add_special_tokens=False)
            turn.ids += answer_ids[:-1]  # its last token waits in `pending`, as a generated answer's does
            per_image = None if turn.images is None else turn.images.shape[1]
            self._check_fits(self.decoder.length, self.vlm.model.n_embeds(turn.ids, per_image) + 1)
            saved = self._save(None)
            try:
                self._prefill(turn)
            except BaseException:
                self._restore(saved)
                raise
            self.turns.append((question, turn.n_images, answer_ids))
            self.pending = answer_ids[-1:]
