"""Prefill salience (SparseVILA column-reduce) against naive PyTorch and the public flash-colreduce, fp16.

    PYTHONPATH=. python scripts/bench_kernels.py --only prefill_salience [--quick]   (needs `flash-colreduce`)

Environment (all optional): SALIENCE_SHAPES, a comma list of siglip1,siglip8,siglip64,4k,16k,64k
(default all); SALIENCE_SWEEP_SHAPES, the shapes that also get the tile sweep (default all; "" none);
SALIENCE_SWEEP, configs "R,S,W,P;R,S,W,P;..." to sweep instead of SWEEP; SALIENCE_ENCODER=0 skips the
W8A8 encoder rows; SALIENCE_MAXNREG=0 lifts the default tiles' register caps (MAXNREG). The sweep prints a
row per config (standalone = both passes, fused = the column pass alone; their difference is pass 1). The
issue-5 comparison in one command (~2 min):
    SALIENCE_SHAPES=siglip1,siglip8,siglip64,4k,16k SALIENCE_SWEEP_SHAPES= SALIENCE_ENCODER=0 \
    PYTHONPATH=. python scripts/bench_kernels.py --only prefill_salience
Three times per method: ms (eager: events around each call, so host launch time is inside; at 1
frame that is most of it), dev_ms (device: a GPU spin of 2x the eager time, 0.2-2 ms, queued before
each call hides the host) and graph_ms (per call replayed from a CUDA graph, eager < 1 ms only); x_*
ratios of each. At 1-8 frames two more rows time our standalone call with the launcher's older host
work: every launch through Triton's dispatch, and the plan rebuilt per call as well (the S5 launcher).
Offline (no GPU): `PYTHONPATH=.:scripts python scripts/benches/prefill_salience.py --offline [D]` compiles
both passes for sm_90a at DEFAULT_TILES and prints, per score in the main loop, SASS / MUFU / FMA-pipe /
ALU instructions, registers, spills, and the issue/pipe bound.
`... prefill_salience.py --host` times the launcher's host side per call on the CPU (Triton's dispatch
included, the C launch stubbed) for the three launcher forms.

Shapes of issue 5: SigLIP (H=16, N=729, D=72) at 1/8/64 frames, long sequences (H=16, D=80) at
N=4K/16K/64K (--quick: up to 4K, no sweep). Rows: naive (softmax(QK^T) materialised, then the mean;
and flash_colreduce's naive_colreduce), flash-colreduce, ours standalone (LSE pass + column pass),
ours fused (the salience layer's flash attention already gave the LSE: column pass only, the
encoder's real cost), each at DEFAULT_TILES and at every config of a tile sweep; and the
flash attention (+LSE) itself for scale. TFLOP/s counts the QK^T passes run (2 standalone, 1 fused).
Last rows: salience's share of the W8A8 SigLIP-so400m encoder at 64 frames (synthetic weights).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch

from benches import common
import csrc_triton.launch as launch_module
import csrc_triton.prefill_salience as kernel_module
from csrc_triton.prefill_salience import prefill_salience
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
    launch_module.DIRECT_LAUNCH = False
    try:
        return prefill_salience(q, k)
    finally:
        launch_module.DIRECT_LAUNCH = True


def _plan_per_call(q, k, lse):
    """Ours standalone doing the S5 launcher's host work: plan built and Triton's dispatch every call."""
    kernel_module._PLANS.clear()
    return prefill_salience(q, k)


def _methods(fc, launch_rows: bool):
    out = [("naive torch", lambda q, k, lse: naive(q, k))]
    if fc is not None:
        out += [("naive_colreduce", lambda q, k, lse: fc.naive_colreduce(q, k, "mean").float().mean(1)),
                ("flash-colreduce", lambda q, k, lse: fc.flash_colreduce(q, k, "mean").float().mean(1))]
    out += [("ours standalone", lambda q, k, lse: prefill_salience(q, k)),
            ("ours fused (lse given)", lambda q, k, lse: prefill_salience(q, k, lse=lse))]
    if launch_rows:  # the same kernels, more host work per call: the launcher's share of the eager time
        out += [("ours standalone, Triton dispatch", _triton_dispatch),
                ("ours standalone, plan per call (S5 launcher)", _plan_per_call)]
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


def _env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    return default if value is None else [v.strip() for v in value.split(",") if v.strip()]


def _sweep_configs() -> list[tuple[int, int, int, int]]:
    """Tile configs: SALIENCE_SWEEP or SWEEP."""
    spec = os.environ.get("SALIENCE_SWEEP")
    return [tuple(int(x) for x in c.split(",")) for c in spec.split(";") if c.strip()] if spec else SWEEP


def _sweep(inputs, iters) -> dict:
    """_time of every tile config, standalone and fused, keyed by a printable name."""
    out = {}
    for fused in (False, True):
        for tiles in _sweep_configs():
            fn = lambda q, k, lse, t=tiles, u=fused: prefill_salience(q, k, lse=lse if u else None, tiles=t)  # noqa: E731
            out[f"sweep {'fused' if fused else 'standalone'} {','.join(map(str, tiles))}"] = _time(fn, inputs, iters)
    return out


def _shape_rows(B, H, N, D, fc, quick, sweep) -> list[dict]:
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
    for key, times in (_sweep(inputs, iters) if sweep and not quick else {}).items():
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


def run(args) -> list[dict]:
    try:
        import flash_colreduce as fc
    except ImportError:
        fc = None
        print("flash-colreduce not installed: its rows are missing (pip install flash-colreduce)")
    quick = getattr(args, "quick", False)
    if os.environ.get("SALIENCE_MAXNREG") == "0":
        kernel_module.MAXNREG = None
    print("ms: eager (events around each call, host launch time inside); dev_ms: device time (a GPU spin "
          "queued first hides the host); graph_ms: per call in a CUDA graph (eager < 1 ms only); x_*: times "
          "faster than naive torch / naive_colreduce (nc) / flash-colreduce (fc), eager or _dev")
    names = _env_list("SALIENCE_SHAPES", QUICK if quick else list(SHAPES))
    swept = set(_env_list("SALIENCE_SWEEP_SHAPES", list(SHAPES)))
    rows = []
    for name in names:
        rows += _shape_rows(*SHAPES[name], fc, quick, name in swept)
        torch.cuda.empty_cache()
    mm = common.matmul_tflops(torch.float16)
    for r in rows:
        r["pct_mm"] = 100 * r["tflops"] / mm if r.get("tflops") else None
        r["pct_encoder"] = None
    try:
        for r in (_encoder_rows(quick) if os.environ.get("SALIENCE_ENCODER", "1") != "0" else []):
            rows.append({**r, "pct_mm": None, "pct_encoder": r.get("pct_encoder")})
    except Exception as e:  # noqa: BLE001 - the kernel rows above still count
        print(f"encoder rows failed: {type(e).__name__}: {e}")
    return rows


FMA_PIPE = ("FFMA", "FADD", "FMUL", "IMAD")
ALU_PIPE = ("FMNMX", "FSEL", "FSETP", "LOP3", "IADD3", "SHF", "LEA", "ISETP", "SEL", "PRMT", "IMNMX")


def _compile_sm90(which: int, D: int, extra: dict, maxnreg: int | None):
    """One pass compiled for sm_90a with the 16K launch's specialisations (16-divisible ints, ALIGN 8)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    km = kernel_module
    fn = km._row_lse_kernel if which == 1 else km._prefill_salience_kernel
    n_ptr, n_int = (3, 9) if which == 1 else (4, 11)
    n_fp = 1 if which == 1 else 2
    names = fn.arg_names
    sig = dict(zip(names, ["*fp16", "*fp16"] + ["*fp32"] * (n_ptr - 2) + ["i32"] * n_int + ["fp32"] * n_fp))
    stride_m = names.index("sqm"), names.index("skn")  # D / 8: not a multiple of 16
    div = [i for i in range(n_ptr + n_int) if i not in stride_m]
    d0, d1 = km._split_head_dim(D)
    R, S, W, P = km.DEFAULT_TILES
    consts = dict(D=D, D0=d0, D1=d1, PRECISION="tf32", UPCAST=False, ALIGN=8, BLOCK_R=R, BLOCK_S=S)
    if which == 2:
        consts["NEG_LSE2"] = True  # pass 1's LSE, as a standalone call hands it over
    consts.update(extra)
    sig.update({n: "constexpr" for n in names if n not in sig})
    src = ASTSource(fn, sig, consts, {(i,): [["tt.divisibility", 16]] for i in div})
    opts = dict(num_warps=W, num_stages=P, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _sass_stats(kernel) -> dict:
    """Registers, spills and per-score instruction mix of the main loop (one thread: 64 scores): the first
    loop of the kernel (pass 1's unshifted sum; its running-max rerun comes after)."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True)
    ins, labels, loops = [], {}, []
    for line in sass.splitlines():
        if m := re.match(r"\s*\.(L_x_\d+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", line):
            ins.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip()))
    for i, text in enumerate(ins):
        if text.startswith("BRA") and (m := re.search(r"(L_x_\d+)", text)) and labels.get(m.group(1), i + 1) <= i:
            loops.append(ins[labels[m.group(1)]:i + 1])
    ops = Counter(t.split()[0].split(".")[0] for t in next(lp for lp in loops if len(lp) > 64))
    per = 128 * 64 / 128  # scores per thread per tile at DEFAULT_TILES
    out = dict(regs=int(re.search(r"REG:(\d+)", res.stdout).group(1)),
               spills=sum(t.startswith(("STL", "LDL")) for t in ins), sass=sum(ops.values()) / per,
               mufu=ops["MUFU"] / per, fma=sum(ops[k] for k in FMA_PIPE) / per, alu=sum(ops[k] for k in ALU_PIPE) / per)
    # cycles of one SM sub-partition per warp-wide score: MUFU 4 lanes/clk, ALU 16, FMA 32, issue 1 instr/clk
    out["bound"] = max(8 * out["mufu"], out["sass"], out["fma"], 2 * out["alu"])
    return out


def offline(D: int = 80) -> None:
    """The offline table: both passes of the default kernels at DEFAULT_TILES with their register caps."""
    print(f"sm_90a, D={D}, tiles {kernel_module.DEFAULT_TILES}; per score: SASS, MUFU, FMA-pipe, ALU in the main loop")
    print("pass | regs | spills | SASS | MUFU | FMA | ALU | bound (clk per warp-score)")
    caps = kernel_module.MAXNREG or (None, None)
    for which in (1, 2):
        st = _sass_stats(_compile_sm90(which, D, {}, caps[which - 1]))
        print(f"{which} | {st['regs']} | {st['spills']} | {st['sass']:.2f} | {st['mufu']:.3f} | {st['fma']:.2f} | "
              f"{st['alu']:.2f} | {st['bound']:.2f}")


def host(calls: int = 10000) -> None:
    """Host microseconds per prefill_salience call at 1 SigLIP frame, Triton's dispatch included and
    the C launch (cuLaunchKernelEx) stubbed, CPU tensors; its torch.empty / part.sum are CPU ops here."""
    import time

    from triton.runtime import driver
    from triton_stub import HostOnlyDriver, stub_compile  # scripts/triton_stub.py (scripts/ is on the path)

    km = kernel_module
    assert not km._INTERPRET, "run without TRITON_INTERPRET: the launcher's compiled-kernel path is timed"
    saved = driver._active
    driver.set_active(HostOnlyDriver())
    for fn in (km._row_lse_kernel, km._prefill_salience_kernel):
        stub_compile(fn, lambda *args: None)  # the C launch does nothing
    q, k = (torch.randn(1, 16, 729, 72, dtype=torch.float16) for _ in "qk")
    lse = torch.randn(1, 16, 729)
    calls_by_mode = {"standalone": lambda: prefill_salience(q, k), "fused": lambda: prefill_salience(q, k, lse=lse)}
    modes = {"plan rebuilt every call (the S5 launcher's work)": (True, False),
             "plan cached, Triton dispatch": (False, False), "plan cached, direct launch": (False, True)}

    def us(fn, rebuild):
        for _ in range(200):
            fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            if rebuild:
                km._PLANS.clear()
            fn()
        return (time.perf_counter() - t0) / calls * 1e6

    print(f"host us per call, B1 H16 N729 D72 fp16, C launch stubbed, best of 5 x {calls} calls (CPU noise only adds)")
    print("launcher | " + " | ".join(calls_by_mode))
    try:
        for name, (rebuild, direct) in modes.items():
            launch_module.DIRECT_LAUNCH = direct
            row = [min(us(fn, rebuild) for _ in range(5)) for fn in calls_by_mode.values()]
            print(f"{name} | " + " | ".join(f"{t:.1f}" for t in row))
    finally:
        launch_module.DIRECT_LAUNCH = True
        driver.set_active(saved)
        for fn in (km._row_lse_kernel, km._prefill_salience_kernel):
            del fn._do_compile
            fn.device_caches.clear()
    part = torch.empty(1, 16, 729)
    print(f"for scale (CPU tensors): part.sum(1) {us(lambda: part.sum(1), False):.1f} us, "
          f"torch.empty {us(lambda: torch.empty(1, 16, 729), False):.1f} us")


if __name__ == "__main__" and "--offline" in sys.argv:
    offline(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 80)
elif __name__ == "__main__" and "--host" in sys.argv:
    host()
