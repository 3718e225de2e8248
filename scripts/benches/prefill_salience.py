"""Prefill salience (SparseVILA column-reduce) against naive PyTorch and the public flash-colreduce, fp16.

    python -m scripts.bench_kernels --only prefill_salience [--quick]   (needs `flash-colreduce`)
    # the comparison with flash-colreduce alone (~2 min):
    python -m scripts.bench_kernels --only prefill_salience --salience-shapes siglip1,siglip8,siglip64,4k,16k \
        --salience-sweep-shapes "" --salience-no-encoder

Flags: --salience-shapes, a comma list of siglip1,siglip8,siglip64,4k,16k,64k (default all); --salience-sweep-shapes,
the shapes that also get the tile sweep (default all; "" none); --salience-sweep "R,S,W,P;..." to sweep those
configs instead of SWEEP; --salience-no-encoder skips the W8A8 encoder rows. The sweep prints a row per config
(standalone = both passes, fused = the column pass alone; their difference is pass 1).
Three times per method: ms (eager: events around each call, so host launch time is inside; at 1
frame that is most of it), dev_ms (device: a GPU spin of 2x the eager time, 0.2-2 ms, queued before
each call hides the host) and graph_ms (per call replayed from a CUDA graph, eager < 1 ms only); x_*
ratios of each. At 1-8 frames one more row times our standalone call with every launch through Triton's
dispatch (direct launch off): the direct launch's share of the eager time.

Shapes: SigLIP (H=16, N=729, D=72) at 1/8/64 frames, long sequences (H=16, D=80) at
N=4K/16K/64K (--quick: up to 4K, no sweep). Rows: naive (softmax(QK^T) materialised, then the mean;
and flash_colreduce's naive_colreduce), flash-colreduce, ours standalone (LSE pass + column pass),
ours fused (the salience layer's flash attention already gave the LSE: column pass only, the
encoder's real cost), each at DEFAULT_TILES and at every config of a tile sweep; and the
flash attention (+LSE) itself for scale. TFLOP/s counts the QK^T passes run (2 standalone, 1 fused).
Last rows: salience's share of the W8A8 SigLIP-so400m encoder at 64 frames (synthetic weights).
"""

from __future__ import annotations

import torch

from csrc_triton.prefill_salience import prefill_salience
from scripts.benches import common
from tinyvila import ops

SHAPES = {"siglip1": (1, 16, 729, 72), "siglip8": (8, 16, 729, 72), "siglip64": (64, 16, 729, 72),
          "4k": (1, 16, 4096, 80), "16k": (1, 16, 16384, 80), "64k": (1, 16, 65536, 80)}
QUICK = ["siglip1", "siglip8", "siglip64", "4k"]
# (resident rows, streamed rows, num_warps, num_stages). Pass 1
# and 2 keep an (R, S) fp32 accumulator besides the (R, S) scores: 128 x 128 needs 8 warps.
SWEEP = [(128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
         (256, 64, 8, 3)]
NAIVE_MAX_BYTES = 40 << 30  # the materialised fp16 matrix plus its softmax must fit comfortably
GRAPH_MAX_MS = 1.0  # graph_ms only below this eager time: above it host launch time is a few % at most
LAUNCH_ROWS_MAX_FLOPS = 1e10  # launcher comparison rows at shapes whose QK^T pass is at most this (1-8 frames)


def naive(q, k):
    """What a user writes: materialise the attention, softmax, mean over rows and heads."""
    s = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)  # (B, H, N, N)
    return s.float().mean(dim=(1, 2))


def _peak_mib(fn, args) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*args)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _skipped(e: Exception, what: str = "skipped") -> None:
    print(f"  {what}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    torch.cuda.empty_cache()


def _time(fn, inputs, iters):
    """(eager ms, device ms, graph ms, peak MiB), medians; Nones when it runs out of memory or does not
    compile. eager: events around each call, the host's launch time inside (what an uncaptured call
    costs); device: the same behind a GPU spin of 2x the eager time, 0.2-2 ms (common.device_ms), so
    the host has queued the whole call first; graph: per call from replays of a CUDA graph of
    back-to-back calls (common.graph_ms), only below GRAPH_MAX_MS eager and where it can be captured."""
    try:
        ms = common.bench(fn, inputs, warmup=2, iters=iters)
        dev = common.device_ms(fn, inputs, ms, iters=iters)
        mib = _peak_mib(fn, inputs[0])
    except Exception as e:  # noqa: BLE001 - one failing config must not hide the other rows
        _skipped(e)
        return None, None, None, None
    graph = None
    if ms < GRAPH_MAX_MS:
        try:
            graph = common.graph_ms(fn, inputs)
        except Exception as e:  # noqa: BLE001 - e.g. a method that synchronises cannot be captured
            _skipped(e, "graph capture failed")
    return ms, dev, graph, mib


def _triton_dispatch(q, k, lse):
    """Ours standalone with every launch through Triton's dispatch (plans kept, no direct launch)."""
    return prefill_salience(q, k, direct=False)


def _methods(fc, launch_rows: bool):
    out = [("naive torch", lambda q, k, lse: naive(q, k))]
    if fc is not None:
        out += [("naive_colreduce", lambda q, k, lse: fc.naive_colreduce(q, k, "mean").float().mean(1)),
                ("flash-colreduce", lambda q, k, lse: fc.flash_colreduce(q, k, "mean").float().mean(1))]
    out += [("ours standalone", lambda q, k, lse: prefill_salience(q, k)),
            ("ours fused (lse given)", lambda q, k, lse: prefill_salience(q, k, lse=lse))]
    if launch_rows:  # the same kernels, more host work per call: the direct launch's share of the eager time
        out += [("ours standalone, Triton dispatch", _triton_dispatch)]
    return out


def _inputs(B, H, N, D, quick):
    """Input sets (q, k, flash attention's LSE) rotated so that together they exceed L2."""
    n_sets = 1 if quick else common.n_copies(2 * B * H * N * D * 2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = []
    for _ in range(n_sets):
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=gen) for _ in "qkv")
        sets.append((q, k, ops.attention_with_lse(q, k, v)[1]))
        del v
    return sets


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _sweep_configs(spec: str | None) -> list[tuple[int, int, int, int]]:
    """Tile configs: --salience-sweep "R,S,W,P;..." or SWEEP."""
    return [tuple(int(x) for x in c.split(",")) for c in spec.split(";") if c.strip()] if spec else SWEEP


def _sweep(inputs, iters, configs) -> dict:
    """_time of every tile config, standalone and fused, keyed by a printable name."""
    out = {}
    for fused in (False, True):
        for tiles in configs:
            fn = lambda q, k, lse, t=tiles, u=fused: prefill_salience(q, k, lse=lse if u else None, tiles=t)  # noqa: E731
            out[f"sweep {'fused' if fused else 'standalone'} {','.join(map(str, tiles))}"] = _time(fn, inputs, iters)
    return out


def _shape_rows(B, H, N, D, fc, quick, sweep: list | None) -> list[dict]:
    shape = f"B{B} H{H} N{N} D{D}"
    flops1 = 2 * B * H * N * N * D  # one QK^T pass
    inputs = _inputs(B, H, N, D, quick)
    iters = 5 if quick or N >= 65536 else (10 if N >= 16384 else 30)
    ref = prefill_salience(*inputs[0][:2]).double()
    small = B * H * N * N * 4 <= NAIVE_MAX_BYTES  # an fp32 reference fits
    results = {}  # name: (eager ms, device ms, graph ms, peak MiB, max error)
    for name, fn in _methods(fc, flops1 <= LAUNCH_ROWS_MAX_FLOPS):
        if name.startswith("naive") and 2 * B * H * N * N * 2 > NAIVE_MAX_BYTES:
            results[name] = (None,) * 5
            continue
        times = _time(fn, inputs, iters)
        err = (fn(*inputs[0]).double() - ref).abs().max().item() if times[0] is not None and small else None
        results[name] = (*times, err)
    results["flash attention + LSE"] = (*_time(lambda q, k, lse: ops.attention_with_lse(q, k, k), inputs, iters), None)
    for key, times in (_sweep(inputs, iters, sweep) if sweep and not quick else {}).items():
        results[key] = (*times, None)
    rows = []
    for name, (ms, dev, graph, mib, err) in results.items():
        passes = 1 if "fused" in name else 2  # the method's two QK^T passes (attention: QK^T and PV)
        rows.append(dict(shape=shape, method=name, ms=ms, dev_ms=dev, graph_ms=graph,
                         tflops=passes * flops1 / ms / 1e9 if ms else None,
                         x_naive=_ratio(results, "naive torch", 0, ms), x_fc=_ratio(results, "flash-colreduce", 0, ms),
                         x_naive_dev=_ratio(results, "naive torch", 1, dev),
                         x_nc_dev=_ratio(results, "naive_colreduce", 1, dev),
                         x_fc_dev=_ratio(results, "flash-colreduce", 1, dev), peak_mib=mib, max_err=err))
    return rows


def _ratio(results: dict, peer: str, col: int, ms: float | None) -> float | None:
    """How many times faster than `peer` (its eager (col 0) or device (col 1) ms over ms)."""
    theirs = results.get(peer, (None,) * 5)[col]
    return theirs / ms if theirs and ms else None


def _w8a8_encoder(cfg):
    """SigLIP-so400m W8A8 encoder (26 layers) on the GPU with random int8 weights and sane scales."""
    from tinyvila.vision import VisionEncoder

    with torch.device("cuda"):
        enc = VisionEncoder(cfg, "w8a8").half().eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, t in list(enc.named_parameters()) + list(enc.named_buffers()):
            if t.dtype == torch.int8:
                t.copy_(torch.randint(-127, 128, t.shape, device="cuda", generator=g, dtype=torch.int8))
            elif name.endswith("weight_scale"):
                t.fill_(0.02 / 127)  # ~N(0, 0.02)-sized weights after dequantization
            else:
                t.normal_(0, 0.02, generator=g)
                if "norm" in name and name.endswith("weight"):
                    t.add_(1.0)
    return enc


def _encoder_rows(quick) -> list[dict]:
    """Salience's added time on the W8A8 encoder: the fused column pass alone, and end to end
    (encoder with the salience layer's flash+LSE attention and the kernel, minus the plain encoder)."""
    from tinyvila.config import SIGLIP_SO400M

    cfg = SIGLIP_SO400M
    enc = _w8a8_encoder(cfg)
    B = 8 if quick else 64
    px = [(torch.randn(B, 3, cfg.image_size, cfg.image_size, device="cuda", dtype=torch.float16),)]
    last = cfg.n_run_layers - 1

    def with_salience(x):
        h, (q, k, lse) = enc.run_layers(enc.embed(x), qk_layer=last)
        return h, ops.prefill_salience(q, k, lse=lse)

    with torch.inference_mode():
        enc_ms = common.bench(enc, px, warmup=2, iters=5)
        both_ms = common.bench(with_salience, px, warmup=2, iters=5)
        _, (q, k, lse) = enc.run_layers(enc.embed(px[0][0]), qk_layer=last)
        col_ms = common.bench(lambda a, b, c: prefill_salience(a, b, lse=c), [(q, k, lse)], warmup=3, iters=20)
        col_dev = common.device_ms(lambda a, b, c: prefill_salience(a, b, lse=c), [(q, k, lse)], col_ms, iters=20)
    base = dict(x_naive=None, x_fc=None, peak_mib=None, max_err=None, tflops=None)
    print(f"  W8A8 encoder B{B}: {enc_ms:.2f} ms; with salience {both_ms:.2f} ms; column pass {col_ms:.3f} ms "
          f"(device {col_dev:.3f} ms)")
    return [dict(shape=f"encoder w8a8 B{B}", method="encoder alone", ms=enc_ms, **base),
            dict(shape=f"encoder w8a8 B{B}", method="salience column pass", ms=col_ms, dev_ms=col_dev, **base,
                 pct_encoder=100 * col_ms / enc_ms),
            dict(shape=f"encoder w8a8 B{B}", method="encoder + salience (fused)", ms=both_ms, **base,
                 pct_encoder=100 * (both_ms - enc_ms) / enc_ms)]


def add_args(p) -> None:
    p.add_argument("--salience-shapes", type=_names, metavar="NAMES",
                   help=f"comma-separated, from {','.join(SHAPES)} (default: all; --quick: {','.join(QUICK)})")
    p.add_argument("--salience-sweep-shapes", type=_names, metavar="NAMES",
                   help="the shapes that also get the tile sweep (default: all; '' none)")
    p.add_argument("--salience-sweep", metavar="R,S,W,P;...", help="the tile configs to sweep instead of SWEEP")
    p.add_argument("--salience-no-encoder", action="store_true", help="skip the W8A8 encoder rows")


def run(args) -> list[dict]:
    try:
        import flash_colreduce as fc
    except ImportError:
        fc = None
        print("flash-colreduce not installed: its rows are missing (pip install flash-colreduce)")
    quick = args.quick
    print("ms: eager (events around each call, host launch time inside); dev_ms: device time (a GPU spin "
          "queued first hides the host); graph_ms: per call in a CUDA graph (eager < 1 ms only); x_*: times "
          "faster than naive torch / naive_colreduce (nc) / flash-colreduce (fc), eager or _dev")
    names = args.salience_shapes if args.salience_shapes is not None else QUICK if quick else list(SHAPES)
    swept = set(args.salience_sweep_shapes if args.salience_sweep_shapes is not None else SHAPES)
    configs = _sweep_configs(args.salience_sweep)
    rows = []
    for name in names:
        rows += _shape_rows(*SHAPES[name], fc, quick, configs if name in swept else None)
        torch.cuda.empty_cache()
    mm = common.matmul_tflops(torch.float16)
    for r in rows:
        r["pct_mm"] = 100 * r["tflops"] / mm if r.get("tflops") else None
        r["pct_encoder"] = None
    try:
        for r in ([] if args.salience_no_encoder else _encoder_rows(quick)):
            rows.append({**r, "pct_mm": None, "pct_encoder": r.get("pct_encoder")})
    except Exception as e:  # noqa: BLE001 - the kernel rows above still count
        print(f"encoder rows failed: {type(e).__name__}: {e}")
    return rows
