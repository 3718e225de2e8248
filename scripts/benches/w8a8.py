"""W8A8 vision benchmarks at SigLIP-so400m shapes (729 tokens/image, width 1152, MLP 4304).

    python -m scripts.bench_kernels --only w8a8 [--quick]
    --w8a8-parts encoder,layer,gemm,rows   which parts run (default: those four; also: epi)
    --w8a8-images 1,8,64                   image counts of encoder/layer/gemm
    --w8a8-sweep 1,8   also sweeps the GEMM tile configs (TMA and pointer operands) at those image counts;
    --w8a8-row-sweep 8,64   the launch shapes of the int8-producing row kernels
    --w8a8-variants   times every persistent-kernel config (`_PERSISTENT_TILES`) beside the default at each
    GEMM shape, then (with "encoder") runs the encoder with, per layer shape, the variant fastest at the
    largest image count of --w8a8-encoder-images (default: the images) put in place of the default tiles.
    One command (~2 min on the H200):
    python -m scripts.bench_kernels --only w8a8 --w8a8-parts gemm,encoder --w8a8-variants --w8a8-encoder-images 8
    --w8a8-parts epi   the default kernel at its launcher tile with each epilogue split (EPI_SPLIT 1, 2, 4)
    against torch._int_mm, TOPS; wo and fc2 with the residual (as the ViT runs them) and without, qkv and
    fc1 without (~1-2 min on the H200).

GEMM rows: the Triton w8a8_gemm (int8 x int8 -> int32, fused scale/bias epilogue, fp16 out) in TOPS
against the measured int8 ceiling (the fastest of torch._int_mm, w8a8_gemm and its Gluon kernel's forms at
8192^3: ~1230 TOPS on an H200, which the ViT's ping-pong GEMMs reach 95-102% of), beside torch._int_mm alone (a lower
bound for any "_int_mm + epilogue" dispatch), _int_mm + a PyTorch epilogue, and fp16 cuBLAS. Kernel
times come from CUDA-graph replays of many calls (no host launch overhead in them; `triton_eager_ms`
keeps the per-call eager time). Encoder rows: the 26-layer SigLIP encoder (synthetic weights) in
fp16 and W8A8, CUDA-graph replays, vs HF transformers' SiglipVisionModel (27 layers, fp16, SDPA); W8A8 also
with the Triton GEMMs only (Options w8a8_wgmma off: the A/B of the Gluon GEMMs).
Layer rows: every op of one encoder layer timed alone (graph-replayed, inputs rotated past L2), summed
for W8A8 and fp16: where the time goes.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F

from scripts.benches import common
from tinyvila.options import Options, set_options

SHAPES = [(1152, 3456, "qkv"), (1152, 1152, "o"), (1152, 4304, "fc1"), (4304, 1152, "fc2")]  # (K, N, name)
TOKENS = 729


def sweep_configs() -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, TMA, EPI_SPLIT): the launcher's tiles with both
    operand paths, plus deeper pipelines and 4-warp 128x128."""
    from csrc_triton.w8a8_gemm import _TILES

    base = [(bm, bn, bk, w, st, tma, sp) for tma in (True, False) for bm, bn, bk, w, st, sp in _TILES]
    return base + [(128, 256, 128, 8, 4, True, 2), (128, 128, 128, 8, 5, True, 1), (128, 128, 128, 4, 4, True, 1)]


def _progress(row: dict) -> dict:
    """Echo a row to stderr as it is measured (a long run cut short still reports), and return it."""
    print("  ", {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, file=sys.stderr, flush=True)
    return row


def int8_tops_ceiling() -> float:
    """Measured int8 tensor-core ceiling, TOPS: the fastest of torch._int_mm (cuBLASLt), tinyvila's own
    w8a8_gemm and (sm_90, Triton 3.6) each form of its Gluon kernel at 8192^3. (On an H200 _int_mm ran 907 TOPS
    and w8a8_gemm 1257: cuBLAS's int8 kernels are not the chip's int8 rate, so taking them alone made the ceiling
    ~28% too low. The Gluon ping-pong form ran 1328 TOPS at the ViT's qkv shape, above that ceiling, while
    w8a8_gemm at 8192^3 still runs the Triton kernel: K > PINGPONG_MAX_K, no residual.)"""
    import csrc_triton.w8a8_gemm as wg

    n = 8192
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda")
    sa, sb = torch.ones(n, device="cuda"), torch.ones(n, device="cuda")
    calls = [lambda: torch._int_mm(a, b.t()), lambda: wg.w8a8_gemm(a, b, sa, sb)]
    if wg._wgmma_ok(a, b, torch.empty(n, n, dtype=torch.float16, device="cuda"), None):
        from csrc_triton.w8a8_gemm_wgmma import w8a8_gemm_wgmma

        calls += [lambda kw=kw: w8a8_gemm_wgmma(a, b, sa, sb, **kw)
                  for kw in ({"pingpong": True}, {"tile": (256, 128, 128, 8, 3)}, {})]
    ms = min(common.bench(f, [()], warmup=5, iters=20) for f in calls)
    return 2 * n**3 / ms / 1e9


def _sets(M: int, K: int, N: int) -> list:
    per_set = M * K * 3 + N * K * 3  # int8 + fp16 operands
    sets = []
    for _ in range(common.n_copies(per_set)):
        sets.append((torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda"),
                     torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda"),
                     torch.rand(M, device="cuda") * 0.01, torch.rand(N, device="cuda") * 1e-3,
                     torch.randn(N, device="cuda", dtype=torch.float16),
                     torch.randn(M, K, device="cuda", dtype=torch.float16),
                     torch.randn(N, K, device="cuda", dtype=torch.float16)))
    return sets


def _sweep(sets, ops: float, label: str) -> list[dict]:
    from csrc_triton.w8a8_gemm import w8a8_gemm

    rows = []
    for bm, bn, bk, warps, stages, tma, split in sweep_configs():
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages, TMA=tma,
                   EPI_SPLIT=split)
        name = f"{bm}x{bn}x{bk} w{warps} s{stages} epi{split} {'tma' if tma else 'ptr'}"
        try:
            ms = common.graph_ms(lambda a, b, sa, sb, bias, *_, cfg=cfg: w8a8_gemm(a, b, sa, sb, bias, config=cfg),
                          sets)
        except Exception as e:  # a config that does not compile or fit is a row, not a crash
            rows.append(_progress({"case": f"sweep {label} {name}", "note": f"{type(e).__name__}: {e}"[:80]}))
            continue
        rows.append(_progress({"case": f"sweep {label} {name}", "triton_ms": ms, "triton_tops": ops / ms}))
    best = min((r for r in rows if "triton_ms" in r), key=lambda r: r["triton_ms"], default=None)
    if best is not None:
        rows.append({"case": f"sweep {label} BEST = {best['case'].split(label)[1].strip()}",
                     "triton_ms": best["triton_ms"], "triton_tops": best["triton_tops"]})
    return rows


def _variant_rows(sets, ops: float, ceil_i8: float, label: str, t_default: float | None) -> tuple[list[dict], dict]:
    """Every persistent-kernel config at one GEMM shape: rows (ms, TOPS, % of the int8 ceiling, vs the
    default kernel) and {"cfg", "ms"} of the fastest (empty when none ran)."""
    from csrc_triton.w8a8_gemm import _PERSISTENT_TILES, persistent_config, w8a8_gemm

    rows, best = [], {}
    for t in _PERSISTENT_TILES:
        cfg = persistent_config(t)
        name = "persist {}x{}x{} w{} s{} epi{}{}".format(*t[:6], " flat" if t[6] else "")
        row = {"case": f"variant {label} {name}"}
        try:
            ms = common.graph_ms(lambda a, b, sa, sb, bias, *_, cfg=cfg: w8a8_gemm(a, b, sa, sb, bias, config=cfg), sets)
        except Exception as e:  # a config that does not compile or fit is a row, not a crash
            row["note"] = f"{type(e).__name__}: {e}"[:80]
            rows.append(_progress(row))
            continue
        if ms is None:
            continue
        row.update(triton_ms=ms, triton_tops=ops / ms, pct_int8_ceil=100 * ops / ms / ceil_i8,
                   x_default=t_default / ms if t_default else None)
        rows.append(_progress(row))
        if not best or ms < best["ms"]:
            best = {"cfg": cfg, "ms": ms, "name": name}
    return rows, best


def _gemm_rows(images: list[int], ceil_i8: float, ceil_f16: float, sweep: list[int],
               variants: bool = False) -> tuple[list[dict], dict]:
    """GEMM rows at each image count and layer shape; with `variants`, the persistent configs too, and
    {(M, N, K): config} of the variants faster than the default kernel."""
    from csrc_triton.w8a8_gemm import _config, w8a8_gemm

    rows, faster = [], {}
    for n_img in images:
        M = TOKENS * n_img
        for K, N, name in SHAPES:
            sets = _sets(M, K, N)
            ops = 2 * M * N * K / 1e9
            tri = lambda a, b, sa, sb, bias, *_: w8a8_gemm(a, b, sa, sb, bias)  # noqa: E731
            t_tri = common.graph_ms(tri, sets)
            t_intmm = common.graph_ms(lambda a, b, *_: torch._int_mm(a, b.t()), sets)
            t_intmm_epi = common.graph_ms(lambda a, b, sa, sb, bias, *_: (torch._int_mm(a, b.t()).float() * sa[:, None]
                                                                    * sb[None, :] + bias).half(), sets)
            t_f16 = common.graph_ms(lambda *s: F.linear(s[5], s[6], s[4]), sets)
            cfg = _config(M, N, K, sets[0][0].device)
            rows.append(_progress({"case": f"gemm {name} M={M} K={K} N={N}", "triton_ms": t_tri,
                         "triton_tops": ops / t_tri, "pct_int8_ceil": 100 * ops / t_tri / ceil_i8,
                         "triton_eager_ms": common.bench(tri, sets), "int_mm_ms": t_intmm,
                         "int_mm_tops": ops / t_intmm, "int_mm+epi_ms": t_intmm_epi, "fp16_ms": t_f16,
                         "fp16_tflops": ops / t_f16, "speedup_vs_fp16": t_f16 / t_tri,
                         "note": "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages} epi{EPI_SPLIT}".format(**cfg)}))
            if variants:
                v_rows, best = _variant_rows(sets, ops, ceil_i8, f"{name} M={M}", t_tri)
                rows += v_rows
                if best and t_tri and best["ms"] < t_tri:
                    faster[(M, N, K)] = best["cfg"]
                    rows.append(_progress({"case": f"variant {name} M={M} BEST = {best['name']}",
                                           "triton_ms": best["ms"], "triton_tops": ops / best["ms"],
                                           "x_default": t_tri / best["ms"]}))
            if n_img in sweep:
                rows += _sweep(sets, ops, f"{name} M={M}")
            del sets
    return rows, faster


# The ViT's GEMMs for the epilogue-split comparison: (K, N, name, with residual). wo ("o") and fc2 add the
# skip connection in their epilogue (the case that spilled at 128 x 256); their no-residual rows and qkv /
# fc1 check that the split does not slow the plain epilogue.
EPI_CASES = [(1152, 3456, "qkv", False), (1152, 1152, "o", True), (1152, 1152, "o", False),
             (1152, 4304, "fc1", False), (4304, 1152, "fc2", True), (4304, 1152, "fc2", False)]


def _epi_sets(M: int, K: int, N: int) -> list:
    """Input sets (a, b, a_scale, b_scale, bias, residual) rotated past L2."""
    per_set = M * K + N * K + 4 * M * N  # int8 operands, fp16 residual and output
    return [(torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda"),
             torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda"),
             torch.rand(M, device="cuda") * 0.01, torch.rand(N, device="cuda") * 1e-3,
             torch.randn(N, device="cuda", dtype=torch.float16), torch.randn(M, N, device="cuda", dtype=torch.float16))
            for _ in range(common.n_copies(per_set))]


def _epi_rows(images: list[int], ceil_i8: float) -> list[dict]:
    """The default kernel at the launcher's tile with each EPI_SPLIT (1: the unsplit epilogue), in TOPS,
    beside torch._int_mm (int32 out, no epilogue: what cuBLASLt's int8 GEMM alone takes). x_epi1: speedup
    over EPI_SPLIT 1; same_bits: the split's output equals EPI_SPLIT 1's bit for bit (same fp32 op order)."""
    from csrc_triton.w8a8_gemm import _config, w8a8_gemm

    rows = []
    for n_img in images:
        M = TOKENS * n_img
        for K, N, name, with_res in EPI_CASES:
            sets = _epi_sets(M, K, N)
            ops = 2 * M * N * K / 1e9
            label = f"epi {name}{'+res' if with_res else ''} M={M} K={K} N={N}"
            t_intmm = common.graph_ms(lambda a, b, *_: torch._int_mm(a, b.t()), sets)
            rows.append(_progress({"case": f"{label} int_mm", "triton_ms": t_intmm, "triton_tops": ops / t_intmm,
                                   "pct_int8_ceil": 100 * ops / t_intmm / ceil_i8}))
            base = _config(M, N, K, sets[0][0].device)
            first, t_first = None, None
            for split in (1, 2, 4):
                cfg = dict(base, EPI_SPLIT=split)
                fn = lambda a, b, sa, sb, bias, res, cfg=cfg, r=with_res: w8a8_gemm(  # noqa: E731
                    a, b, sa, sb, bias, residual=res if r else None, config=cfg)
                t = common.graph_ms(fn, sets)
                out = fn(*sets[0])
                first = out if first is None else first
                t_first = t if t_first is None else t_first
                tile = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**cfg)
                rows.append(_progress({
                    "case": f"{label} triton epi{split}", "triton_ms": t, "triton_tops": ops / t if t else None,
                    "pct_int8_ceil": 100 * ops / t / ceil_i8 if t else None,
                    "x_int_mm": t_intmm / t if t and t_intmm else None, "x_epi1": t_first / t if t and t_first else None,
                    "same_bits": bool(torch.equal(out, first)),
                    "note": tile + (" (default)" if split == base["EPI_SPLIT"] else "")}))
            del sets
    return rows


# (rows per program, num_warps, SPLIT) of the row kernels: one warp per row (no cross-warp reductions)
# up to 8; SPLIT: a row as a power-of-two head + tail block (True) or one padded block (False).
# (1, 4, False) is the launch before the head + tail change (the best of the sweep before it).
ROW_SWEEP = [(1, 1, True), (2, 1, True), (1, 2, True), (2, 2, True), (4, 4, True), (1, 4, True), (1, 1, False),
             (1, 2, False), (1, 4, False), (2, 4, False), (1, 8, False)]


def _quant_rows(images: list[int], sweep: list[int]) -> list[dict]:
    """The producers of int8 activations, in GB/s (bytes in + out) against the copy ceiling, beside
    the fp16 op each replaces (F.layer_norm, F.gelu tanh, a copy)."""
    from csrc_triton.gelu_quant import gelu_quant
    from csrc_triton.layer_norm_quant import layer_norm_quant
    from csrc_triton.quant_per_token import quant_per_token

    ceil = common.copy_bandwidth_gbs()
    kernels = {  # name: (K, kernel(x, w, b, meta), fp16 op it replaces)
        "layer_norm_quant": (1152, lambda x, w, b, meta=None: layer_norm_quant(x, w, b, 1e-6, meta=meta),
                             lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-6)),
        "gelu_quant": (4304, lambda x, w, b, meta=None: gelu_quant(x, "gelu_tanh", meta=meta),
                       lambda x, *_: F.gelu(x, approximate="tanh")),
        "quant_per_token": (1152, lambda x, w, b, meta=None: quant_per_token(x, meta=meta), lambda x, *_: x.clone()),
    }
    rows = []
    for n_img in images:
        M = TOKENS * n_img
        for name, (K, fused, plain) in kernels.items():
            sets = [(torch.randn(M, K, device="cuda", dtype=torch.float16),
                     (torch.rand(K, device="cuda") + 0.5).half(), torch.randn(K, device="cuda").half())
                    for _ in range(common.n_copies(3 * M * K))]
            t, t_plain = common.graph_ms(fused, sets), common.graph_ms(plain, sets)
            gbs = (3 * M * K + 4 * M) / t / 1e6  # fp16 in, int8 + fp32 scale out
            rows.append(_progress({"case": f"{name} M={M} K={K}", "triton_ms": t, "gbs": gbs,
                                   "pct_copy_bw": 100 * gbs / ceil, "fp16_op_ms": t_plain}))
            for rows_, warps, split in (ROW_SWEEP if n_img in sweep else ()):
                meta = dict(ROWS=rows_, num_warps=warps, SPLIT=split)
                t = common.graph_ms(lambda x, w, b, meta=meta, f=fused: f(x, w, b, meta=meta), sets)
                gbs = (3 * M * K + 4 * M) / t / 1e6
                rows.append(_progress({"case": f"sweep {name} M={M} rows={rows_} warps={warps} split={split}",
                                       "triton_ms": t, "gbs": gbs, "pct_copy_bw": 100 * gbs / ceil}))
            del sets
    return rows


def _encoders(opts: Options | None = None):
    """(fp16 dense, W8A8) synthetic SigLIP-so400m encoders (layer -2: 26 layers) on the GPU, running under `opts`
    (default: Options.from_env())."""
    from tinyvila.config import SIGLIP_SO400M
    from tinyvila.convert.smoothquant import w8a8_state_dict
    from tinyvila.vision import VisionEncoder

    g = torch.Generator().manual_seed(0)
    dense = VisionEncoder(SIGLIP_SO400M)
    with torch.no_grad():
        for name, p in dense.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    sd = w8a8_state_dict(copy.deepcopy(dense), torch.float16)
    with torch.device("meta"):
        q = VisionEncoder(SIGLIP_SO400M, "w8a8")
    q.load_state_dict({k.removeprefix("vision."): v for k, v in sd.items()}, assign=True, strict=True)
    for model in (dense, q):
        set_options(model, opts or Options.from_env())
    return dense.half().cuda().eval(), q.cuda().eval()


def _hf_siglip():
    """HF SiglipVisionModel fp16, SDPA attention, so400m shapes; None without transformers."""
    try:
        from transformers import SiglipVisionConfig, SiglipVisionModel
    except ImportError:
        return None
    cfg = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                             image_size=384, patch_size=14)
    return SiglipVisionModel._from_config(cfg, attn_implementation="sdpa").half().cuda().eval()


def _graphed(fn):
    from tinyvila.cuda_graph import GraphCache

    return GraphCache(fn)


class _ConfigOverride:
    """Call fn with `w8a8_gemm`'s tile choice replaced, for GEMMs of the (N, K) in `table`, by the
    table's config (a benchmark-only swap: the library default stays as it is)."""

    def __init__(self, fn, table: dict):
        self.fn, self.table = fn, table

    def __call__(self, *args):
        import csrc_triton.w8a8_gemm as wg

        default = wg._config
        wg._config = lambda M, N, K, dev: dict(self.table[(N, K)]) if (N, K) in self.table else default(M, N, K, dev)
        try:
            return self.fn(*args)
        finally:
            wg._config = default

    def clear(self):
        self.fn.clear()


class _Under:
    """Call fn with `model` running under `opts`, then under `base` again: a callable for the benches' graph
    caches, whose graphs then hold the kernels those options pick (tinyvila.options.set_options)."""

    def __init__(self, fn, model, opts: Options, base: Options):
        self.fn, self.model, self.opts, self.base = fn, model, opts, base

    def __call__(self, *args):
        set_options(self.model, self.opts)
        try:
            return self.fn(*args)
        finally:
            set_options(self.model, self.base)

    def clear(self):
        if hasattr(self.fn, "clear"):
            self.fn.clear()


@torch.no_grad()
def _encoder_rows(images: list[int], iters: int, variant: dict | None = None) -> list[dict]:
    """Whole-encoder medians (ms), one row per model and image count: fp16 and HF eager and CUDA-graph
    replayed, W8A8 graph-replayed with its speedup over fp16 (graph) and HF (eager, graph); with
    `variant` ({(N, K): config}) also W8A8 with those GEMM configs in place; then the W8A8 features'
    cosine vs fp16's (and the variant's vs the default W8A8's)."""
    opts = Options.from_env()
    dense, q = _encoders(opts)
    hf, S = _hf_siglip(), q.cfg.image_size
    runs = {"fp16 eager": dense, "fp16 graph": _graphed(dense._forward)}
    if hf is not None:
        runs["hf_sdpa_fp16 eager"] = lambda px: hf(pixel_values=px).last_hidden_state
        runs["hf_sdpa_fp16 graph"] = _graphed(runs["hf_sdpa_fp16 eager"])
    w8a8 = _graphed(q._forward)
    w8a8_v = _ConfigOverride(_graphed(q._forward), variant) if variant else None
    w8a8_tri = _Under(_graphed(q._forward), q, opts.with_(w8a8_wgmma=False), opts)  # the Triton GEMMs only
    rows = []
    for n_img in images:
        sets = [(torch.randn(n_img, 3, S, S, device="cuda", dtype=torch.float16),) for _ in range(2)]
        base = {}
        for name, fn in runs.items():
            row = {"case": f"encoder x{n_img} {name}"}
            base[name] = row["ms"] = _time_or_note(row, fn, sets, iters)
            rows.append(_progress(row))
        row = {"case": f"encoder x{n_img} w8a8 graph"}
        row["ms"] = t = _time_or_note(row, w8a8, sets, iters)
        for key, ref in (("x_fp16_graph", "fp16 graph"), ("x_hf", "hf_sdpa_fp16 eager"),
                         ("x_hf_graph", "hf_sdpa_fp16 graph")):
            row[key] = base[ref] / t if t and base.get(ref) else None  # W8A8's speedup over it
        rows.append(_progress(row))
        trow = {"case": f"encoder x{n_img} w8a8 graph, Triton GEMMs only"}
        trow["ms"] = tt = _time_or_note(trow, w8a8_tri, sets, iters)
        trow["x_fp16_graph"] = base["fp16 graph"] / tt if tt and base.get("fp16 graph") else None
        trow["x_w8a8_default"] = tt / t if t and tt else None  # > 1: the Gluon GEMMs made the default faster
        rows.append(_progress(trow))
        if w8a8_v is not None:
            vrow = {"case": f"encoder x{n_img} w8a8 variant graph", "note": _variant_note(variant)}
            vrow["ms"] = tv = _time_or_note(vrow, w8a8_v, sets, iters)
            for key, ref in (("x_fp16_graph", "fp16 graph"), ("x_hf", "hf_sdpa_fp16 eager"),
                             ("x_hf_graph", "hf_sdpa_fp16 graph")):
                vrow[key] = base[ref] / tv if tv and base.get(ref) else None
            vrow["x_w8a8_default"] = t / tv if t and tv else None
            rows.append(_progress(vrow))
        del sets
        for fn in (*runs.values(), w8a8, w8a8_tri, *([w8a8_v] if w8a8_v else [])):
            if hasattr(fn, "clear"):
                fn.clear()  # free this batch size's graph pool before the next, larger one
        torch.cuda.empty_cache()
    # Accuracy sanity on the GPU path: W8A8 features vs the fp16 encoder's, same synthetic weights.
    px = torch.randn(2, 3, S, S, device="cuda", dtype=torch.float16)
    cos = F.cosine_similarity(q(px).float().flatten(1), dense(px).float().flatten(1), dim=-1).min().item()
    rows.append({"case": "encoder w8a8 vs fp16 features (synthetic weights)", "cos": cos})
    triton_only = _Under(q, q, opts.with_(w8a8_wgmma=False), opts)
    diff = (q(px).float() - triton_only(px).float()).abs().max().item()  # integer sums exact: epilogue FMAs only
    rows.append({"case": "encoder w8a8 x2, Gluon vs Triton GEMMs: max abs diff", "cos": diff})
    if variant:
        # Integer sums are exact: the variant may differ from the default only by epilogue FMA contraction.
        diff = (_ConfigOverride(q, variant)(px).float() - q(px).float()).abs().max().item()
        rows.append({"case": "encoder w8a8 variant vs default max abs diff", "cos": diff})
    return rows


def _variant_note(variant: dict) -> str:
    return "; ".join(f"N{n} K{k}: {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} s{c['num_stages']} epi{c['EPI_SPLIT']}"
                     f"{' flat' if c['FLATTEN'] else ''}" for (n, k), c in sorted(variant.items()))


def _time_or_note(row: dict, fn, sets: list, iters: int) -> float | None:
    """Median ms of fn over sets, or None with the error in row["note"] (one broken variant must not
    hide the others' numbers)."""
    try:
        return common.bench(fn, sets, warmup=3, iters=iters)
    except Exception as e:
        row["note"] = f"{type(e).__name__}: {e}"[:100]
        return None


def _layer_inputs(q, dense, n_img: int) -> dict:
    """One set of inputs for every op of a layer at n_img images, each computed by the op before
    (so shapes, layouts and value ranges are the encoder's)."""
    from tinyvila import ops
    from tinyvila.quant import QTensor

    blk, cfg = q.layers[0], q.cfg
    x = torch.randn(n_img, TOKENS, cfg.dim, device="cuda", dtype=torch.float16)
    xq = blk.norm1(x)
    qh, kh, vh = blk.attn.qkv(xq)
    o = ops.attention(qh, kh, vh, causal=False).transpose(1, 2).reshape(n_img, TOKENS, cfg.dim)
    hq = blk.norm2(x)
    h = blk.mlp.fc1(hq)
    return dict(x=x, xq=xq, q=qh, k=kh, v=vh, o=o, oq=QTensor(*ops.quant_per_token(o)),
                hq=hq, h=h, gq=QTensor(*ops.gelu_quant(h, cfg.act)),
                qkv16=dense.layers[0].attn.wqkv(x).view(n_img, TOKENS, 3, cfg.n_heads, cfg.head_dim),
                h16=dense.layers[0].mlp.fc1(x))


def _layer_steps(q, dense) -> dict:
    """op name -> fn(inputs) for one layer: the W8A8 layer's ops and the fp16 layer's."""
    from tinyvila import ops

    blk, dblk, act = q.layers[0], dense.layers[0], q.cfg.act
    ln = lambda d, m: F.layer_norm(d["x"], (d["x"].shape[-1],), m.weight, m.bias, m.eps)  # noqa: E731
    return {
        "ln_quant": lambda d: blk.norm1(d["x"]),
        "qkv": lambda d: blk.attn.wqkv(d["xq"]),
        "attention": lambda d: ops.attention(d["q"], d["k"], d["v"], causal=False),
        "wo_quant_kernel": lambda d: ops.quant_per_token(d["o"]),
        "wo_int8_gemm": lambda d: blk.attn.wo(d["oq"], d["x"]),
        "fc1": lambda d: blk.mlp.fc1(d["hq"]),
        "gelu_quant": lambda d: ops.gelu_quant(d["h"], act),
        "fc2_int8": lambda d: blk.mlp.fc2(d["gq"], d["x"]),
        "fp16_layer_norm": lambda d: ln(d, dblk.norm1),
        "fp16_qkv": lambda d: dblk.attn.wqkv(d["x"]),
        "fp16_attention": lambda d: ops.attention(*d["qkv16"].permute(2, 0, 3, 1, 4).unbind(0), causal=False),
        "fp16_wo_add": lambda d: dblk.attn.wo(d["x"]) + d["x"],
        "fp16_fc1": lambda d: dblk.mlp.fc1(d["x"]),
        "fp16_gelu": lambda d: ops.gelu(d["h16"], act),
        "fp16_fc2_add": lambda d: dblk.mlp.fc2(d["h16"]) + d["x"],
    }


# Per-layer op sums of the W8A8 and fp16 layers: op -> count (the two LayerNorms are the same op).
_LAYER_SUMS = {
    "w8a8": {"ln_quant": 2, "qkv": 1, "attention": 1, "wo_quant_kernel": 1, "wo_int8_gemm": 1, "fc1": 1,
             "gelu_quant": 1, "fc2_int8": 1},
    "fp16": {"fp16_layer_norm": 2, "fp16_qkv": 1, "fp16_attention": 1, "fp16_wo_add": 1, "fp16_fc1": 1,
             "fp16_gelu": 1, "fp16_fc2_add": 1},
}


@torch.no_grad()
def _layer_rows(images: list[int], models=None) -> list[dict]:
    """Every op of one so400m layer timed alone (graph-replayed, input sets rotated past L2), then
    the W8A8 and fp16 per-layer sums and x26 (the encoder's layers; the graph run adds only the embedding)."""
    dense, q = models or _encoders()
    steps = _layer_steps(q, dense)
    rows = []
    for n_img in images:
        per_set = 2 * TOKENS * n_img * (4 * 1152 + 3 * 4304)  # bytes of the main activations of one set
        sets = [(_layer_inputs(q, dense, n_img),) for _ in range(common.n_copies(per_set))]
        times = {}
        for name, fn in steps.items():
            try:
                times[name] = common.graph_ms(fn, sets, calls=6, iters=8)
            except Exception as e:
                rows.append(_progress({"case": f"layer x{n_img} {name}", "note": f"{type(e).__name__}: {e}"[:100]}))
                continue
            rows.append(_progress({"case": f"layer x{n_img} {name}", "ms": times[name]}))
        for variant, counts in _LAYER_SUMS.items():
            if all(op in times for op in counts):
                total = sum(times[op] * c for op, c in counts.items())
                rows.append(_progress({"case": f"layer x{n_img} SUM {variant}", "ms": total,
                                       "x_layers_ms": len(q.layers) * total}))
        del sets
        torch.cuda.empty_cache()
    return rows


def add_args(p) -> None:
    p.add_argument("--w8a8-parts", default="encoder,layer,gemm,rows",
                   help="comma-separated, from encoder, layer, gemm, rows, epi")
    p.add_argument("--w8a8-images", type=common.ints, metavar="N,...",
                   help="image counts of the encoder, layer and GEMM rows (default 1,8,64; --quick 1,8)")
    p.add_argument("--w8a8-sweep", type=common.ints, default=[], metavar="N,...",
                   help="image counts at which the GEMM tile configs are swept too")
    p.add_argument("--w8a8-row-sweep", type=common.ints, default=[], metavar="N,...",
                   help="image counts at which the row kernels' launch shapes are swept too")
    p.add_argument("--w8a8-variants", action="store_true",
                   help="time every persistent-kernel config, and the encoder with the fastest in place")
    p.add_argument("--w8a8-encoder-images", type=common.ints, metavar="N,...",
                   help="image counts of the encoder rows (default: --w8a8-images)")


def run(args) -> list[dict]:
    quick = args.quick
    parts = args.w8a8_parts.split(",")
    images = args.w8a8_images or ([1, 8] if quick else [1, 8, 64])
    sweep, row_sweep, variants = args.w8a8_sweep, args.w8a8_row_sweep, args.w8a8_variants
    enc_images = args.w8a8_encoder_images or images
    rows, best = [], {}
    if "gemm" in parts:
        ceil_i8, ceil_f16 = int8_tops_ceiling(), common.matmul_tflops(torch.float16)
        rows += [{"case": "ceiling int8 8192^3, fastest of _int_mm and w8a8_gemm's kernels (TOPS)", "triton_tops": ceil_i8},
                 {"case": "ceiling fp16 matmul 8192^3 (TFLOP/s)", "fp16_tflops": ceil_f16}]
    if "epi" in parts:
        if "gemm" not in parts:
            ceil_i8 = int8_tops_ceiling()
            rows += [{"case": "ceiling int8 8192^3, fastest of _int_mm and w8a8_gemm's kernels (TOPS)", "triton_tops": ceil_i8}]
        rows += _epi_rows(images, ceil_i8)
    if "gemm" in parts and variants:  # the variants pick the encoder's GEMM configs: GEMMs first
        gemm_rows, faster = _gemm_rows(images, ceil_i8, ceil_f16, sweep, variants=True)
        rows += gemm_rows
        m_enc = TOKENS * max(enc_images)
        best = {(N, K): cfg for (M, N, K), cfg in faster.items() if M == m_enc}
    # Otherwise encoders first: the headline numbers survive a run cut short by a time limit.
    if "encoder" in parts:
        rows += _encoder_rows(enc_images, iters=10 if quick else 20, variant=best)
    if "layer" in parts:
        rows += _layer_rows(images)
    if "gemm" in parts and not variants:
        rows += _gemm_rows(images, ceil_i8, ceil_f16, sweep)[0]
    if "rows" in parts:
        rows += _quant_rows([n for n in images if n > 1] or [8], row_sweep)
    keys = list(dict.fromkeys(k for r in rows for k in r))  # one table: every row gets every column
    return [{k: r.get(k) for k in keys} for r in rows]
