"""Tensor parallelism over torch.distributed, Megatron / gpt-fast style, for the LLM of a VILA model.

Each rank holds a slice of every decoder layer: q, k and v split by head (each separately; KV heads are
replicated when there are fewer than ranks), gate and up (w13) by output row, o and down (w2) by input column
followed by an all-reduce. Norms, embeddings, lm_head and the vision tower are replicated, so the logits, the
sampled tokens and SparseVILA's prefill pruning (from the replicated vision tower) are the same on every rank;
decode retrieval scores and selects per KV head, so each rank chooses among its own heads' keys. W4 weights
split on group boundaries (`shard_text` checks every split first). `python -m tinyvila.chat --tp N` spawns the
ranks (`launch`); rank 0 owns the terminal or the HTTP server and broadcasts each request (`Leader`, `LeadModel`,
`follow`). Follows gpt-fast's tp.py and vLLM's split rules; tested on CPU over gloo in tests/test_tp.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import socket
import sys
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError, TinyVilaError
from .quant import W4A16Linear


@dataclass
class Rank:
    """This process's place in a tensor-parallel group: rank, world size, the process group of the all-reduces
    (None: the default group), `control`, a gloo group for the host-side requests rank 0 broadcasts, and `joined`:
    every rank has loaded its shard (`load`), so they wait for rank 0's requests."""

    rank: int
    world: int
    group: object = None
    control: object = None
    joined: bool = False


# -- sharding ------------------------------------------------------------------------------------
class RowParallel(nn.Module):
    """A row-parallel linear (input columns split over the ranks) and the all-reduce that sums the partial
    products. Installed only when the world size is above 1, so a TP=1 model runs exactly as before; it has no
    `qweight`, so decode_step's fused chain (whose epilogues add the residual into a partial sum) is off."""

    def __init__(self, linear: nn.Module, group):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        # An in-place NCCL all-reduce on the current stream: graph-capturable once the communicator is warm (the
        # capture's eager warm-up step is its first use at that shape).
        dist.all_reduce(y, group=self.group)
        return y


def _fail(name: str, world: int, what: str) -> ConfigError:
    return ConfigError(f"{name}: {what}, so the model cannot be split over {world} ranks (--tp {world}); use a "
                       f"rank count that divides it")


def check_split(cfg, world: int, group_size: int | None) -> None:
    """ConfigError naming the layer and the rank count unless the TextConfig `cfg` splits over `world` ranks
    (W4: `group_size`, whose groups must not straddle two ranks). Checked before any tensor is sliced."""
    H, KV, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    if H % world:
        raise _fail("text.layers.0.attn.wqkv", world, f"its {H} query heads do not divide into {world} equal parts")
    if KV % world and world % KV:
        raise _fail("text.layers.0.attn.wqkv", world, f"its {KV} KV heads neither divide into {world} parts nor "
                    f"divide {world} (to be replicated)")
    if F % world:
        raise _fail("text.layers.0.mlp.w13", world, f"its FFN width {F} does not divide into {world} equal parts")
    for name, K in (("attn.wo", H * D), ("mlp.w2", F)):
        if group_size and (K // world) % group_size:
            raise _fail(f"text.layers.0.{name}", world, f"its W4 input of {K} columns would split into parts of "
                        f"{K // world}, not whole groups of {group_size}")


def local_config(cfg, world: int):
    """The TextConfig of one rank's shard: its heads, KV heads and FFN width (the KV cache is sized from it)."""
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // world, n_kv_heads=max(cfg.n_kv_heads // world, 1),
                               ffn_dim=cfg.ffn_dim // world, head_dim_override=cfg.head_dim)


def _set(lin: nn.Module, name: str, t: torch.Tensor) -> None:
    old = getattr(lin, name)
    setattr(lin, name, nn.Parameter(t, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else t)


def _rows(lin: nn.Module, index: torch.Tensor) -> None:
    """Keep only output rows `index` of a Linear or W4A16Linear (W4 rows are whole: packing runs along K).
    Each kept tensor is a fresh copy, so the full (memory-mapped) one is let go."""
    names = ("qweight", "scales", "zeros") if isinstance(lin, W4A16Linear) else ("weight",)
    for name in names + (("bias",) if lin.bias is not None else ()):
        _set(lin, name, getattr(lin, name).detach().index_select(0, index))
    lin.out_features = index.numel()


def _cols(lin: nn.Module, part: int, world: int) -> None:
    """Keep input-column part `part` of `world` of a Linear or W4A16Linear: for W4, qweight's K/8 words and the
    scales' and zeros' K/G groups split alike (check_split made sure no group straddles two parts)."""
    K = lin.in_features // world
    per = {"qweight": 8, "scales": lin.group_size, "zeros": lin.group_size} if isinstance(lin, W4A16Linear) else {"weight": 1}
    for name, n in per.items():
        _set(lin, name, getattr(lin, name).detach()[:, part * K // n:(part + 1) * K // n].contiguous())
    lin.in_features = K


def _head_rows(first: int, n: int, D: int, offset: int) -> torch.Tensor:
    return torch.arange(offset + first * D, offset + (first + n) * D)


def shard_text(text: nn.Module, rank: Rank, group_size: int | None = None) -> None:
    """Slice a full TextModel in place to `rank`'s shard and install the all-reduces (world > 1 only).

    wqkv rows [q | k | v]: this rank's query heads, and its KV heads (KV // world of them, or with fewer KV
    heads than ranks the one its query heads read); w13 rows [gate | up]: the same FFN slice of each half;
    wo, w2 input columns. `group_size`: the W4 group size (None: dense)."""
    cfg, r, W = text.cfg, rank.rank, rank.world
    if W == 1:
        return
    check_split(cfg, W, group_size)
    H, KV, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    Hl, KVl = H // W, max(KV // W, 1)
    kv0 = r * KVl if KV >= W else r * KV // W  # replicated: query heads r*Hl.. read KV head (r*Hl) // (H/KV)
    qkv = torch.cat([_head_rows(r * Hl, Hl, D, 0), _head_rows(kv0, KVl, D, H * D),
                     _head_rows(kv0, KVl, D, (H + KV) * D)])
    ffn = torch.cat([torch.arange(r * F // W, (r + 1) * F // W), F + torch.arange(r * F // W, (r + 1) * F // W)])
    for block in text.layers:
        attn, mlp = block.attn, block.mlp
        _rows(attn.wqkv, qkv)
        _cols(attn.wo, r, W)
        _rows(mlp.w13, ffn)
        _cols(mlp.w2, r, W)
        attn.n_heads, attn.n_kv_heads = Hl, KVl
        attn.wo, mlp.w2 = RowParallel(attn.wo, rank.group), RowParallel(mlp.w2, rank.group)
    text.cfg = local_config(cfg, W)


def shard_model(vlm: nn.Module, rank: Rank) -> nn.Module:
    """Shard a VLM's LLM in place (vision tower and projector stay replicated); returns it."""
    quant = vlm.cfg.quant
    shard_text(vlm.text, rank, quant.group_size if quant.llm == "w4a16" else None)
    return vlm


# -- processes -----------------------------------------------------------------------------------
# NVLink multicast stays off in every rank (NCCL's NVLS all-reduce, torch's symmetric-memory multicast): the
# device docs of the machines we run on forbid it, since a multicast object can take a shared GPU out of service.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def from_env() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (or any env:// launcher) started this process with WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ["RANK"]), world) if world > 1 and "RANK" in os.environ else None


def world_size(value: str) -> int:
    """argparse type of --tp (the chat, the server, the camera demo): a rank count of 1 or more."""
    if not value.lstrip("-").isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value}: the rank count must be a whole number, 1 or more")
    return int(value)


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """This rank's device: "cuda" becomes cuda:LOCAL_RANK (torchrun) or cuda:rank; cpu stays cpu."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return device


def init(rank: int, world: int, device: torch.device, init_method: str = "env://") -> Rank:
    """Join the process group: NCCL between GPUs (plus a gloo group for the host-side requests), gloo on CPUs."""
    os.environ.update(NCCL_ENV)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    return Rank(rank, world, None, dist.new_group(backend="gloo") if backend == "nccl" else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(target, rank: int, world: int, args) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank; rank 0 alone decides what it stops
    code = target(rank, world, args)
    # Done: leave without the interpreter's teardown, where a C++ thread of torch's still joinable at finalisation
    # once aborted a finished rank ("terminate called without an active exception"). A raise above exits 1.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def launch(world: int, target, args) -> int:
    """Run target(rank, world, args) on `world` ranks: rank 0 in this process (it keeps the terminal: a
    multiprocessing child has no stdin), ranks 1.. spawned, over a free port on 127.0.0.1. Returns rank 0's code."""
    os.environ.update(NCCL_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(target, r, world, args), daemon=True) for r in range(1, world)]
    for p in procs:
        p.start()
    code, wait = None, 0
    try:
        code, wait = target(0, world, args), 60
    finally:  # after an exception (Ctrl-C while loading) the others may wait for rank 0 for ever: no grace
        for p in procs:
            p.join(timeout=wait)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    # A rank that failed fails the launch; one killed by signal N exits as a shell reports it, 128 + N.
    failed = [1 if c is None else 128 - c if c < 0 else c for c in (p.exitcode for p in procs)]
    return code or next((c for c in failed if c), 0)


def run_rank(rank: int, world: int, device, lead, load) -> int:
    """One rank of a --tp command (what `launch`'s target calls): join the group; rank 0 returns lead(Rank), the
    others follow its requests on load(Rank) = (their chat 0 or None, their Model or None) until it quits."""
    r = init(rank, world, rank_device(device, rank))
    try:
        if rank == 0:
            return lead(r)
        try:
            chat, model = load(r)
        except Exception:  # noqa: BLE001 - tp.load told rank 0, which reports it
            return 1
        return follow(chat, r, model=model)
    finally:
        if rank == 0:
            quit(r)
        dist.destroy_process_group()


def load(name_or_path, rank: Rank, *, device, dtype=None, options=None, verify=None):
    """tinyvila.load for one rank: the full checkpoint memory-mapped, this rank's slice kept (checked first), then
    moved to the device. Every rank reports how its load went before any goes on, so a failure on one rank is an
    error on all (none is left waiting for a request) and rank 0 names it."""
    from .api import Model, resolve_model
    from .config import VLMConfig
    from .loader import load_checkpoint
    from .options import Options

    model, error = None, None
    try:
        folder = resolve_model(name_or_path)
        cfg = VLMConfig.load(folder)
        check_split(cfg.text, rank.world, cfg.quant.group_size if cfg.quant.llm == "w4a16" else None)
        vlm, tok = load_checkpoint(folder, device=device, dtype=dtype, verify=verify,
                                   shard=lambda m: shard_model(m, rank))
        vlm.set_options(Options.from_env() if options is None else options)
        model = Model(folder, vlm, tok)
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then raised
        error = e
    agree(rank, error)
    rank.joined = True
    return model


def agree(rank: Rank, error: BaseException | None) -> None:
    """All ranks exchange whether a step worked; raises the own error, or a TinyVilaError naming the failed rank."""
    found = [None] * rank.world
    dist.all_gather_object(found, None if error is None else f"{type(error).__name__}: {error}", group=rank.control)
    if error is not None:
        raise error
    bad = [(r, e) for r, e in enumerate(found) if e is not None]
    if bad:
        raise TinyVilaError(f"rank {bad[0][0]} of {rank.world} failed: {bad[0][1]}")


# -- requests: rank 0 leads, the others follow ----------------------------------------------------
def _send(rank: Rank, *request) -> None:
    dist.broadcast_object_list([request], src=0, group=rank.control)


def _recv(rank: Rank) -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=rank.control)
    return box[0]


class _DeferInterrupt:
    """Ctrl-C held back while a request runs: raising inside a forward would leave the other ranks waiting in an
    all-reduce that never comes. `pressed` says whether it came; the caller raises at a safe point. Off the main
    thread (the server's worker) there is nothing to hold back: Python delivers Ctrl-C to the main thread."""

    def __enter__(self):
        self.pressed, self._main = False, threading.current_thread() is threading.main_thread()
        if self._main:
            self._old = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, *_):
        self.pressed = True

    def __exit__(self, *exc):
        if self._main:
            signal.signal(signal.SIGINT, self._old)


def _apply(chat, op: str, args: tuple):
    """One request on a rank's chat: a method call or ("set", name, value); encoded frames arrive on the CPU."""
    if op == "_add_encoded":
        args = ([tuple(t.to(chat.vlm.model.device) if torch.is_tensor(t) else t for t in e) for e in args[0]], *args[1:])
    return setattr(chat, *args) if op == "set" else getattr(chat, op)(*args)


class Leader:
    """Rank 0's Chat: each request is sent to the other ranks, then run here, so every rank's Chat goes through
    the same calls with the same arguments (and their forwards' collectives pair up). Images are read here; the
    resized pixels travel. Sampling gets a seed drawn here: every rank then samples the same tokens from the
    same (all-reduced, replicated) logits. `cid` names the chat on every rank (0: the CLI's one chat)."""

    # Read on rank 0 alone; `_encode` too: the vision tower is replicated, so a frame encoded here (tinyvila.live)
    # needs no other rank, and its embeddings travel with `_add_encoded`.
    READ = ("stats", "images", "queued", "decoder", "vlm", "sampling", "sparsity", "turns", "mode", "last_logits",
            "_encode", "_lock")

    def __init__(self, chat, rank: Rank, cid: int = 0):
        self.chat, self.rank, self.cid = chat, rank, cid

    def __getattr__(self, name):
        if name in self.READ:
            return getattr(self.chat, name)
        raise ConfigError(f"Chat.{name} is not available under tensor parallelism (--tp): the other ranks would "
                          f"not see it")

    def _run(self, op: str, *args):
        with _DeferInterrupt() as d:
            _send(self.rank, self.cid, op, *args)
            out = _apply(self.chat, op, args)
        if d.pressed:
            raise KeyboardInterrupt
        return out

    @property
    def system(self) -> str | None:
        return self.chat.system

    @system.setter
    def system(self, value: str | None) -> None:
        self._run("set", "system", value)

    def add_turn(self, question: str, answer: str) -> None:
        self._run("add_turn", question, answer)

    def _add_encoded(self, encoded: list, media_ms: float = 0.0) -> None:
        self._run("_add_encoded", [tuple(t.cpu() if torch.is_tensor(t) else t for t in e) for e in encoded], media_ms)

    def add_image(self, image) -> None:
        from .image import resize_uint8

        pixels = resize_uint8(image, self.chat.vlm.model.cfg.vision)[0].numpy()  # (S, S, 3): resizes to itself
        self._run("add_image", pixels)

    def add_video(self, source, num_frames: int = 8, fps: float | None = None) -> list[float]:
        """Decoded and sampled here (a bad source fails before the others hear of it); the resized frames travel and
        each rank queues them as pre-sampled frames (resizing them again is the identity). Returns their times."""
        from .video import frame_batches

        batches = list(frame_batches(source, self.chat.vlm.model.cfg.vision, num_frames, fps))
        self._run("add_video", [f for _, px, _ in batches for f in px.numpy()], sum(len(b[0]) for b in batches))
        return [t for ts, _, _ in batches for t in ts]

    def clear(self) -> None:
        self._run("clear")

    def discard_pending(self) -> None:
        self._run("discard_pending")

    def ask(self, question: str, sampling=None) -> "_LeadStream":
        sampling = sampling or self.chat.sampling
        if sampling.temperature > 0 and sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=random.getrandbits(62))
        return _LeadStream(self._run("ask", question, sampling), self.rank)



class _LeadStream:
    """Rank 0's Answer: before each piece it tells the others to go on (1), and closing early tells them to stop
    (0), so every rank's answer ends after the same tokens. The pieces match because the tokens do."""

    def __init__(self, answer, rank: Rank):
        self.answer, self.rank, self.done, self.interrupted = answer, rank, False, False

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self.interrupted:
            raise KeyboardInterrupt
        if self.done:
            raise StopIteration
        with _DeferInterrupt() as d:
            _send(self.rank, 1)
            try:
                piece = next(self.answer)
            except BaseException:
                self.done = True  # the others end (or fail) at the same point
                raise
        self.interrupted = d.pressed
        return piece

    def close(self) -> None:
        if not self.done:
            self.done = True
            _send(self.rank, 0)
        self.answer.close()


class LeadModel:
    """Rank 0's Model for a caller that opens many chats (the HTTP server's engine): `chat()` opens the same chat
    on every rank, under a new id, and returns its Leader. A chat rank 0 no longer holds (its Leader collected) is
    dropped on the other ranks when the next one opens. Everything else reads rank 0's Model."""

    def __init__(self, base, rank: Rank):
        self.base, self.rank, self._live, self._next = base, rank, weakref.WeakValueDictionary(), 1

    def __getattr__(self, name):
        return getattr(self.base, name)

    def chat(self, **kw) -> Leader:
        cid, self._next = self._next, self._next + 1
        _send(self.rank, cid, "new", kw, sorted(self._live))
        lead = self._live[cid] = Leader(self.base.chat(**kw), self.rank, cid)
        return lead


def quit(rank: Rank) -> None:
    """Rank 0 at the end of the session: let the other ranks go (when they got as far as waiting for requests)."""
    if rank.joined:
        _send(rank, None, "quit")


def follow(chat, rank: Rank, model=None) -> int:
    """A rank > 0: run rank 0's requests on this rank's chats (`chat`, id 0; those LeadModel opens from `model`)
    until it quits. Errors are rank 0's to report (the same inputs meet the same state on every rank)."""
    chats = {0: chat}
    while True:
        cid, op, *args = _recv(rank)
        if op == "quit":
            return 0
        try:
            if op == "new":
                for gone in [i for i in chats if i and i not in args[1]]:
                    del chats[gone]
                chats[cid] = model.chat(**args[0])
                continue
            out = _apply(chats[cid], op, args)
            if op == "ask":
                _follow_answer(out, rank)
        except Exception:  # noqa: BLE001 - rank 0 raised the same and reports it
            pass


def _follow_answer(answer, rank: Rank) -> None:
    try:
        while _recv(rank)[0] == 1:
            next(answer)
    except StopIteration:
        pass
    finally:
        answer.close()
