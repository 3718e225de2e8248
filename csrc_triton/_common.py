"""Helpers shared by several kernels of csrc_triton; no kernel of its own.

The interpreter flag (read once, here), device capabilities and TMA alignment, the row-wise int8 quantizer that
quant_per_token, layer_norm_quant and gelu_quant end with, the packed-W4 argument checks, unpacking and dense
reference of the W4A16 kernels, the argument checks of rope_qkv (and its fused qkv GEMV), and the plain PyTorch
W8A8 GEMM that both int8 GEMMs are checked against. Kernel files import shared pieces from here (or public helpers
of pdl.py, rounding.py, launch.py), never another kernel file's private names.
"""

from __future__ import annotations

import functools
import os

import torch

from ._triton import tl, triton

# -- the interpreter -------------------------------------------------------------------------------------------
# Triton reads TRITON_INTERPRET when a kernel is decorated, so the flag cannot change after import: read it once.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRET_JIT = tl.constexpr(INTERPRET)  # the same flag for @triton.jit bodies (they read constexpr globals only)


# -- devices ---------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def device_caps(index: int) -> tuple[int, int, int]:
    """(SM count, opt-in shared memory per block in bytes, compute capability major) of a GPU."""
    p = torch.cuda.get_device_properties(index)
    return p.multi_processor_count, getattr(p, "shared_memory_per_block_optin", 101376), p.major


def tma_aligned(*ts: torch.Tensor | None) -> bool:
    """Every tensor's base and row stride 16-byte aligned (what a TMA descriptor needs)."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in ts if t is not None)


# -- row-wise int8 quantization (quant_per_token, layer_norm_quant, gelu_quant) -----------------------------------
# Every producer of int8 activations ends with row_scales + store_q, so all of them round identically; a row
# lives in registers as a power-of-two head block plus a tail block (row_block, row_meta).
ROW_MAX_K = 16384  # a row lives in registers; far above any ViT width (so400m MLP: 4304)


@triton.jit
def quantize_int8(v):
    """fp32 values already scaled by 127 / amax -> int8 clamp(round_half_even(v), -127, 127).

    Clamping first keeps |v| < 2**22 and keeps the caller's multiply from being contracted into the add below (an
    FMA would round the unrounded product: another result at near-ties). Adding 1.5 * 2**23 rounds to an integer,
    half to even, in fp32 (the spacing there is exactly 1) and leaves that integer in two's complement in the low
    mantissa bits, so the low byte is the int8: no float->int conversion (1/8 of the FMA rate on NVIDIA GPUs).
    """
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    return (v + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def row_block(ptr, rows, stride, M, K: tl.constexpr, START: tl.constexpr, BLOCK: tl.constexpr):
    """Columns START .. START + BLOCK of `rows` (ROWS,) as fp32 (ROWS, BLOCK), zeros outside; + mask, offsets."""
    offs = START + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (offs[None, :] < K)
    x = tl.load(ptr + rows[:, None] * stride + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, mask, offs


@triton.jit
def row_scales(amax):
    """Row max (ROWS,) -> (127 / amax, amax / 127) with amax clamped to 1e-5; IEEE divisions, as torch."""
    amax = tl.maximum(amax, 1e-5)
    return (tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), amax),
            tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)))


@triton.jit
def per_row(v, ROWS: tl.constexpr):
    """A per-row value to broadcast against (ROWS, BLOCK) tiles: (ROWS, 1), or the scalar itself if ROWS == 1."""
    if ROWS == 1:
        return v
    else:
        return v[:, None]


@triton.jit
def rsum(x, ROWS: tl.constexpr):
    """Row sums of (ROWS, BLOCK): (ROWS,), or a scalar when ROWS == 1 (the GPU launch). A head and a tail block have
    different layouts, so their (ROWS,) results do too, and Triton converts between them through shared memory
    wherever they meet; a scalar broadcasts into any layout as it is (docs/perf_notes.md)."""
    if ROWS == 1:
        return tl.sum(x)
    else:
        return tl.sum(x, axis=1)


@triton.jit
def rmax_abs(x, ROWS: tl.constexpr):
    """Row maxima of |x| (ROWS, BLOCK): (ROWS,), or a scalar when ROWS == 1 (see rsum)."""
    if ROWS == 1:
        return tl.max(tl.abs(x))
    else:
        return tl.max(tl.abs(x), axis=1)


@triton.jit
def store_q(y, mask, offs, rows, q_ptr, stride_qm, inv, ROWS: tl.constexpr):
    """Quantized fp32 rows y (ROWS, BLOCK) * inv (per row: per_row's forms) stored as int8 at columns `offs`."""
    tl.store(q_ptr + rows[:, None] * stride_qm + offs[None, :], quantize_int8(y * per_row(inv, ROWS)), mask=mask)


def row_meta(K: int, device: torch.device, split: bool | None = None) -> dict:
    """ROWS per program, BLOCK_K (a power of two <= K) + BLOCK_T (the tail's power of two, 0 if none), num_warps of
    the row kernels. split=False: one next_pow2(K) block; None: the default (split)."""
    narrow = K <= 2048
    split = True if split is None else split
    head = 1 << (K.bit_length() - 1) if split else triton.next_power_of_2(K)
    tail = triton.next_power_of_2(K - head) if K > head else 0
    if device.type == "cuda":
        # One row per program (many small programs per SM hide the load -> reduce -> store chain). The kernels are
        # instruction-bound, so a row of <= 2048 gets one warp; wide rows (gelu_quant's 4304) get 4 (one warp would
        # need 255 registers). Every row is a head + tail, no padded next_pow2 block, whose dead lanes the compiler
        # drops only in part (docs/perf_notes.md; TINYVILA_W8A8_ROW_SWEEP measures the alternatives).
        return dict(ROWS=1, BLOCK_K=head, BLOCK_T=tail, num_warps=1 if narrow else (4 if head <= 8192 else 8))
    # The interpreter's cost is per program: ~8K elements a program keeps CPU tests fast.
    rows = 1 << (max(1, min(64, 8192 // (head + tail))).bit_length() - 1)  # a power of two
    return dict(ROWS=rows, BLOCK_K=head, BLOCK_T=tail, num_warps=min(16, max(1, rows * head // 512)))


def launch_meta(K: int, device: torch.device, meta: dict | None = None) -> dict:
    """The row kernels' launch kwargs: `row_meta`, overridden by `meta` (may hold SPLIT)."""
    meta = dict(meta or {})
    return {**row_meta(K, device, meta.pop("SPLIT", None)), **meta}


def launch_rows(x: torch.Tensor, name: str, meta: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Shared checks/allocation of the row-wise quantizing launchers: x (..., K) -> x2 (M, K), q (M, K) int8,
    scale (M,) fp32, launch kwargs (`meta` overrides ROWS / num_warps; SPLIT=False: one padded block)."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: x must be fp16, bf16 or fp32, got {x.dtype}")
    K = x.shape[-1]
    if not 0 < K <= ROW_MAX_K:
        raise ValueError(f"{name}: last dim {K} must be in 1..{ROW_MAX_K}")
    x2 = x.reshape(-1, K)  # (M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    return x2, q, scale, launch_meta(K, x.device, meta)


def quantize_rows_ref(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared per-row quantizer in plain PyTorch (fp32 in): the semantics of `row_scales` + `store_q`."""
    amax = y.abs().amax(-1).clamp(min=1e-5)  # (...,)
    inv = 127.0 / amax
    q = torch.round(y * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


# -- packed W4 weights (w4a16_gemv and its fused forms, w4a16_gemm, w4a16_dequant) --------------------------------
# Layout (tinyvila/quant.py): qweight int32 (N, K/8), nibble i of word j of row n is q[n, 8j + i]; scales (N, K/G)
# in the activation dtype; zeros fp32 (N, K/G); w = q * s + b.
GROUP_SIZES = (32, 64, 128)


def check_w4_args(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Validates a W4A16 call; returns (M, N, K, G). Shared by the GEMV and GEMM launchers."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be a 2-D float16/bfloat16 tensor, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride along K; call .contiguous() first")
    M, K = x.shape
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[1] * 8 != K:
        raise ValueError(f"qweight must be int32 (N, K/8) = (N, {K // 8}), got {tuple(qweight.shape)} {qweight.dtype}")
    N = qweight.shape[0]
    if scales.dim() != 2 or scales.shape[0] != N or scales.shape[1] == 0 or K % scales.shape[1]:
        raise ValueError(f"scales must be (N, K/G) with N={N}, K={K}, got {tuple(scales.shape)}")
    G = K // scales.shape[1]
    if G not in GROUP_SIZES:
        raise ValueError(f"group size {G} (K={K} / {scales.shape[1]} groups) not supported; use one of {GROUP_SIZES}")
    if scales.dtype != x.dtype:
        raise ValueError(f"scales dtype {scales.dtype} must equal the activation dtype {x.dtype}")
    if zeros.dtype != torch.float32 or zeros.shape != scales.shape:
        raise ValueError(f"zeros must be float32 {tuple(scales.shape)}, got {tuple(zeros.shape)} {zeros.dtype}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be ({N},) {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    tensors = [x, qweight, scales, zeros] + ([bias] if bias is not None else [])
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, qweight, scales, zeros and bias must be on one device")
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("qweight, scales and zeros must be contiguous")
    return M, N, K, G


# unpack_k_order (q in K order, as fp32) serves w4a16_dequant (the GEMVs: _w4a16_gemv_operands.py). Nibbles i and
# i+4 of a word sit at bits 4i and 4i+16, so one shift and one lop3 ((w & 0x000F000F) | 0x64006400) give the fp16
# pair (1024 + q_i, 1024 + q_{i+4}); subtracting 1024 in f16x2 is exact, and cvt.f32.f16 widens exactly.
_UNPACK_ASM = tl.constexpr("""{
.reg .b32 t, p, m, c;
.reg .b16 lo, hi;
mov.b32 m, 0x000F000F;
mov.b32 c, 0x64006400;
lop3.b32 p, $8, m, c, 0xEA;
sub.f16x2 p, p, c;
mov.b32 {lo, hi}, p;
cvt.f32.f16 $0, lo;
cvt.f32.f16 $4, hi;
shr.u32 t, $8, 4;
lop3.b32 p, t, m, c, 0xEA;
sub.f16x2 p, p, c;
mov.b32 {lo, hi}, p;
cvt.f32.f16 $1, lo;
cvt.f32.f16 $5, hi;
shr.u32 t, $8, 8;
lop3.b32 p, t, m, c, 0xEA;
sub.f16x2 p, p, c;
mov.b32 {lo, hi}, p;
cvt.f32.f16 $2, lo;
cvt.f32.f16 $6, hi;
shr.u32 t, $8, 12;
lop3.b32 p, t, m, c, 0xEA;
sub.f16x2 p, p, c;
mov.b32 {lo, hi}, p;
cvt.f32.f16 $3, lo;
cvt.f32.f16 $7, hi;
}""")


@triton.jit
def unpack_k_order(words, UNPACK: tl.constexpr):
    """(R, W) int32 packed words -> (R, 8 W) fp32 q values in K order (k = 8 * word + nibble)."""
    if UNPACK == 1:
        q0, q1, q2, q3, q4, q5, q6, q7 = tl.inline_asm_elementwise(
            _UNPACK_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        q0 = (words & 0xF).to(tl.float32)
        q1 = ((words >> 4) & 0xF).to(tl.float32)
        q2 = ((words >> 8) & 0xF).to(tl.float32)
        q3 = ((words >> 12) & 0xF).to(tl.float32)
        q4 = ((words >> 16) & 0xF).to(tl.float32)
        q5 = ((words >> 20) & 0xF).to(tl.float32)
        q6 = ((words >> 24) & 0xF).to(tl.float32)
        q7 = ((words >> 28) & 0xF).to(tl.float32)  # arithmetic shift: the mask drops the sign bits
    # interleave(a, b): a at even, b at odd positions of the last axis; three levels give position 8 j + i = nibble i
    # of word j, with each thread's values kept in its own registers.
    even = tl.interleave(tl.interleave(q0, q4), tl.interleave(q2, q6))
    odd = tl.interleave(tl.interleave(q1, q5), tl.interleave(q3, q7))
    return tl.interleave(even, odd)


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Packed W4 -> dense (N, K) fp32 weight, w = q * s + b in fp32 (tinyvila.quant.dequantize_w4's math)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight[..., None] >> shifts) & 0xF).reshape(qweight.shape[0], -1).float()  # (N, K)
    G = q.shape[1] // scales.shape[1]
    return q * scales.float().repeat_interleave(G, dim=1) + zeros.float().repeat_interleave(G, dim=1)


def w4a16_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W4 GEMMs' reference (w4a16_gemm, w4a16_gemm_wgmma): dequantize (rounded to x's dtype) -> fp32 matmul ->
    cast."""
    y = x.float() @ dequantize_ref(qweight, scales, zeros).to(x.dtype).float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# -- RoPE + KV-cache write (rope_qkv, w4a16_gemv_rope) -------------------------------------------------------------
def check_rope_qkv(qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads) -> int:
    """Validates rope_qkv's arguments (metadata only: no device sync); returns D. qkv may be a stand-in with the
    GEMV output's shape, dtype and device (the fused qkv GEMV checks before it computes qkv)."""
    if qkv.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"rope_qkv: qkv must be fp16 or bf16, got {qkv.dtype}")
    B, T, W = qkv.shape
    D, rem = divmod(W, n_heads + 2 * n_kv_heads)
    if rem or D % 2 or not 0 < D <= 1024:
        raise ValueError(f"rope_qkv: last dim {W} is not (n_heads + 2 n_kv_heads) x an even head dim <= 1024")
    if n_heads % n_kv_heads:
        raise ValueError(f"rope_qkv: n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (T, D) or t.dtype != qkv.dtype or t.stride(-1) != 1:
            raise ValueError(f"rope_qkv: {name} must be ({T}, {D}) {qkv.dtype} with a contiguous last dim, "
                             f"got {tuple(t.shape)} {t.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[:2] != (B, n_kv_heads) or c.shape[3] != D or c.dtype != qkv.dtype or c.stride(-1) != 1:
            raise ValueError(f"rope_qkv: {name} must be ({B}, {n_kv_heads}, S, {D}) {qkv.dtype}, last dim "
                             f"contiguous; got {tuple(c.shape)} {c.dtype}")
    if slots.shape != (T,) or slots.dtype.is_floating_point or slots.device != qkv.device:
        raise ValueError(f"rope_qkv: slots must be ({T},) integers on {qkv.device}, got {tuple(slots.shape)} "
                         f"{slots.dtype} on {slots.device}")
    return D


# -- W8A8 GEMM reference (w8a8_gemm, w8a8_gemm_wgmma) --------------------------------------------------------------
def w8a8_ref(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch: exact int32 product (torch._int_mm on CPU, float64 elsewhere: both exact), then the kernels'
    fp32 epilogue (acc * a_scale[m] * b_scale[n] + bias[n] + residual, one rounding)."""
    if a.device.type == "cpu":
        acc = torch._int_mm(a, b.t())  # (M, N) int32; the CPU build has no shape limits
    else:
        acc = (a.double() @ b.double().t()).to(torch.int32)  # exact below 2**53
    out = acc.float() * a_scale.float()[:, None] * b_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()[None, :]
    if residual is not None:
        out = out + residual.float()
    return out.to(out_dtype)
