"""W8A8 GEMM: int8 activations x int8 weights, int32 accumulation, fused dequant(+residual) epilogue.

    out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n] + bias[n] + residual[m, n]

a: (M, K) int8, row-major (per-token quantized activations); b: (N, K) int8, row-major (the nn.Linear layout,
per-output-channel quantized weights, read K-major as wgmma wants for 8-bit types); a_scale: (M,) fp32; b_scale:
(N,) fp32; bias: (N,) any float dtype or None; residual: (M, N) in the out dtype or None (the ViT's skip
connection, so the block needs no separate add); out: (M, N) fp16/bf16/fp32. The int32 accumulator is exact
(|sum| <= K * 127 * 128 < 2**31 for K < 132000). Epilogue in fp32: acc -> fp32, * a_scale, * b_scale, + bias,
+ residual (the reference's order), one rounding to the out dtype, in EPI_SPLIT (1, 2 or 4) column sub-tiles so
that fewer values are live at once. Operands come through TMA descriptors on sm_90+ when every row stride is
16-byte aligned (TMA zero-fills out-of-range tiles), else through pointers (clamped rows, a peeled K tail). K is a
compile-time constant: full K tiles run unmasked. Any M, N, K; contiguous inner dims.
A persistent variant (`_w8a8_gemm_persistent_kernel`, config PERSISTENT) loops each program over tiles with a
sub-tiled epilogue and TMA stores; the launcher runs it at 128 x 256 tiles (_LARGE_TILE_PERSISTENT;
`persistent=False` keeps the plain kernel), except on sm_90 under Triton 3.6, where those GEMMs go to the Gluon
kernels of w8a8_gemm_wgmma.py (see _wgmma_form; `wgmma=False` keeps the Triton kernels).
"""

from __future__ import annotations

import torch

from ._common import INTERPRET, device_caps, tma_aligned, w8a8_ref
from ._triton import TensorDescriptor, tl, triton


@triton.jit
def _mainloop(a_ptr, b_ptr, off_m, off_n, M, N, stride_am, stride_bn, K: tl.constexpr, TMA: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 (BLOCK_M, BLOCK_N) = a[off_m:, :K] @ b[off_n:, :K]^T. TMA: descriptors, edges zero-filled; else
    pointers with clamped rows (garbage rows are dropped by the masked store) and a peeled K tail."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    if TMA:
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = a_ptr.load([off_m, k * BLOCK_K])  # (BLOCK_M, BLOCK_K)
            b = b_ptr.load([off_n, k * BLOCK_K])  # (BLOCK_N, BLOCK_K), K-major as wgmma wants
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
    else:
        rk = tl.arange(0, BLOCK_K)
        rm = tl.minimum(off_m + tl.arange(0, BLOCK_M), M - 1)
        rn = tl.minimum(off_n + tl.arange(0, BLOCK_N), N - 1)
        a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]  # (BLOCK_M, BLOCK_K)
        b_ptrs = b_ptr + rn[None, :] * stride_bn + rk[:, None]  # (BLOCK_K, BLOCK_N): b^T tile
        for _ in range(0, K // BLOCK_K):
            acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if K % BLOCK_K != 0:
            a = tl.load(a_ptrs, mask=rk[None, :] < K % BLOCK_K, other=0)
            b = tl.load(b_ptrs, mask=rk[:, None] < K % BLOCK_K, other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    return acc


@triton.jit
def _epilogue_store(acc, a_s, b_s, bias, off_m, off_n, M, N, res_ptr, c_ptr, stride_rm, stride_cm,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, TMA: tl.constexpr, SUB_M: tl.constexpr,
                    SUB_N: tl.constexpr):
    """Scale one (SUB_M, SUB_N) int32 sub-tile at (off_m, off_n) in fp32 (the reference's order: acc * a_s[m] *
    b_s[n] + bias[n] + residual), round once and store it. a_s (SUB_M,), b_s and bias (SUB_N,) fp32 come loaded.
    TMA: res/c are descriptors (the store clips the M/N edges); else masked pointers."""
    out = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        out += bias[None, :]
    if TMA:
        if HAS_RES:
            out += res_ptr.load([off_m, off_n]).to(tl.float32)
        c_ptr.store([off_m, off_n], out.to(c_ptr.dtype))
    else:
        rm = off_m + tl.arange(0, SUB_M)
        rn = off_n + tl.arange(0, SUB_N)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if HAS_RES:
            out += tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], out.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _halves(acc, b_s, bias, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """Columns [0, HALF) and [HALF, 2 HALF) of a (BLOCK_M, 2 HALF) tile and of its column vectors."""
    acc0, acc1 = acc.reshape(BLOCK_M, 2, HALF).permute(0, 2, 1).split()
    b0, b1 = b_s.reshape(2, HALF).permute(1, 0).split()
    c0, c1 = bias.reshape(2, HALF).permute(1, 0).split()
    return acc0, b0, c0, acc1, b1, c1


@triton.jit
def _epilogue(acc, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_ptr, c_ptr, stride_rm, stride_cm,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, EPI_SPLIT: tl.constexpr):
    """The epilogue of one (BLOCK_M, BLOCK_N) tile in EPI_SPLIT (1, 2 or 4) column sub-tiles, each scaled, biased,
    residual-added and stored before the next, so only one sub-tile's fp32 values are live beside the int32
    accumulator (at 128 x 256, 8 warps, with a residual, the whole tile at once spills). The scale and bias vectors
    are loaded once for the tile and split like the accumulator (per sub-tile: dozens of scalar loads a thread)."""
    SUB_N: tl.constexpr = BLOCK_N // EPI_SPLIT
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    a_s = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    b_s = tl.load(b_scale_ptr + rn, mask=rn < N, other=0.0)
    bias = b_s  # a placeholder (dead code) when there is no bias
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    if EPI_SPLIT == 1:
        _epilogue_store(acc, a_s, b_s, bias, off_m, off_n, M, N, res_ptr, c_ptr, stride_rm, stride_cm, HAS_BIAS,
                        HAS_RES, TMA, BLOCK_M, SUB_N)
    elif EPI_SPLIT == 2:
        acc0, b0, c0, acc1, b1, c1 = _halves(acc, b_s, bias, BLOCK_M, SUB_N)
        _epilogue_store(acc0, a_s, b0, c0, off_m, off_n, M, N, res_ptr, c_ptr, stride_rm, stride_cm, HAS_BIAS,
                        HAS_RES, TMA, BLOCK_M, SUB_N)
        _epilogue_store(acc1, a_s, b1, c1, off_m, off_n + SUB_N, M, N, res_ptr, c_ptr, stride_rm, stride_cm,
                        HAS_BIAS, HAS_RES, TMA, BLOCK_M, SUB_N)
    else:  # 4: halve the halves
        h0, hb0, hc0, h1, hb1, hc1 = _halves(acc, b_s, bias, BLOCK_M, 2 * SUB_N)
        acc0, b0, c0, acc1, b1, c1 = _halves(h0, hb0, hc0, BLOCK_M, SUB_N)
        acc2, b2, c2, acc3, b3, c3 = _halves(h1, hb1, hc1, BLOCK_M, SUB_N)
        _epilogue_store(acc0, a_s, b0, c0, off_m, off_n, M, N, res_ptr, c_ptr, stride_rm, stride_cm, HAS_BIAS,
                        HAS_RES, TMA, BLOCK_M, SUB_N)
        _epilogue_store(acc1, a_s, b1, c1, off_m, off_n + SUB_N, M, N, res_ptr, c_ptr, stride_rm, stride_cm,
                        HAS_BIAS, HAS_RES, TMA, BLOCK_M, SUB_N)
        _epilogue_store(acc2, a_s, b2, c2, off_m, off_n + 2 * SUB_N, M, N, res_ptr, c_ptr, stride_rm, stride_cm,
                        HAS_BIAS, HAS_RES, TMA, BLOCK_M, SUB_N)
        _epilogue_store(acc3, a_s, b3, c3, off_m, off_n + 3 * SUB_N, M, N, res_ptr, c_ptr, stride_rm, stride_cm,
                        HAS_BIAS, HAS_RES, TMA, BLOCK_M, SUB_N)


@triton.jit
def _tile_coords(tile, n_pid_m, n_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-tiles share each column tile of b while it is in L2."""
    group = tile // (GROUP_M * n_pid_n)
    first_m = group * GROUP_M
    size_m = min(n_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * n_pid_n)) % size_m
    pid_n = (tile % (GROUP_M * n_pid_n)) // size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])  # one compile for every token count (M is masked anyway)
def _w8a8_gemm_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, res_ptr, c_ptr, M, N,
                      stride_am, stride_bn, stride_rm, stride_cm, K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, TMA: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EPI_SPLIT: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) output tile per program. TMA: a_ptr / b_ptr are descriptors; the residual and c
    always go through masked pointers. EPI_SPLIT (1, 2 or 4): column sub-tiles of the epilogue."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    if TMA:
        # a_ptr / b_ptr are tensor descriptors; the K tail (and M/N edges) load as zeros.
        for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
            a = a_ptr.load([pid_m * BLOCK_M, k * BLOCK_K])  # (BLOCK_M, BLOCK_K)
            b = b_ptr.load([pid_n * BLOCK_N, k * BLOCK_K])  # (BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
    else:  # pointers: clamped rows, full K tiles unmasked, one masked tail (shared with the persistent kernel)
        acc = _mainloop(a_ptr, b_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_am, stride_bn, K, False,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    # Residual and output through pointers (TMA=False here): out-of-range rows/cols are masked off.
    _epilogue(acc, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_ptr, c_ptr,
              stride_rm, stride_cm, HAS_BIAS, HAS_RES, False, BLOCK_M, BLOCK_N, EPI_SPLIT)


# ---- Persistent variant (config["PERSISTENT"]) ----
# One program per SM (or PROGRAMS_PER_SM), each looping over output tiles in the same grouped order, so the pipeline
# prologue and launch cost are paid once per SM, and the epilogue of tile i (asynchronous TMA stores) overlaps the
# loads of tile i + 1. Sub-tiled epilogue: fewer live fp32 registers, a smaller store buffer in shared memory.


@triton.jit(do_not_specialize=["M"])
def _w8a8_gemm_persistent_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, res_ptr, c_ptr, M, N,
                                 stride_am, stride_bn, stride_rm, stride_cm, K: tl.constexpr,
                                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, TMA: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr, EPI_SPLIT: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                                 FLATTEN: tl.constexpr):
    """Tiles pid, pid + NUM_PROGRAMS, ... of the (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)) output grid. FLATTEN:
    Triton's loop-nest flattening (one software pipeline across tiles: the next tile's loads issue during this
    tile's epilogue). No warp specialization: Triton 3.6 ignores `warp_specialize` on sm_90."""
    n_pid_m = tl.cdiv(M, BLOCK_M)
    n_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_pid_m * n_pid_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, n_pid_m, n_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = _mainloop(a_ptr, b_ptr, off_m, off_n, M, N, stride_am, stride_bn, K, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
        _epilogue(acc, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_ptr, c_ptr, stride_rm, stride_cm,
                  HAS_BIAS, HAS_RES, TMA, BLOCK_M, BLOCK_N, EPI_SPLIT)


# Tile shapes tried largest first: the first whose grid covers 3/4 of the SMs wins (small grids leave SMs idle at
# one image). (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, max stages, EPI_SPLIT); int8 operands take (BM + BN) * BK bytes
# a stage. From the H200 sweep in scripts/benches/w8a8.py (docs/perf_notes.md): 128x256 at 8 and 64 images, 64x128
# at one image; EPI_SPLIT 2 at 128x256, whose unsplit epilogue spills with a residual (`--offline` SASS).
_TILES = ((128, 256, 128, 8, 3, 2), (64, 128, 128, 4, 4, 1), (64, 64, 128, 4, 4, 1))


def _config(M: int, N: int, K: int, device: torch.device) -> dict:
    """Tile shapes: small under the interpreter (it is slow), Hopper-sized on CUDA (see _TILES); pipeline stages as
    many as shared memory holds, up to the tile's maximum."""
    if device.type != "cuda":
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1, EPI_SPLIT=1)
    n_sm, smem, _ = device_caps(device.index if device.index is not None else torch.cuda.current_device())
    fits = [t for t in _TILES if 2 * (t[0] + t[1]) * t[2] + 8192 <= smem]  # 2 stages at least (~100 KB GPUs)
    bm, bn, bk, warps, max_stages, split = next(
        (t for t in fits if triton.cdiv(M, t[0]) * triton.cdiv(N, t[1]) >= 3 * n_sm // 4), fits[-1])
    stages = max(2, min(max_stages, (smem - 8192) // ((bm + bn) * bk)))
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages, EPI_SPLIT=split)


def _tma_ok(*ts: torch.Tensor) -> bool:
    """TMA needs sm_90+, 16-byte aligned bases and 16-byte aligned row strides."""
    if not ts[0].is_cuda or device_caps(ts[0].device.index or 0)[2] < 9:
        return False
    return tma_aligned(*ts)


def w8a8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
              residual: torch.Tensor | None = None, config: dict | None = None, *, persistent: bool = True,
              wgmma: bool = True) -> torch.Tensor:
    """(M, K) int8 x (N, K) int8 -> (M, N) `out_dtype`, scaled per token and per channel (+ bias) (+ residual (M, N)
    in `out_dtype`).

    `config` overrides the tile choice (benchmarks sweep it): the keys of `_config` (EPI_SPLIT default 1), plus
    "TMA" (bool; default: on where `_tma_ok`); "PERSISTENT": True selects the persistent kernel (keys of
    `persistent_config`). Without a config: persistent (the persistent kernel at the shapes it was tuned for,
    _auto_config; False: the plain kernel everywhere) and wgmma (the Gluon kernels where the persistent kernel
    would run, on sm_90 under Triton 3.6, _wgmma_form; False: the Triton kernels only).
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"w8a8_gemm: a and b must be int8, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"w8a8_gemm: need a (M, K) and b (N, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[0]
    if a_scale.shape != (M,) or b_scale.shape != (N,):
        raise ValueError(f"w8a8_gemm: a_scale must be ({M},) and b_scale ({N},), got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise TypeError("w8a8_gemm: a_scale and b_scale must be float32")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"w8a8_gemm: bias must be ({N},), got {tuple(bias.shape)}")
    if residual is not None and (residual.shape != (M, N) or residual.dtype != out_dtype):
        raise ValueError(f"w8a8_gemm: residual must be ({M}, {N}) {out_dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()  # e.g. a ViT's first-layer input, still in the patch conv's layout
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("w8a8_gemm: a and b need a contiguous last dim")
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    tma_ab = _tma_ok(a, b)  # once per call: the dispatch and the launch both need it
    cfg = dict(config or _auto_config(M, N, K, a.device, tma_ab and tma_aligned(c, residual), persistent))
    gluon_form = _wgmma_form(bool(cfg.get("PERSISTENT")), K, residual) if config is None and wgmma else None
    if gluon_form is not None and _wgmma_ok(a, b, c, residual):
        from .w8a8_gemm_wgmma import w8a8_gemm_wgmma

        return w8a8_gemm_wgmma(a, b, a_scale, b_scale, bias, out_dtype, residual, out=c, **gluon_form)
    tma = cfg.pop("TMA", None)
    tma = tma_ab if tma is None else tma
    if cfg.pop("PERSISTENT", False):
        _launch_persistent(a, b, a_scale, b_scale, bias, residual, c, tma, cfg)
        return c
    cfg.setdefault("EPI_SPLIT", 1)
    if cfg["EPI_SPLIT"] not in (1, 2, 4) or cfg["BLOCK_N"] % cfg["EPI_SPLIT"]:
        raise ValueError(f"w8a8_gemm: EPI_SPLIT must be 1, 2 or 4 and divide BLOCK_N, got {cfg['EPI_SPLIT']}")
    a_arg, b_arg = a, b
    if tma:
        a_arg = TensorDescriptor.from_tensor(a, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
        b_arg = TensorDescriptor.from_tensor(b, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _w8a8_gemm_kernel[grid](
        a_arg, b_arg, a_scale.contiguous(), b_scale.contiguous(), bias if bias is not None else b_scale,
        residual if residual is not None else c, c, M, N, a.stride(0), b.stride(0),
        (residual if residual is not None else c).stride(0), c.stride(0), K=K, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, TMA=tma, **cfg)
    return c


def _launch_persistent(a, b, a_scale, b_scale, bias, residual, c, tma: bool, cfg: dict) -> None:
    """Launch `_w8a8_gemm_persistent_kernel` on min(tiles, programs) programs. TMA covers a, b, the residual and c
    together (c and the residual need N % 8 == 0 in fp16); otherwise all go through pointers. cfg: BLOCK_M/N/K,
    GROUP_M, num_warps, num_stages, EPI_SPLIT, FLATTEN and PROGRAMS_PER_SM or NUM_PROGRAMS (an explicit count)."""
    (M, K), N = a.shape, b.shape[0]
    cfg = dict(cfg)
    tma = tma and tma_aligned(a, b, c, residual)
    bm, bn, bk, sub_n = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["BLOCK_N"] // cfg["EPI_SPLIT"]
    res = residual if residual is not None else c
    a_arg, b_arg, r_arg, c_arg = a, b, res, c
    if tma:
        a_arg = TensorDescriptor.from_tensor(a, [bm, bk])
        b_arg = TensorDescriptor.from_tensor(b, [bn, bk])
        r_arg = TensorDescriptor.from_tensor(res, [bm, sub_n])
        c_arg = TensorDescriptor.from_tensor(c, [bm, sub_n])
    if "NUM_PROGRAMS" not in cfg:
        n_sm = device_caps(a.device.index if a.device.index is not None else torch.cuda.current_device())[0]
        cfg["NUM_PROGRAMS"] = n_sm * cfg.pop("PROGRAMS_PER_SM", 1)  # constexpr: one compile per GPU
    cfg.pop("PROGRAMS_PER_SM", None)
    grid = (min(cfg["NUM_PROGRAMS"], triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    _w8a8_gemm_persistent_kernel[grid](
        a_arg, b_arg, a_scale.contiguous(), b_scale.contiguous(), bias if bias is not None else b_scale, r_arg,
        c_arg, M, N, a.stride(0), b.stride(0), res.stride(0), c.stride(0), K=K, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, TMA=tma, **cfg)


# Persistent-kernel configs the H200 sweep tries (scripts/benches/w8a8.py): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
# num_stages, EPI_SPLIT, FLATTEN). Shared memory: stages * (BM + BN) * BK int8 operand bytes + a BM x BN/EPI_SPLIT
# fp16 store buffer (+ the residual's); all compile for sm_90a without spills.
_PERSISTENT_TILES = (
    (128, 256, 128, 8, 3, 2, False),
    (128, 256, 128, 8, 4, 4, False),
    (128, 256, 64, 8, 6, 2, False),
    (128, 128, 128, 4, 4, 1, False),
    (128, 128, 128, 8, 5, 2, False),
    (256, 128, 128, 8, 3, 2, False),
    (128, 256, 128, 8, 3, 2, True),
    (128, 128, 128, 8, 5, 2, True),
)


def persistent_config(t: tuple, programs_per_sm: int = 1) -> dict:
    """A `w8a8_gemm` config dict from a `_PERSISTENT_TILES` row."""
    bm, bn, bk, warps, stages, split, flatten = t
    return dict(PERSISTENT=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
                EPI_SPLIT=split, FLATTEN=flatten, PROGRAMS_PER_SM=programs_per_sm)

# What runs where _config picks the 128 x 256 tile (8 and 64 SigLIP images; fc1 at one): the persistent kernel, loop
# nest flattened for short K, 4 stages and a 4-way epilogue split for long K (fc2); faster than the plain kernel
# at every ViT GEMM there (TINYVILA_W8A8_VARIANTS=1 of scripts/benches/w8a8.py; docs/perf_notes.md).
_LARGE_TILE_PERSISTENT = {False: (128, 256, 128, 8, 3, 2, True), True: (128, 256, 128, 8, 4, 4, False)}  # K >= 2048


def _auto_config(M: int, N: int, K: int, device: torch.device, tma: bool, persistent: bool = True) -> dict:
    """The config a call runs: _config's tile, on CUDA (with `persistent`) the persistent kernel instead where that
    is 128 x 256 and every operand can go through TMA (its pointer form at these tiles needs more shared memory
    than an H200 has at some K)."""
    cfg = _config(M, N, K, device)
    if device.type == "cuda" and tma and (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (128, 256) and persistent:
        return persistent_config(_LARGE_TILE_PERSISTENT[K >= 2048])
    return cfg


# Where the launcher picks the persistent 128 x 256 kernel, on sm_90 with TMA-aligned operands and a 16-bit output,
# a Gluon kernel of w8a8_gemm_wgmma.py runs instead (int8 wgmma kept in flight across K steps, which Triton's
# pipeliner does not do for int32 accumulators), in the form _wgmma_form picks (docs/perf_notes.md): ping-pong at
# K = 1152 (qkv, wo, fc1); at fc2's K = 4304 the 256 x 128 row-halves form with a residual, else the Triton kernel.
# Gluon's API moves between releases: the dispatch needs the Triton it was written with (3.6).
PINGPONG_MAX_K = 2048  # ping-pong measured faster at K = 1152 and slower at 4304; between them, untested


def _wgmma_form(persistent: bool, K: int, residual: torch.Tensor | None) -> dict | None:
    """The Gluon form (w8a8_gemm_wgmma's keyword arguments) or None for the Triton kernel: only where the launcher
    picked its persistent kernel, i.e. at the measured shapes."""
    if not persistent:
        return None
    if K <= PINGPONG_MAX_K:
        return {"pingpong": True}
    return {"tile": (256, 128, 128, 8, 3), "group_m": 4} if residual is not None else None


_GLUON_TRITON = triton.__version__.startswith("3.6.")


def _wgmma_ok(a, b, c, residual) -> bool:
    """Whether the Gluon kernel can run a persistent-config call (Triton 3.6, sm_90, operands `ok` takes)."""
    if not _GLUON_TRITON or INTERPRET or not a.is_cuda:
        return False
    try:
        from .w8a8_gemm_wgmma import ok
    except ImportError:  # a Triton without Gluon's Hopper API: the Triton kernels serve
        return False
    return ok(a, b, c, residual)


def w8a8_gemm_ref(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch (_common.w8a8_ref, shared with w8a8_gemm_wgmma): the CPU path of ops.w8a8_linear."""
    return w8a8_ref(a, b, a_scale, b_scale, bias, out_dtype, residual)
