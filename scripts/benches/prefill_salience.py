"""Prefill salience (SparseVILA column-reduce) against naive PyTorch and the public flash-colreduce, fp16.

    PYTHONPATH=. python scripts/bench_kernels.py --only prefill_salience      (needs `flash-colreduce`)

Shapes of issue 5: SigLIP (H=16, N=729, D=72) at 1/8/64 frames, long sequences (H=16, D=80) at
N=4K/16K/64K. Rows: naive (softmax(QK^T) materialised, then the mean; and flash_colreduce's own
naive_colreduce), flash-colreduce's kernel, ours standalone (LSE pass + column pass) at the default
tiles and at the best of a small tile sweep, and ours given the attention's LSE (column pass only:
its cost when fused with the salience layer's attention). TFLOP/s counts the two QK^T passes the
method needs (4*B*H*N^2*D; one pass for "lse given"); peak memory is the call's own allocation.
Last row: salience over the full fp16 SigLIP-so400m encoder time at 64 frames.
"""

from __future__ import annotations

import math

import torch

from benches import common
from csrc_triton.prefill_salience import prefill_salience

SIGLIP = [(1, 16, 729, 72), (8, 16, 729, 72), (64, 16, 729, 72)]
LONG = [(1, 16, 4096, 80), (1, 16, 16384, 80), (1, 16, 65536, 80)]
SWEEP = [(64, 64, 64), (64, 64, 128), (128, 64, 64), (128, 64, 128), (128, 128, 128), (128, 32, 128)]
NAIVE_MAX_BYTES = 40 << 30  # the materialised fp16 matrix plus its softmax must fit comfortably


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


def _time(fn, inputs, iters):
    try:
        return common.bench(fn, inputs, warmup=3, iters=iters), _peak_mib(fn, inputs[0])
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None


def _methods(fc):
    out = [("naive torch", naive)]
    if fc is not None:
        out += [("naive_colreduce", lambda q, k: fc.naive_colreduce(q, k, "mean").float().mean(1)),
                ("flash-colreduce", lambda q, k: fc.flash_colreduce(q, k, "mean").float().mean(1))]
    out.append(("ours", lambda q, k: prefill_salience(q, k)))
    return out


def _shape_rows(B, H, N, D, fc, quick) -> list[dict]:
    flops2 = 4 * B * H * N * N * D  # two QK^T passes
    per_set = 2 * B * H * N * D * 2
    n_sets = 1 if quick else common.n_copies(per_set)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [tuple(torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=gen) for _ in "qk")
              for _ in range(n_sets)]
    iters = 5 if quick else (10 if N >= 16384 else 50)
    ref = prefill_salience(*inputs[0])
    results, rows = {}, []
    for name, fn in _methods(fc):
        if name.startswith("naive") and 2 * B * H * N * N * 2 > NAIVE_MAX_BYTES:
            results[name] = (None, None)
            continue
        err = (fn(*inputs[0]) - ref).abs().max().item() if N * N * B * H * 4 <= NAIVE_MAX_BYTES else float("nan")
        results[name] = (*_time(fn, inputs, iters), err)
    # Tile sweep of ours, and the column pass alone when the attention's LSE is given.
    best = min(((_time(lambda q, k, b=b: prefill_salience(q, k, blocks=b), inputs, iters)[0], b)
                for b in ([] if quick else SWEEP)), default=(None, None), key=lambda t: t[0] or math.inf)
    # Timing only: the column pass does the same work whatever the normaliser's values are.
    lse_inputs = [(q, k, torch.full((B, H, N), math.log(N), device="cuda")) for q, k in inputs]
    results["ours, lse given"] = _time(lambda q, k, ls: prefill_salience(q, k, lse=ls), lse_inputs, iters)
    naive_ms = results["naive torch"][0]
    fc_ms = results.get("flash-colreduce", (None,))[0]
    for name, (ms, mib, *err) in results.items():
        fl = flops2 / 2 if "lse given" in name else flops2
        rows.append(dict(shape=f"B{B} H{H} N{N} D{D}", method=name, ms=ms, tflops=fl / ms / 1e9 if ms else None,
                         x_naive=naive_ms / ms if ms and naive_ms else None,
                         x_fc=fc_ms / ms if ms and fc_ms else None, peak_mib=mib,
                         max_err=err[0] if err else None))
    if best[0] is not None:
        rows.append(dict(shape=f"B{B} H{H} N{N} D{D}", method=f"ours best {best[1]}", ms=best[0],
                         tflops=flops2 / best[0] / 1e9, x_naive=naive_ms / best[0] if naive_ms else None,
                         x_fc=fc_ms / best[0] if fc_ms else None, peak_mib=None, max_err=None))
    return rows


def _encoder_overhead(quick) -> dict:
    """Salience time over the fp16 SigLIP-so400m encoder (26 layers) at 64 frames."""
    from tinyvila.config import SIGLIP_SO400M
    from tinyvila.vision import VisionEncoder

    cfg = SIGLIP_SO400M
    with torch.device("cuda"):
        enc = VisionEncoder(cfg).half()
    for p in enc.parameters():
        p.data.normal_(0, 0.02)
    B = 8 if quick else 64
    px = torch.randn(B, 3, cfg.image_size, cfg.image_size, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        enc_ms = common.bench(lambda x: enc(x), [(px,)], warmup=2, iters=5 if quick else 10)
        _, (q, k) = enc.run_layers(enc.embed(px), qk_layer=cfg.n_run_layers - 1)
        sal_ms = common.bench(lambda a, b: prefill_salience(a, b), [(q, k)], warmup=3, iters=20)
    return dict(shape=f"encoder fp16 B{B}", method="salience / encoder", ms=sal_ms, tflops=None,
                x_naive=None, x_fc=None, peak_mib=None, max_err=100 * sal_ms / enc_ms,
                note=f"encoder {enc_ms:.2f} ms; max_err column = overhead %")


def run(args) -> list[dict]:
    try:
        import flash_colreduce as fc
    except ImportError:
        fc = None
        print("flash-colreduce not installed: its rows are missing (pip install flash-colreduce)")
    quick = getattr(args, "quick", False)
    rows = []
    for shape in SIGLIP + (LONG[:1] if quick else LONG):
        rows += _shape_rows(*shape, fc, quick)
        torch.cuda.empty_cache()
    mm = common.matmul_tflops(torch.float16)
    for r in rows:
        r["pct_mm"] = 100 * r["tflops"] / mm if r.get("tflops") else None
    over = _encoder_overhead(quick)
    print(over["note"])
    over.pop("note")
    over["pct_mm"] = None
    rows.append(over)
    return rows
