"""W8A8 vision benchmarks at SigLIP-so400m shapes (729 tokens/image, width 1152, MLP 4304).

    PYTHONPATH=. python scripts/bench_kernels.py --only w8a8 [--quick]

GEMM rows: the Triton w8a8_gemm (int8 x int8 -> int32, fused scale/bias epilogue, fp16 out) in TOPS
against the measured int8 ceiling (torch._int_mm at 8192^3), beside torch._int_mm + a PyTorch
epilogue (the dispatch alternative for ops.py) and fp16 cuBLAS (F.linear). Encoder rows: the whole
26-layer W8A8 SigLIP encoder (synthetic weights) vs the same encoder in fp16, and vs HF transformers'
SiglipVisionModel (27 layers, the real model as users run it) in fp16 with SDPA, for 1/8/64 images.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from benches import common

SHAPES = [(1152, 3456, "qkv"), (1152, 1152, "o"), (1152, 4304, "fc1"), (4304, 1152, "fc2")]  # (K, N, name)
TOKENS = 729


def int8_tops_ceiling() -> float:
    """Measured int8 tensor-core ceiling: torch._int_mm (cuBLASLt) at 8192^3, TOPS."""
    n = 8192
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda")
    ms = common.bench(lambda: torch._int_mm(a, b.t()), [()], warmup=5, iters=20)
    return 2 * n**3 / ms / 1e9


def _gemm_rows(images: list[int], ceil_i8: float, ceil_f16: float) -> list[dict]:
    from csrc_triton.w8a8_gemm import w8a8_gemm

    rows = []
    for n_img in images:
        M = TOKENS * n_img
        for K, N, name in SHAPES:
            per_set = M * K * 3 + N * K * 3  # int8 + fp16 operands
            sets = []
            for _ in range(common.n_copies(per_set)):
                a = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
                b = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
                sets.append((a, b, torch.rand(M, device="cuda") * 0.01, torch.rand(N, device="cuda") * 1e-3,
                             torch.randn(N, device="cuda", dtype=torch.float16),
                             torch.randn(M, K, device="cuda", dtype=torch.float16),
                             torch.randn(N, K, device="cuda", dtype=torch.float16)))
            ops = 2 * M * N * K / 1e9
            t_tri = common.bench(lambda a, b, sa, sb, bias, *_: w8a8_gemm(a, b, sa, sb, bias), sets)
            t_intmm = common.bench(lambda a, b, sa, sb, bias, *_: (torch._int_mm(a, b.t()).float() * sa[:, None]
                                                                     * sb[None, :] + bias).half(), sets)
            t_f16 = common.bench(lambda *s: F.linear(s[5], s[6]), sets)
            rows.append({"case": f"gemm {name} M={M} K={K} N={N}", "triton_ms": t_tri,
                         "triton_tops": ops / t_tri, "pct_int8_ceil": 100 * ops / t_tri / ceil_i8,
                         "int_mm+epi_ms": t_intmm, "fp16_ms": t_f16, "fp16_tflops": ops / t_f16,
                         "pct_fp16_ceil": 100 * ops / t_f16 / ceil_f16, "speedup_vs_fp16": t_f16 / t_tri})
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


@torch.no_grad()
def _encoder_rows(images: list[int], iters: int) -> list[dict]:
    dense, q = _encoders()
    hf = _hf_siglip()
    rows = []
    for n_img in images:
        sets = [(torch.randn(n_img, 3, 384, 384, device="cuda", dtype=torch.float16),) for _ in range(2)]
        t_q = common.bench(q, sets, warmup=3, iters=iters)
        t_d = common.bench(dense, sets, warmup=3, iters=iters)
        row = {"case": f"encoder so400m x{n_img} images", "w8a8_ms": t_q, "fp16_ms": t_d, "speedup_vs_fp16": t_d / t_q}
        if hf is not None:
            t_hf = common.bench(lambda px: hf(pixel_values=px), sets, warmup=3, iters=iters)
            row.update({"hf_sdpa_fp16_ms": t_hf, "speedup_vs_hf": t_hf / t_q})
        rows.append(row)
        del sets
    # Accuracy sanity on the GPU path: W8A8 features vs the fp16 encoder's, same synthetic weights.
    px = torch.randn(2, 3, 384, 384, device="cuda", dtype=torch.float16)
    cos = F.cosine_similarity(q(px).float().flatten(1), dense(px).float().flatten(1), dim=-1).min().item()
    rows.append({"case": "encoder so400m w8a8 vs fp16 cosine (synthetic weights)", "w8a8_ms": cos})
    return rows


def run(args) -> list[dict]:
    quick = getattr(args, "quick", False)
    ceil_i8, ceil_f16 = int8_tops_ceiling(), common.matmul_tflops(torch.float16)
    rows = [{"case": "ceiling int8 torch._int_mm 8192^3 (TOPS)", "triton_tops": ceil_i8},
            {"case": "ceiling fp16 matmul 8192^3 (TFLOP/s)", "fp16_tflops": ceil_f16}]
    rows += _gemm_rows([1, 8] if quick else [1, 8, 64], ceil_i8, ceil_f16)
    rows += _encoder_rows([1, 8] if quick else [1, 8, 64], iters=10 if quick else 30)
    keys = list(dict.fromkeys(k for r in rows for k in r))  # one table: every row gets every column
    return [{k: r.get(k) for k in keys} for r in rows]
