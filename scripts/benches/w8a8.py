"""W8A8 vision benchmarks at SigLIP-so400m shapes (729 tokens/image, width 1152, MLP 4304).

    PYTHONPATH=. python scripts/bench_kernels.py --only w8a8 [--quick]
    TINYVILA_W8A8_SWEEP=1,8 ... also sweeps the GEMM tile configs (TMA and pointer operands) at
    those image counts; TINYVILA_W8A8_ROW_SWEEP=8,64 the launch shapes of the int8-producing row kernels

GEMM rows: the Triton w8a8_gemm (int8 x int8 -> int32, fused scale/bias epilogue, fp16 out) in TOPS
against the measured int8 ceiling (torch._int_mm at 8192^3), beside torch._int_mm alone (a lower
bound for any "_int_mm + epilogue" dispatch), _int_mm + a PyTorch epilogue, and fp16 cuBLAS. Kernel
times come from CUDA-graph replays of many calls (no host launch overhead in them; `triton_eager_ms`
keeps the per-call eager time). Encoder rows: the 26-layer SigLIP encoder (synthetic weights) in
fp16 and W8A8, eager and CUDA-graph, vs HF transformers' SiglipVisionModel (27 layers, fp16, SDPA).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F

from benches import common

SHAPES = [(1152, 3456, "qkv"), (1152, 1152, "o"), (1152, 4304, "fc1"), (4304, 1152, "fc2")]  # (K, N, name)
TOKENS = 729


def sweep_configs() -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, TMA): the launcher's tiles with both operand
    paths, plus deeper pipelines and 4-warp 128x128."""
    from csrc_triton.w8a8_gemm import _TILES

    base = [(bm, bn, bk, w, st, tma) for tma in (True, False) for bm, bn, bk, w, st in _TILES]
    return base + [(128, 256, 128, 8, 4, True), (128, 128, 128, 8, 5, True), (128, 128, 128, 4, 4, True)]


def _progress(row: dict) -> dict:
    """Echo a row to stderr as it is measured (a long run cut short still reports), and return it."""
    print("  ", {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, file=sys.stderr, flush=True)
    return row


def graph_ms(fn, sets: list, calls: int = 12, iters: int = 10) -> float:
    """Median ms per call of `fn(*set)` from replays of one CUDA graph of `calls` calls (rotating
    the sets): the GPU time without host launch overhead, as the encoder's graph runs it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in sets:
            fn(*s)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    ms = common.bench(g.replay, [()], warmup=2, iters=iters)
    del g
    return ms / calls


def int8_tops_ceiling() -> float:
    """Measured int8 tensor-core ceiling: torch._int_mm (cuBLASLt) at 8192^3, TOPS."""
    n = 8192
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda")
    ms = common.bench(lambda: torch._int_mm(a, b.t()), [()], warmup=5, iters=20)
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
    for bm, bn, bk, warps, stages, tma in sweep_configs():
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages, TMA=tma)
        name = f"{bm}x{bn}x{bk} w{warps} s{stages} {'tma' if tma else 'ptr'}"
        try:
            ms = graph_ms(lambda a, b, sa, sb, bias, *_, cfg=cfg: w8a8_gemm(a, b, sa, sb, bias, config=cfg),
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


def _gemm_rows(images: list[int], ceil_i8: float, ceil_f16: float, sweep: list[int]) -> list[dict]:
    from csrc_triton.w8a8_gemm import _config, w8a8_gemm

    rows = []
    for n_img in images:
        M = TOKENS * n_img
        for K, N, name in SHAPES:
            sets = _sets(M, K, N)
            ops = 2 * M * N * K / 1e9
            tri = lambda a, b, sa, sb, bias, *_: w8a8_gemm(a, b, sa, sb, bias)  # noqa: E731
            t_tri = graph_ms(tri, sets)
            t_intmm = graph_ms(lambda a, b, *_: torch._int_mm(a, b.t()), sets)
            t_intmm_epi = graph_ms(lambda a, b, sa, sb, bias, *_: (torch._int_mm(a, b.t()).float() * sa[:, None]
                                                                    * sb[None, :] + bias).half(), sets)
            t_f16 = graph_ms(lambda *s: F.linear(s[5], s[6], s[4]), sets)
            cfg = _config(M, N, K, sets[0][0].device)
            rows.append(_progress({"case": f"gemm {name} M={M} K={K} N={N}", "triton_ms": t_tri,
                         "triton_tops": ops / t_tri, "pct_int8_ceil": 100 * ops / t_tri / ceil_i8,
                         "triton_eager_ms": common.bench(tri, sets), "int_mm_ms": t_intmm,
                         "int_mm_tops": ops / t_intmm, "int_mm+epi_ms": t_intmm_epi, "fp16_ms": t_f16,
                         "fp16_tflops": ops / t_f16, "speedup_vs_fp16": t_f16 / t_tri,
                         "note": "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**cfg)}))
            if n_img in sweep:
                rows += _sweep(sets, ops, f"{name} M={M}")
            del sets
    return rows


ROW_SWEEP = [(1, 4), (1, 8), (1, 16), (2, 8), (4, 16)]  # (rows per program, num_warps) of the row kernels


def _quant_rows(images: list[int], sweep: list[int]) -> list[dict]:
    """The fused producers of int8 activations, in GB/s (bytes in + out) against the copy ceiling,
    beside the fp16 op each replaces (F.layer_norm, F.gelu tanh)."""
    from csrc_triton.gelu_quant import gelu_quant
    from csrc_triton.layer_norm_quant import layer_norm_quant
    from csrc_triton.quant_per_token import quant_per_token

    ceil = common.copy_bandwidth_gbs()
    rows = []
    for n_img in images:
        M = TOKENS * n_img
        for K, name in ((1152, "layer_norm_quant"), (4304, "gelu_quant"), (1152, "quant_per_token")):
            sets = [(torch.randn(M, K, device="cuda", dtype=torch.float16),
                     (torch.rand(K, device="cuda") + 0.5).half(), torch.randn(K, device="cuda").half())
                    for _ in range(common.n_copies(3 * M * K))]
            fused = {"layer_norm_quant": lambda x, w, b: layer_norm_quant(x, w, b, 1e-6),
                     "gelu_quant": lambda x, *_: gelu_quant(x, "gelu_tanh"),
                     "quant_per_token": lambda x, *_: quant_per_token(x)}[name]
            plain = {"layer_norm_quant": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-6),
                     "gelu_quant": lambda x, *_: F.gelu(x, approximate="tanh"),
                     "quant_per_token": lambda x, *_: x.clone()}[name]
            t, t_plain = graph_ms(fused, sets), graph_ms(plain, sets)
            gbs = (3 * M * K + 4 * M) / t / 1e6  # fp16 in, int8 + fp32 scale out
            rows.append(_progress({"case": f"{name} M={M} K={K}", "triton_ms": t, "gbs": gbs,
                                   "pct_copy_bw": 100 * gbs / ceil, "fp16_op_ms": t_plain}))
            for rows_, warps in (ROW_SWEEP if n_img in sweep else ()):
                meta = dict(ROWS=rows_, num_warps=warps)
                f = {"layer_norm_quant": lambda x, w, b, meta=meta: layer_norm_quant(x, w, b, 1e-6, meta=meta),
                     "gelu_quant": lambda x, *_, meta=meta: gelu_quant(x, "gelu_tanh", meta=meta),
                     "quant_per_token": lambda x, *_, meta=meta: quant_per_token(x, meta=meta)}[name]
                t = graph_ms(f, sets)
                rows.append(_progress({"case": f"sweep {name} M={M} rows={rows_} warps={warps}", "triton_ms": t,
                                       "gbs": (3 * M * K + 4 * M) / t / 1e6}))
            del sets
    return rows


def _encoders():
    """(fp16 dense, W8A8) synthetic SigLIP-so400m encoders (layer -2: 26 layers) on the GPU."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from smoothquant import w8a8_state_dict

    from tinyvila.config import SIGLIP_SO400M
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


@torch.no_grad()
def _encoder_rows(images: list[int], iters: int) -> list[dict]:
    dense, q = _encoders()
    hf = _hf_siglip()
    runs = {"fp16_ms": dense, "fp16_graph_ms": _graphed(dense._forward), "w8a8_ms": q,
            "w8a8_graph_ms": _graphed(q._forward)}
    if hf is not None:
        runs["hf_sdpa_fp16_ms"] = lambda px: hf(pixel_values=px).last_hidden_state
        runs["hf_sdpa_fp16_graph_ms"] = _graphed(runs["hf_sdpa_fp16_ms"])
    rows = []
    for n_img in images:
        sets = [(torch.randn(n_img, 3, 384, 384, device="cuda", dtype=torch.float16),) for _ in range(2)]
        row = {"case": f"encoder so400m x{n_img} images"}
        for key, fn in runs.items():
            try:
                row[key] = common.bench(fn, sets, warmup=3, iters=iters)
            except Exception as e:  # e.g. a model that cannot be captured: say so, keep the others
                row[key], row["note"] = None, f"{key}: {type(e).__name__}"
        best = row["w8a8_graph_ms"]
        for key in ("fp16_ms", "fp16_graph_ms", "hf_sdpa_fp16_ms", "hf_sdpa_fp16_graph_ms"):
            if row.get(key) and best:
                row[f"x_{key.removesuffix('_ms')}"] = row[key] / best  # W8A8 graph's speedup over it
        rows.append(_progress(row))
        del sets
        for fn in runs.values():
            if hasattr(fn, "clear"):
                fn.clear()  # free this batch size's graph pool before the next, larger one
        torch.cuda.empty_cache()
    # Accuracy sanity on the GPU path: W8A8 features vs the fp16 encoder's, same synthetic weights.
    px = torch.randn(2, 3, 384, 384, device="cuda", dtype=torch.float16)
    cos = F.cosine_similarity(q(px).float().flatten(1), dense(px).float().flatten(1), dim=-1).min().item()
    rows.append({"case": "encoder so400m w8a8 vs fp16 cosine (synthetic weights)", "w8a8_ms": cos})
    return rows


def run(args) -> list[dict]:
    quick = getattr(args, "quick", False)
    sweep = [int(n) for n in os.environ.get("TINYVILA_W8A8_SWEEP", "").split(",") if n.strip()]
    row_sweep = [int(n) for n in os.environ.get("TINYVILA_W8A8_ROW_SWEEP", "").split(",") if n.strip()]
    ceil_i8, ceil_f16 = int8_tops_ceiling(), common.matmul_tflops(torch.float16)
    rows = [{"case": "ceiling int8 torch._int_mm 8192^3 (TOPS)", "triton_tops": ceil_i8},
            {"case": "ceiling fp16 matmul 8192^3 (TFLOP/s)", "fp16_tflops": ceil_f16}]
    # Encoders first: the headline numbers survive a run cut short by a time limit.
    rows += _encoder_rows([1, 8] if quick else [1, 8, 64], iters=10 if quick else 20)
    rows += _gemm_rows([1, 8] if quick else [1, 8, 64], ceil_i8, ceil_f16, sweep)
    rows += _quant_rows([8] if quick else [8, 64], row_sweep)
    keys = list(dict.fromkeys(k for r in rows for k in r))  # one table: every row gets every column
    return [{k: r.get(k) for k in keys} for r in rows]
