"""One image through the chat's encode path, part by part: where the chat's encode time goes beside the
encoder's own kernel time (the two once differed 5x), and SparseVILA's prune from a CUDA graph.

    python -m scripts.bench_kernels --only encode_path [--encode-pipelines fp16,quant,sparse]
        [--encode-keep 0.5] [--encode-preset vila-8b] [--encode-ask 8] [--encode-iters 10] [--encode-profile quant]

Pipelines are bench.py's (sparse = quant with prefill_keep --encode-keep); synthetic weights, built as
bench.py builds them; each measured round also answers --encode-ask tokens (0: none), so add_image runs in
a live chat as in bench.py; --encode-profile prints a profiler table of one add_image per named pipeline.

Rows per pipeline and part: `wall_ms` (host clock around the call, synchronised before and after, as
Chat.stats times add_image), `event_ms` (CUDA events around the call as the host issues it: includes
host launch gaps), `gpu_ms` (events with the GPU held busy by a spin queued first, so the host issues
everything ahead: device time only) and `host_sync` (the host waited for the GPU inside the call: a
sync, e.g. a pageable copy or .item()). Parts: preprocess (CPU), h2d (pixels to the GPU in the model
dtype), vision eager/graph (VisionEncoder, own graph), projector (eager), encode graph (VLM graph:
encoder + projector, or SparseVILA's whole prune), prune eager, vision graph + eager projector,
encode_images, add_image (Chat, the number bench.py reports). Also: graph captures during the measured
rounds (must be 0), finiteness of the features. Runs on CPU too (smoke test, wall clock only).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

import tinyvila
from tinyvila import sparsity as sparse
from tinyvila.api import from_config
from tinyvila.config import QuantConfig, SparsityConfig, preset
from tinyvila.image import preprocess

CPU_OK = True  # bench_kernels runs this one without a GPU too (wall clock only)
SPIN_CYCLES_PER_MS = 2_000_000  # ~ the H200's clock; the spin only has to outlast the host's issuing


def pipeline_config(name: str, base, keep: float):
    """bench.py's pipelines: fp16 dense; quant = W4A16 LLM + W8A8 vision; sparse = quant + SparseVILA."""
    if name == "fp16":
        return base
    group = 128 if base.text.dim % 128 == 0 else 32  # tiny presets (CPU smoke runs)
    cfg = dataclasses.replace(base, quant=QuantConfig(llm="w4a16", vision="w8a8", group_size=group))
    if name == "sparse":
        cfg = dataclasses.replace(cfg, sparsity=SparsityConfig(prefill_keep=keep, decode_keep=0.25))
    return cfg


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure(fn, iters: int, cuda: bool) -> dict:
    """Median wall / event / device-only ms of fn() and whether it synchronised the host."""
    fn()
    walls, events, gpus, synced = [], [], [], False
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        fn()
        if cuda:
            e.record()
            torch.cuda.synchronize()
            events.append(s.elapsed_time(e))
        walls.append(1000 * (time.perf_counter() - t0))
    row = {"wall_ms": _median(walls), "event_ms": _median(events) if cuda else None, "gpu_ms": None,
           "host_sync": None, "note": None}
    if cuda:  # device time: a spin longer than the host's issuing, then the call queued behind it
        spin = int(SPIN_CYCLES_PER_MS * (2 * row["wall_ms"] + 5))
        for _ in range(max(3, iters // 2)):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(spin)
            s.record()
            fn()
            synced |= s.query()  # the spin already done when fn returns: fn waited for the GPU
            e.record()
            torch.cuda.synchronize()
            gpus.append(s.elapsed_time(e))
        row["gpu_ms"], row["host_sync"] = _median(gpus), synced
    return row


def build(name: str, args) -> tuple:
    cfg = pipeline_config(name, preset(args.encode_preset), args.encode_keep)
    vlm = from_config(cfg, device=args.device)  # encoder graphs on, as bench.py and tinyvila.load
    vlm.stop_ids = frozenset()
    chat = vlm.chat(sparsity=cfg.sparsity, max_seq_len=min(4096, cfg.text.max_seq_len))
    return vlm, chat, cfg


def chat_round(chat, image, ask: int) -> float:
    """One round as bench.py runs it: add_image, then (ask > 0) a question answered with `ask` tokens.
    Returns add_image's time as Chat.stats records it (ms)."""
    if chat.decoder.length > chat.decoder.max_len // 2:
        chat.clear()  # the conversation grows by an image and a Q&A a round
    before = chat._encode_ms
    chat.add_image([image])
    ms = chat._encode_ms - before
    if ask:
        for _ in chat.ask("Describe the image in detail.", tinyvila.SamplingParams(max_new_tokens=ask)):
            pass
    else:
        chat.clear()
    return ms


def _note(pipeline: str, part: str, note) -> dict:
    return {"pipeline": pipeline, "part": part, "wall_ms": None, "event_ms": None, "gpu_ms": None,
            "host_sync": None, "note": note}


def _captures(model) -> int:
    return sum(g.captures for g in (model.vision.graphs, model._graphs) if g is not None)


def parts(name: str, vlm, chat, cfg, image, args) -> list[dict]:
    model, cuda, iters = vlm.model, args.device == "cuda", args.encode_iters
    sp = cfg.sparsity
    dense = sp.prefill_keep >= 1.0
    pixels_cpu = preprocess([image], cfg.vision)
    px = pixels_cpu.to(model.device, model.dtype)
    rows = []

    def row(part: str, fn, n: int = iters) -> None:
        with torch.inference_mode():
            rows.append({"pipeline": name, "part": part, **measure(fn, n, cuda)})

    row("preprocess (CPU)", lambda: preprocess([image], cfg.vision))
    row("h2d", lambda: pixels_cpu.to(model.device, model.dtype))
    row("vision eager", lambda: model.vision._forward(px), max(3, iters // 3))
    if cuda:
        row("vision graph", lambda: model.vision(px))
    feats = model.vision._forward(px)
    row("projector eager", lambda: model.projector(feats))
    row("vision graph + projector eager" if cuda else "vision + projector eager",
        lambda: model.projector(model.vision(px)))
    if not dense:
        k = sparse.keep_count(model.projector.n_out, sp.prefill_keep)
        layer = sparse.salience_layer(cfg.vision, sp)
        row("prune eager", lambda: sparse.prune_top_k(model.vision, model.projector, px, k, layer), max(3, iters // 3))
    if cuda:
        graphs = model._encode_graphs()
        fn = (lambda: graphs(px)) if dense else (lambda: graphs(px, k, layer))
        row("encode graph (VLM)" if dense else "prune graph (VLM)", fn)
    row("encode_images", lambda: model.encode_images(px, sp, with_index=True))
    row("encode_images from CPU pixels", lambda: model.encode_images(pixels_cpu, sp, with_index=True))
    with torch.inference_mode():
        out = model.encode_images(px, sp)
    rows.append(_note(name, "features", f"finite {bool(torch.isfinite(out).all())}, "
                      f"absmax {out.float().abs().max().item():.3g}"))
    return rows


def profile(vlm, chat, image) -> None:
    """Profiler table of one add_image in the live chat (top host and device entries)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        chat_round(chat, image, 0)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr)
    print(p.key_averages().table(sort_by="self_device_time_total", row_limit=10), file=sys.stderr)


def run_pipeline(name: str, args) -> list[dict]:
    vlm, chat, cfg = build(name, args)
    image = torch.randint(0, 256, (cfg.vision.image_size,) * 2 + (3,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0)).numpy()
    for _ in range(2):  # warm-up: every shape, compilation and graph capture of the measured rounds
        chat_round(chat, image, args.encode_ask)
    model = vlm.model
    caps = _captures(model)
    chat_ms = [chat_round(chat, image, args.encode_ask) for _ in range(args.encode_iters)]
    rows = [{**_note(name, f"Chat.add_image (stats, ask {args.encode_ask})", None), "wall_ms": _median(chat_ms)},
            _note(name, "graph captures in measured rounds", _captures(model) - caps)]
    if args.device == "cuda" and name in args.encode_profile.split(","):
        profile(vlm, chat, image)
    rows += parts(name, vlm, chat, cfg, image, args)
    for r in rows:
        print("  ", {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()}, file=sys.stderr, flush=True)
    return rows


def add_args(p) -> None:
    p.add_argument("--encode-pipelines", default="fp16,quant,sparse", help="comma-separated, from fp16,quant,sparse")
    p.add_argument("--encode-preset", default="vila-8b")
    p.add_argument("--encode-keep", type=float, default=0.5, help="the sparse pipeline's prefill_keep")
    p.add_argument("--encode-ask", type=int, default=8, help="tokens each measured round also answers (0: none)")
    p.add_argument("--encode-iters", type=int, default=10)
    p.add_argument("--encode-profile", default="quant", help="pipelines that print a profiler table ('' = none)")


def run(args) -> list[dict]:
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in args.encode_pipelines.split(","):
        rows += run_pipeline(name, args)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows
