"""W4A16 GEMV for decode: y (M, N) = x (M, K) @ W^T + bias, M <= 8, W packed as in tinyvila/quant.py.

Layouts: x (M, K) fp16/bf16 with unit stride along K; qweight int32 (N, K/8), nibble i of word j of row n is
q[n, 8j + i]; scales (N, K/G) in x's dtype; zeros fp32 (N, K/G); w = q * s + b. G in {32, 64, 128}.
Nibbles unpack to exact "magic" values v = m + q u (fp16: m = 16 at even k, 1 at odd k, u = 1/64; bf16: m = 16,
u = 1/8; csrc_triton/_w4a16_gemv_operands.py). Then, per group g of row n (fp32 sums, w never rounded):

    sum_k x_k w_k = s (sum q x) + b X = (s / u) (sum_k v_k x_k - Xm) + b X,   X = sum x,  Xm = sum m x.

Two kernels share this math and the epilogue:
- "mma" (G = 128, K % 128 == 0; the GPU default): v is the *register* operand A of mma.sync, born in mma's
  operand layout, so the tensor cores do every multiply-add (~1 integer op per weight to unpack). A K step covers
  GPS groups in GPS dots against one B holding the step's x; scales and the x-only terms (Xm, X) are applied per
  step (the operand layouts: _w4a16_gemv_operands.py).
- "fma" (any G): the fp16 magic values widened to fp32, fp32 FMAs against x summed per 32-value chunk that one
  thread holds (one 16-byte load), scaled per chunk; ~4.2 SASS instructions per weight: the fallback for G 32, 64.
Split-K (SPLIT_K > 1; row blocks too few to fill the GPU): the last program to arrive at its row block's counter
sums the fp32 partials in split order (deterministic), adds the bias, stores y and resets the counter. No host
sync, no autotuning, no per-call allocation (workspace and counters persist per device), so a call can be captured
in a CUDA graph after one eager call of the same shape. One CUDA stream at a time per device (shared counters).
Epilogues (EPI; csrc_triton/_w4a16_gemv_epilogue.py): 0 plain; 1 residual add + the next RMSNorm's share
(w4a16_gemv_norm.py); 2 SwiGLU (w4a16_gemv_silu.py); 3 RoPE + the KV-cache write (w4a16_gemv_rope.py); 2 and 3
(mma only) pair a program's rows by mma_tile's row map. All launch through `launch_gemv`.
Configs: GEMV_TABLE, else the rule gemv_config (H200 sweep: scripts/benches/w4a16.py, TINYVILA_W4_SWEEP=1);
`kernel` ("auto" | "mma" | "fma") picks the inner form where the shape allows.
Limits: M <= 8 (larger M: w4a16_gemm), K % G == 0, N * K / 8 < 2^31.
"""

from __future__ import annotations

import torch

from . import pdl
from ._common import INTERPRET, check_w4_args, dequantize_ref
from ._triton import tl, triton
from ._w4a16_gemv_epilogue import finish, prenorm_finish, prenorm_parts, prenorm_rows
from ._w4a16_gemv_operands import (load_scales, magic_planes, mma_operand, shared_x_dots, step_scales,
                                   step_zero_terms, x_shared)
from .pdl import options as pdl_options

MAX_M = 8


# -- "fma" kernel: fp32 FMAs per 32-value chunk ------------------------------------------------------------
@triton.jit
def _chunk_sums(words, x, s, b, UNPACK: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr):
    """sum_k x_k w_k over each 32-value chunk (4 words, one thread's 16-byte load) of a tile: words
    (BN, 4 CH) int32, x (32 CH,) fp32 in K order, s and b (BN, CH) fp32 -> (BN, CH)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = magic_planes(words, tl.float32, UNPACK)
    # three interleave levels: position 8 j + i = nibble i of word j, in the thread's own registers (unpack_k_order)
    even = tl.interleave(tl.interleave(v0, v4), tl.interleave(v2, v6))
    v = tl.interleave(even, tl.interleave(tl.interleave(v1, v5), tl.interleave(v3, v7)))  # (BN, 32 CH)
    p = tl.sum(tl.reshape(v * x[None, :], (BLOCK_N, CH, 32)), axis=2)  # (BN, CH) sum v x
    x_eo = tl.sum(tl.reshape(x, (CH, 16, 2)), axis=1)  # (CH, 2): sums of x at even and odd k
    x_even, x_odd = tl.split(x_eo)
    xm64 = 1024.0 * x_even + 64.0 * x_odd  # 64 Xm (m = 16 at even k, 1 at odd), shared by all rows
    return s * (64.0 * p - xm64[None, :]) + b * (x_even + x_odd)[None, :]


@triton.jit
def _w4a16_gemv_fma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr, res_ptr, g_ptr, xg_ptr,
                           pout_ptr, pin_ptr, NP_IN, norm_d, eps, M, N, stride_xm,
                           stride_ym, K8, NG, W_SPLIT, SPLIT_K, LOG_WPG, BLOCK_M: tl.constexpr,
                           HAS_BIAS: tl.constexpr, UNPACK: tl.constexpr, S_PAIRS: tl.constexpr,
                           EVEN: tl.constexpr, FENCE: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_W: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, EPI: tl.constexpr,
                           PRENORM: tl.constexpr, NPB: tl.constexpr, PDL: tl.constexpr):
    # K8 = K / 8, NG = K / G, W_SPLIT are arguments (not computed): Triton sees their divisibility by 16 (16-byte loads)
    BLOCK_K: tl.constexpr = BLOCK_W * 8
    CH: tl.constexpr = BLOCK_W // 4  # 32-value chunks per row and tile
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, CH)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    w_lo = pid_k * W_SPLIT
    w_hi = tl.minimum(w_lo + W_SPLIT, K8)  # this program's words [w_lo, w_hi) of every row
    pdl.enter(PDL)  # a decode-step kernel (csrc_triton/pdl.py): nothing is read before the previous one is done
    if PRENORM:
        r = prenorm_rows(pin_ptr, NP_IN, norm_d, eps, M, BLOCK_M, NPB)
    else:
        r = tl.zeros((BLOCK_M,), dtype=tl.float32)  # unused
    # int32 offsets (the launcher checks N * K8 < 2^31); pointers advance by one tile per iteration.
    w_ptrs = qw_ptr + offs_n[:, None] * K8 + w_lo + offs_w[None, :]  # (BN, BW)
    x_ptrs = x_ptr + w_lo * 8 + offs_k  # (BK,)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, CH), dtype=tl.float32)  # per row and chunk slot: summed at the end
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, CH), dtype=tl.float32)
    for w0 in tl.range(w_lo, w_hi, BLOCK_W, num_stages=STAGES):
        # (BN, CH): each chunk's group (2^LOG_WPG = G / 8 words per group, a runtime argument: one compiled variant
        # for all G; a chunk of 4 words never straddles groups as G >= 32)
        meta = offs_n[:, None] * NG + ((w0 + 4 * offs_c) >> LOG_WPG)[None, :]
        if EVEN:
            words = tl.load(w_ptrs)  # (BN, BW)
            s = load_scales(s_ptr, meta, meta, x_ptr.dtype.element_ty, S_PAIRS, False)
            b = tl.load(z_ptr + meta)
        else:
            words = tl.load(w_ptrs, mask=n_mask[:, None] & ((w0 + offs_w) < w_hi)[None, :], other=0)
            c_mask = n_mask[:, None] & ((w0 + 4 * offs_c) < w_hi)[None, :]
            s = load_scales(s_ptr, meta, c_mask, x_ptr.dtype.element_ty, S_PAIRS, True)
            b = tl.load(z_ptr + meta, mask=c_mask, other=0.0)
        for m in tl.static_range(BLOCK_M):
            if EVEN and BLOCK_M == 1:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs + m * stride_xm, mask=((w0 * 8 + offs_k) < w_hi * 8) & (m < M), other=0.0)
            part = _chunk_sums(words, x.to(tl.float32), s, b, UNPACK, BLOCK_N, CH)
            if BLOCK_M == 1:
                acc += part
            else:
                acc = tl.where((offs_m == m)[:, None, None], acc + part[None, :, :], acc)
        w_ptrs += BLOCK_W
        x_ptrs += BLOCK_K
    if BLOCK_M == 1:
        acc = acc[None, :, :]
    out = tl.sum(acc, axis=2)  # (BM, BN)
    finish(out, offs_m, offs_n, pid_n, pid_k, M, N, y_ptr, stride_ym, bias_ptr, ws_ptr, lock_ptr, SPLIT_K,
           res_ptr, g_ptr, xg_ptr, pout_ptr, r, HAS_BIAS, SPLIT, FENCE, BLOCK_M, BLOCK_N, EPI, PRENORM)


# -- "mma" kernel: tensor cores, G = 128 (its operands: csrc_triton/_w4a16_gemv_operands.py) ------------------
@triton.jit
def mma_tile(pid_n, pid_k, x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr, res_ptr, g_ptr, xg_ptr,
             pout_ptr, pin_ptr, NP_IN, norm_d, eps, M, N, stride_xm,
             stride_ym, K8, NG, W_SPLIT, SPLIT_K, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
             UNPACK: tl.constexpr, S_PAIRS: tl.constexpr, FENCE: tl.constexpr, UPCAST_DOT: tl.constexpr,
             BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, GPS: tl.constexpr,
             EPI: tl.constexpr, PRENORM: tl.constexpr, NPB: tl.constexpr, WRAP: tl.constexpr, TRIGGER: tl.constexpr = 0,
             PDL: tl.constexpr = False, rope=None, ROPE_D: tl.constexpr = 0, SECOND: tl.constexpr = False):
    """Row block pid_n, K split pid_k of the mma kernel: y (or its split-K partial) for BLOCK_N rows. Each K step:
    GPS groups' words -> A (mma_operand), GPS dots against the step's x (shared_x_dots), scaled per group and column
    (step_scales), plus the x-only terms (step_zero_terms). WRAP: N % BLOCK_N != 0, so the last row block's plain
    rows past N wrap around (SwiGLU and RoPE tiles never wrap: silu_ok, rope_ok)."""
    dtype = y_ptr.dtype.element_ty
    U_INV: tl.constexpr = 8.0 if dtype == tl.bfloat16 else 64.0  # 1 / u of the magic values (magic_planes)
    M_ODD: tl.constexpr = 16.0 if dtype == tl.bfloat16 else 1.0  # their m at odd k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EPI == 2:  # SwiGLU: BN / 2 gate rows j, then up rows N / 2 + j (the epilogue pairs them)
        HALF: tl.constexpr = BLOCK_N // 2
        i = tl.arange(0, BLOCK_N)
        rows = pid_n * HALF + i % HALF + tl.where(i >= HALF, N // 2, 0)  # never wraps: N / 2 is whole half-tiles
    elif EPI == 3:  # RoPE: BN / 2 dims d of one head's first half, then dims d + D / 2 (the epilogue pairs them)
        HALF: tl.constexpr = BLOCK_N // 2
        CHUNKS: tl.constexpr = ROPE_D // BLOCK_N  # programs per head
        i = tl.arange(0, BLOCK_N)
        rows = ((pid_n // CHUNKS) * ROPE_D + (pid_n % CHUNKS) * HALF + i % HALF
                + tl.where(i >= HALF, ROPE_D // 2, 0))
        cols = rows  # the bias and the split-K partials are indexed by row (all rows < N: no wrap)
    elif WRAP:
        rows = cols % N  # rows past N wrap around instead of being masked (unmasked loads); the store drops them
    else:  # N % BLOCK_N == 0: no row wraps, and no runtime modulo (~16 SASS a row, after the PDL wait) is paid
        rows = cols
    if PRENORM:  # loaded here, reduced after the K loop: the loop's first weight loads must not wait for the
        parts = prenorm_parts(pin_ptr, NP_IN, M, BLOCK_M, NPB)  # round trip and the cross-warp sum
    g_lo = pid_k * (W_SPLIT // 16)
    g_hi = tl.minimum(g_lo + W_SPLIT // 16, NG)  # this program's groups [g_lo, g_hi), a multiple of GPS
    offs_m = tl.arange(0, BLOCK_M)
    x_mask = (offs_m < M)[:, None]
    # Each step's addresses: its scalar base plus loop-invariant offsets (advanced pointer tiles were kept twice by the
    # software pipelining: more registers)
    x_offs = offs_m[:, None] * stride_xm + tl.arange(0, 64 * GPS)[None, :]  # (BM, 64 GPS)
    w_offs = (rows[None, :, None] * K8 + 16 * tl.arange(0, GPS)[:, None, None]
              + tl.arange(0, 16)[None, None, :])  # (GPS, BN, 16): group-major, see above
    s_row = rows * NG
    acc = tl.zeros((BLOCK_N, 8), dtype=tl.float32)
    for g in tl.range(g_lo, g_hi, GPS, num_stages=STAGES):
        x_ptrs = (x_ptr + g * 64) + x_offs
        w_ptrs = (qw_ptr + g * 16) + w_offs
        s_idx = s_row + g
        a = mma_operand(tl.load(w_ptrs), dtype, UNPACK)  # (BN, 128 GPS)
        pairs = tl.load(x_ptrs, mask=x_mask, other=0)
        dots = shared_x_dots(a, x_shared(pairs, dtype, BLOCK_M, GPS), BLOCK_M, GPS, UPCAST_DOT)
        s8 = step_scales(s_ptr, s_idx, dtype, S_PAIRS, BLOCK_M, GPS)
        acc += s8 * dots + step_zero_terms(pairs, z_ptr, s_idx, s8, dtype, 1.0 / U_INV, M_ODD, BLOCK_M, GPS)
    if TRIGGER == 1:
        pdl.launch_dependents(PDL)  # the next kernel may start once every program is past its K loop
    if PRENORM:
        r = prenorm_finish(parts, norm_d, eps)
    else:
        r = tl.zeros((BLOCK_M,), dtype=tl.float32)  # unused
    # Fold the column blocks (groups; zero past GPS) into BLOCK_M columns.
    out = tl.sum(tl.reshape(acc, (BLOCK_N, 8 // BLOCK_M, BLOCK_M)), axis=1) * U_INV  # (BN, BM)
    finish(tl.trans(out), offs_m, cols, pid_n, pid_k, M, N, y_ptr, stride_ym, bias_ptr, ws_ptr, lock_ptr, SPLIT_K,
           res_ptr, g_ptr, xg_ptr, pout_ptr, r, HAS_BIAS, SPLIT, FENCE, BLOCK_M, BLOCK_N, EPI, PRENORM, rope, ROPE_D,
           SECOND)


@triton.jit
def _w4a16_gemv_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr, res_ptr, g_ptr, xg_ptr,
                           pout_ptr, pin_ptr, NP_IN, norm_d, eps, M, N, stride_xm,
                           stride_ym, K8, NG, W_SPLIT, SPLIT_K, BLOCK_M: tl.constexpr,
                           HAS_BIAS: tl.constexpr, UNPACK: tl.constexpr, S_PAIRS: tl.constexpr,
                           FENCE: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
                           SPLIT: tl.constexpr, STAGES: tl.constexpr, GPS: tl.constexpr, EPI: tl.constexpr,
                           PRENORM: tl.constexpr, NPB: tl.constexpr, WRAP: tl.constexpr, TRIGGER: tl.constexpr,
                           PDL: tl.constexpr):
    # x_ptr: x viewed as int32 pairs (stride_xm in pairs). GPS groups per K step (GPS BM <= 8): a row's 64 GPS
    # bytes are contiguous, so each step reads longer runs and the per-step costs (pipeline barriers, B through
    # shared memory) are paid once per GPS groups. BLOCK_N / (16 num_warps) 16-row tiles per warp share the B a
    # warp reads. One (row block, K split) tile per program: a persistent form was slower (docs/perf_notes.md).
    # PDL: wait first; TRIGGER: the next kernel may start 0 at once, 1 after this program's K loop, 2 at its end.
    pdl.wait(PDL)
    if TRIGGER == 0:
        pdl.launch_dependents(PDL)
    mma_tile(tl.program_id(0), tl.program_id(1), x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr,
             res_ptr, g_ptr, xg_ptr, pout_ptr, pin_ptr, NP_IN, norm_d, eps,
             M, N, stride_xm, stride_ym, K8, NG, W_SPLIT, SPLIT_K, BLOCK_M, HAS_BIAS, UNPACK, S_PAIRS, FENCE,
             UPCAST_DOT, BLOCK_N, SPLIT, STAGES, GPS, EPI, PRENORM, NPB, WRAP, TRIGGER, PDL)
    if TRIGGER == 2:
        pdl.launch_dependents(PDL)


# -- configs and launcher ----------------------------------------------------------------------------------
# A config: {"kernel": "mma" | "fma", "num_warps", "STAGES" (K steps in flight), "SPLIT_K" (programs per row block),
# ...}. "mma": "BLOCK_N" rows per program (a multiple of 16 num_warps: 16-row tiles per warp; default 16 num_warps),
# "GPS" groups of 128 per K step (capped to 8 / BLOCK_M and to a power of two dividing K / 128), "TRIGGER" (below),
# "maxnreg" (ptxas's register cap: <= 168 lets 3 programs of 4 warps share an SM; slower so far).
# "fma": BLOCK_N rows x BLOCK_W words per tile (a warp covers 128 / BLOCK_W rows x BLOCK_W words with 16-byte loads;
# a thread holds BLOCK_N BLOCK_W / (128 num_warps) rows of one 32-value chunk per tile).
INTERPRET_CONFIG = {"kernel": "fma", "BLOCK_N": 16, "BLOCK_W": 16, "num_warps": 4, "STAGES": 1, "SPLIT_K": 1}
INTERPRET_MMA_CONFIG = {"kernel": "mma", "num_warps": 4, "STAGES": 1, "SPLIT_K": 1, "GPS": 2}
CONFIG_KEYS = {"mma": ("BLOCK_N", "num_warps", "STAGES", "SPLIT_K", "GPS", "TRIGGER", "maxnreg"),
               "fma": ("BLOCK_N", "BLOCK_W", "num_warps", "STAGES", "SPLIT_K")}
KERNELS = ("auto", "mma", "fma")  # the `kernel` argument: the table's / rule's choice, or that form where it fits
N_SM = 132  # H200; the split rule only needs the order of magnitude


def mma_ok(K: int, G: int) -> bool:
    """Shapes the tensor-core kernel takes: groups of 128 (one dot each)."""
    return G == 128 and K % 128 == 0


def groups_per_step(gps: int, n_groups: int) -> int:
    """The largest power of two <= gps that divides the group count, so every K range is whole steps."""
    gps = 1 << (max(gps, 1).bit_length() - 1)
    while n_groups % gps:
        gps //= 2
    return gps


def _pairs_view(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) 16-bit as int32 (M, K/2): two consecutive k per element (a copy if rows are not 4-byte aligned)."""
    if x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.clone(memory_format=torch.contiguous_format)  # fresh storage: aligned, row stride K (even)
    return x.view(torch.int32)


# (BLOCK_M = next_pow2(M), N, K) -> config, for group 128: the fastest of the H200 sweep (TINYVILA_W4_SWEEP prints
# this dict), graph-replayed with PDL on; times: docs/benchmarks.md.
GEMV_TABLE: dict[tuple[int, int, int], dict] = {
    (1, 4096, 4096): {"kernel": "mma", "BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "SPLIT_K": 1, "GPS": 8},
    (1, 4096, 14336): {"kernel": "mma", "BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "SPLIT_K": 2, "GPS": 8},
    (1, 6144, 4096): {"kernel": "mma", "BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "SPLIT_K": 1, "GPS": 8},
    (1, 28672, 4096): {"kernel": "mma", "BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "SPLIT_K": 1, "GPS": 8},
}


# When the mma kernel lets the next kernel of a PDL chain start (csrc_triton/pdl.py): 0 at once, 1 after the K loop,
# 2 at the end (config key TRIGGER overrides; SILU_TRIGGER for the SwiGLU form). The SwiGLU GEMV triggers late:
# at once, the down GEMV's programs took SM slots early and the step was slower (docs/perf_notes.md).
TRIGGER = 0
SILU_TRIGGER = 1


def gemv_config(M: int, N: int, K: int, G: int, kernel: str = "auto") -> dict:
    """The GPU launch config of an (M, K) x (N, K)^T call: GEMV_TABLE's entry, else a rule from that sweep: 64-row
    programs of 4 warps, 8 groups per K step, split-K doubling while the grid stays within one program per SM and
    every split keeps >= 4 K steps. kernel: "auto" (the table's or rule's form), "mma" (where mma_ok) or "fma"."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    key = (triton.next_power_of_2(M), N, K)
    if G == 128 and key in GEMV_TABLE and kernel in ("auto", GEMV_TABLE[key]["kernel"]):
        return dict(GEMV_TABLE[key])
    if mma_ok(K, G) and kernel != "fma":
        warps, block_n, stages = 4, 64, 3
        gps = groups_per_step(8, K // G)
        steps = K // G // gps
        row_blocks, split = triton.cdiv(N, block_n), 1
        while row_blocks * split * 2 <= N_SM and steps >= 4 * 2 * split:
            split *= 2
        return {"kernel": "mma", "BLOCK_N": block_n, "num_warps": warps, "STAGES": stages, "SPLIT_K": split,
                "GPS": gps}
    R = 4 if M <= 2 else (2 if M <= 4 else 1)  # fp32 rows per thread; v stays live across the M rows
    return {"kernel": "fma", "BLOCK_N": 4 * R, "BLOCK_W": 128, "num_warps": 4, "STAGES": 4, "SPLIT_K": 1}


_SPLIT_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown workspaces: CUDA graphs captured earlier still point at them
MAX_ROW_BLOCKS = 1 << 16  # arrival counters per device: one per row block of one call


def _split_buffers(device: torch.device, ws_numel: int, row_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device fp32 partials workspace (grown, never shrunk) and int32 arrival counters (zeroed once; every
    call leaves them at zero). Shared by all calls on the device: GEMVs on one stream at a time."""
    if row_blocks > MAX_ROW_BLOCKS:
        raise ValueError(f"{row_blocks} row blocks exceed MAX_ROW_BLOCKS={MAX_ROW_BLOCKS}; use larger row tiles")
    ws, locks = _SPLIT_BUFFERS.get(device, (None, None))
    if ws is None or ws.numel() < ws_numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("w4a16_gemv's split-K workspace must grow before CUDA-graph capture: "
                               "run the same call once eagerly first")
        if ws is not None:
            _RETIRED.append(ws)  # never freed: a captured decode step may replay with its address
        ws = torch.empty(max(ws_numel, 1 << 20), dtype=torch.float32, device=device)
        locks = locks if locks is not None else torch.zeros(MAX_ROW_BLOCKS, dtype=torch.int32, device=device)
        _SPLIT_BUFFERS[device] = (ws, locks)
    return ws, locks


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               config: dict | None = None, unpack: int | None = None,
               prenorm: tuple[torch.Tensor, float] | None = None, kernel: str = "auto",
               pdl: bool = True) -> torch.Tensor:
    """(M, K) x packed (N, K) W4 -> (M, N) in x's dtype, M <= 8. `config` pins a launch config (default
    gemv_config(..., kernel) on the GPU, the INTERPRET configs elsewhere); `unpack`: 1 PTX (GPU default), 0 plain
    shifts and masks (the interpreter's). prenorm (part, eps): x is gamma * h, an RMSNorm's input times its weight
    but not yet normalised, and part (NP, 8) fp32 holds the sums of h^2 of row m in column m over NP blocks of h's
    columns (what w4a16_gemv_norm writes); y = rsqrt(mean(h^2) + eps) * (x W^T) + bias, the normalisation applied
    to the product instead of to x (one rounding of x less than the norm's own output would carry).
    kernel: the inner form when no config is pinned (gemv_config). pdl: programmatic dependent launch (pdl.py)."""
    y, = launch_gemv(x, qweight, scales, zeros, bias, out, config, unpack, prenorm, kernel=kernel, pdl=pdl)
    return y


def default_config(x: torch.Tensor, M: int, N: int, K: int, G: int, kernel: str = "auto") -> dict:
    """The config when none is pinned: gemv_config on the GPU, else the interpreter's (mma where mma_ok, not "fma")."""
    if x.is_cuda and not INTERPRET:
        return gemv_config(M, N, K, G, kernel)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return INTERPRET_MMA_CONFIG if mma_ok(K, G) and kernel != "fma" else INTERPRET_CONFIG


def launch_gemv(x, qweight, scales, zeros, bias, out, config, unpack, prenorm, residual=None, gamma=None, *,
                silu: bool = False, rope: tuple | None = None, kernel: str = "auto",
                pdl: bool = True) -> tuple[torch.Tensor, ...]:
    """The launcher of w4a16_gemv (-> (y,)) and its fused forms: w4a16_gemv_norm (residual, gamma: -> (h, xg, part)),
    w4a16_gemv_silu (silu: out is (M, N / 2)), w4a16_gemv_rope (rope = (kernel entry, its arguments after the plain
    kernel's, its extra constexprs): out is q (B, H, T, D), checked by the caller)."""
    M, N, K, G = check_w4_args(x, qweight, scales, zeros, bias)
    if M > MAX_M:
        raise ValueError(f"w4a16_gemv takes at most {MAX_M} rows, got {M}; use w4a16_gemm")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif rope is None and (out.shape != (M, N // 2 if silu else N) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be ({M}, {N}) {x.dtype} with unit stride along N")
    K8 = K // 8
    if N * K8 >= 2**31:
        raise ValueError(f"qweight with {N * K8} words exceeds the kernel's int32 offsets")
    on_gpu = x.is_cuda and not INTERPRET
    if unpack is None:
        unpack = 1 if on_gpu else 0
    if unpack == 1 and not on_gpu:
        raise ValueError("unpack=1 (inline PTX) needs a GPU outside TRITON_INTERPRET; use unpack=0")
    if config is None:
        config = default_config(x, M, N, K, G, kernel)
    cfg = dict(config)
    form = cfg.pop("kernel", "fma")
    if rope is not None and form != "mma":
        raise ValueError("the RoPE epilogue needs the mma kernel")
    if form == "mma" and not mma_ok(K, G):
        raise ValueError(f"the mma kernel needs G == 128 and K % 128 == 0 (G={G}, K={K})")
    unknown = set(cfg) - set(CONFIG_KEYS[form])
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)} for the {form} kernel; use {CONFIG_KEYS[form]}")
    s_pairs = (K // G) % 2 == 0 and scales.data_ptr() % 4 == 0  # 4-byte scale loads (see load_scales)
    # Split K into SPLIT_K ranges of whole tiles (none empty: the split count shrinks for short K).
    if form == "mma":
        # GPS groups per step, each in BM of the dots' 8 columns (GPS BM <= 8); pairs of scales per load.
        gps = min(cfg.get("GPS", 1), 8 // triton.next_power_of_2(M)) if s_pairs else 1
        cfg["GPS"] = groups_per_step(gps, K // G)
        cfg["TRIGGER"] = int(cfg.get("TRIGGER", SILU_TRIGGER if silu else TRIGGER))
        if cfg["TRIGGER"] not in (0, 1, 2):
            raise ValueError(f"TRIGGER={cfg['TRIGGER']} must be 0, 1 or 2")
        bw = 16 * cfg["GPS"]  # one K step: GPS groups of 16 words
    else:
        bw = max(cfg["BLOCK_W"], G // 8)  # a tile holds whole groups
    w_split = triton.cdiv(triton.cdiv(K8, cfg.get("SPLIT_K", 1)), bw) * bw
    split = triton.cdiv(K8, w_split)
    cfg.pop("SPLIT_K", None)
    if form == "mma":
        cfg.setdefault("BLOCK_N", 16 * cfg["num_warps"])
        if cfg["BLOCK_N"] % (16 * cfg["num_warps"]):
            raise ValueError(f"mma BLOCK_N={cfg['BLOCK_N']} must be a multiple of 16 num_warps (16-row tiles per warp)")
    block_n = cfg["BLOCK_N"]
    row_blocks = triton.cdiv(N, block_n)
    ws, locks = _split_buffers(x.device, split * M * N, row_blocks) if split > 1 else (out, out)  # (unused if 1)
    # EPI 1 and PRENORM pointers: `out` when unused (never dereferenced: the constexpr switches remove their code).
    outputs: tuple[torch.Tensor, ...] = (out,)
    res = g = xg = pout = pin = out
    np_in, nd, eps = 1, float(K), 0.0
    if residual is not None:
        xg = torch.empty(M, N, dtype=x.dtype, device=x.device)
        pout = torch.empty(row_blocks, 8, dtype=torch.float32, device=x.device)
        res, g, outputs = residual, gamma, (out, xg, pout)
    if prenorm is not None:
        pin, eps = prenorm[0], float(prenorm[1])
        if pin.dtype != torch.float32 or pin.dim() != 2 or pin.shape[1] != 8 or not pin.is_contiguous():
            raise ValueError(f"prenorm's partial sums must be a contiguous (NP, 8) float32 tensor, got "
                             f"{tuple(pin.shape)} {pin.dtype}")
        if pin.device != x.device:
            raise ValueError("prenorm's partial sums must be on x's device")
        np_in = pin.shape[0]
    epi_args = (res, g, xg, pout, pin, np_in, nd, eps)
    meta = dict(BLOCK_M=triton.next_power_of_2(M), HAS_BIAS=bias is not None, UNPACK=unpack, S_PAIRS=s_pairs,
                FENCE=on_gpu, SPLIT=split > 1, EPI=3 if rope else 2 if silu else int(residual is not None),
                PRENORM=prenorm is not None,
                NPB=triton.next_power_of_2(np_in), **pdl_options(x.device, pdl))
    sc = scales.view(torch.int32) if s_pairs else scales
    b = bias if bias is not None else scales
    shape_args = (M, N)
    tail = (K8, K // G, w_split, split)
    if rope is not None:
        entry, rope_args, rope_meta = rope
        x32 = _pairs_view(x)
        entry[(row_blocks, split)](x32, qweight, sc, zeros, b, out, ws, locks, *epi_args, *shape_args, x32.stride(0),
                                   out.stride(0), *tail, *rope_args, **meta, UPCAST_DOT=not on_gpu,
                                   WRAP=N % block_n != 0, **rope_meta, **cfg)
    elif form == "mma":
        x32 = _pairs_view(x)  # x as int32 pairs: 4-byte elements, which Triton pipelines with cp.async
        _w4a16_gemv_mma_kernel[(row_blocks, split)](x32, qweight, sc, zeros, b, out, ws, locks, *epi_args,
                                                    *shape_args, x32.stride(0), out.stride(0), *tail, **meta,
                                                    UPCAST_DOT=not on_gpu, WRAP=N % block_n != 0, **cfg)
    else:
        cfg["BLOCK_W"] = bw
        even = N % cfg["BLOCK_N"] == 0 and K8 % bw == 0  # no masks needed
        _w4a16_gemv_fma_kernel[(row_blocks, split)](x, qweight, sc, zeros, b, out, ws, locks, *epi_args,
                                                    *shape_args, x.stride(0), out.stride(0), *tail,
                                                    (G // 8).bit_length() - 1, **meta, EVEN=even, **cfg)
    return outputs


def w4a16_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: torch.Tensor | None = None, prenorm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Reference: dequantize (rounded to x's dtype, as a dense checkpoint holds it) -> fp32 matmul (prenorm: times
    each row's rsqrt(sum_p part[p, m] / K + eps)) -> + bias -> cast."""
    w = dequantize_ref(qweight, scales, zeros).to(x.dtype).float()
    y = x.float() @ w.T
    if prenorm is not None:
        part, eps = prenorm
        y = y * torch.rsqrt(part.float().sum(0)[: x.shape[0]] / x.shape[1] + eps)[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
