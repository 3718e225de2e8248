"""Per-token dynamic int8 quantization, (M, K) float -> (M, K) int8 + (M,) fp32 scales.

Per row (token), in fp32:  amax = max(max|x|, 1e-5);  scale = amax / 127;
q = clamp(round_half_even(x * (127 / amax)), -127, 127)   (127 / amax correctly rounded, like torch).
So q * scale ~= x with |error| <= scale / 2, and the row's largest |x| maps to +-127 (symmetric:
-128 is never produced). Rounding is half-to-even, i.e. torch.round; `_row_scales` + `_store_q` are
the shared device functions that the fused LayerNorm+quant and GELU+quant kernels end with, so
every producer of int8 activations rounds identically. x: fp16/bf16/fp32, last dim contiguous. Used for the input of
the attention output projection (wo); each program holds whole rows in registers (K <= 16384), as a
power-of-two head plus a tail block (`_row_block`). K is a compile-time constant (a few widths per model).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 16384  # a row lives in registers; far above any ViT width (so400m MLP: 4304)


@triton.jit
def _quantize_int8(v):
    """fp32 values already scaled by 127 / amax -> int8 clamp(round_half_even(v), -127, 127).

    Clamping first keeps |v| < 2**22 and keeps the caller's multiply from being contracted into the
    add below (an FMA would round the unrounded product: another result at near-ties). Adding
    1.5 * 2**23 rounds to an integer, half to even, in fp32 (the spacing there is exactly 1) and
    leaves that integer in two's complement in the low mantissa bits, so the low byte is the int8:
    no float->int conversion instruction, which runs at 1/8 of the FMA rate on NVIDIA GPUs.
    """
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    return (v + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def _row_block(ptr, rows, stride, M, K: tl.constexpr, START: tl.constexpr, BLOCK: tl.constexpr):
    """Columns START .. START + BLOCK of `rows` (ROWS,) as fp32 (ROWS, BLOCK), zeros outside the
    matrix; with its mask and column offsets (BLOCK,)."""
    offs = START + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (offs[None, :] < K)
    x = tl.load(ptr + rows[:, None] * stride + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, mask, offs


@triton.jit
def _row_scales(amax):
    """Row max (ROWS,) -> (127 / amax, amax / 127) with amax clamped to 1e-5; IEEE divisions, as torch."""
    amax = tl.maximum(amax, 1e-5)
    return (tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), amax),
            tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)))


@triton.jit
def _per_row(v, ROWS: tl.constexpr):
    """A per-row value ready to broadcast against (ROWS, BLOCK) tiles: (ROWS, 1), or the scalar itself when
    ROWS == 1 (see _rsum)."""
    if ROWS == 1:
        return v
    else:
        return v[:, None]


@triton.jit
def _rsum(x, ROWS: tl.constexpr):
    """Row sums of (ROWS, BLOCK): (ROWS,), or a scalar when ROWS == 1 (the GPU launch). A head and a tail block
    have different layouts, so their (ROWS,) results do too, and Triton converts between them through shared
    memory and shuffles wherever they meet (sm_90a, layer_norm_quant K = 1152: ~150 of 830 instructions); a
    scalar broadcasts into any layout as it is."""
    if ROWS == 1:
        return tl.sum(x)
    else:
        return tl.sum(x, axis=1)


@triton.jit
def _rmax_abs(x, ROWS: tl.constexpr):
    """Row maxima of |x| (ROWS, BLOCK): (ROWS,), or a scalar when ROWS == 1 (see _rsum)."""
    if ROWS == 1:
        return tl.max(tl.abs(x))
    else:
        return tl.max(tl.abs(x), axis=1)


@triton.jit
def _store_q(y, mask, offs, rows, q_ptr, stride_qm, inv, ROWS: tl.constexpr):
    """Quantized fp32 rows y (ROWS, BLOCK) * inv (per row: _per_row's forms) stored as int8 at columns `offs`."""
    tl.store(q_ptr + rows[:, None] * stride_qm + offs[None, :], _quantize_int8(y * _per_row(inv, ROWS)), mask=mask)


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, scale_ptr, M, stride_xm, stride_qm, K: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    # A row is a power-of-two head of BLOCK_K columns plus a tail block (BLOCK_T > 0) when K is not
    # a power of two (1152 = 1024 + 128): no lanes idle on padding (next_pow2(1152) = 2048 would
    # leave 44% of them computing nothing; the row kernels are instruction-bound, docs/perf_notes.md).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    x, mask, offs = _row_block(x_ptr, rows, stride_xm, M, K, 0, BLOCK_K)
    amax = _rmax_abs(x, ROWS)  # (ROWS,), a scalar when ROWS == 1
    if BLOCK_T > 0:
        xt, mask_t, offs_t = _row_block(x_ptr, rows, stride_xm, M, K, BLOCK_K, BLOCK_T)
        amax = tl.maximum(amax, _rmax_abs(xt, ROWS))
    inv, scale = _row_scales(amax)
    _store_q(x, mask, offs, rows, q_ptr, stride_qm, inv, ROWS)
    if BLOCK_T > 0:
        _store_q(xt, mask_t, offs_t, rows, q_ptr, stride_qm, inv, ROWS)
    tl.store(scale_ptr + rows, scale, mask=rows < M)


def _row_meta(K: int, device: torch.device, split: bool | None = None) -> dict:
    """ROWS per program, BLOCK_K (a power of two <= K) + BLOCK_T (the tail's power of two, 0 if
    none), num_warps of the row kernels. split=False: one next_pow2(K) block; None: the default (split)."""
    narrow = K <= 2048
    split = True if split is None else split
    head = 1 << (K.bit_length() - 1) if split else triton.next_power_of_2(K)
    tail = triton.next_power_of_2(K - head) if K > head else 0
    if device.type == "cuda":
        # One row per program: many small programs per SM hide the load -> reduce -> store latency
        # chain (the H200 sweep, docs/perf_notes.md W2). These kernels are instruction-bound, not
        # memory-bound (sm_90 SASS, K=1152: 4 warps a row cost 2.6x the warp-instructions of one warp,
        # in cross-warp reductions and per-thread overhead), so a row of <= 2048 gets one warp. Wide
        # rows (gelu_quant's 4304) get 4 warps (one warp would need 255 registers). Every row is a
        # head + tail (4304 = 4096 + 256, 208 of it live), no padded next_pow2 block: with K a constant
        # the compiler drops only part of a padded block's dead lanes (sm_90a, 4 warps, K=4304: 48 of 64
        # elements a thread computed; head + tail: 34), and the instruction count per element falls for
        # all three row kernels (gelu_quant, layer_norm_quant, quant_per_token; scripts/benches/w8a8.py
        # --offline-rows). TINYVILA_W8A8_ROW_SWEEP measures the alternatives.
        return dict(ROWS=1, BLOCK_K=head, BLOCK_T=tail, num_warps=1 if narrow else (4 if head <= 8192 else 8))
    # The interpreter's cost is per program: ~8K elements a program keeps CPU tests fast.
    rows = 1 << (max(1, min(64, 8192 // (head + tail))).bit_length() - 1)  # a power of two
    return dict(ROWS=rows, BLOCK_K=head, BLOCK_T=tail, num_warps=min(16, max(1, rows * head // 512)))


def _launch_rows(x: torch.Tensor, name: str, meta: dict | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Shared checks/allocation of the row-wise quantizing launchers: x (..., K) -> x2 (M, K),
    q (M, K) int8, scale (M,) fp32, launch kwargs (`meta` overrides ROWS / num_warps, and SPLIT=False
    asks for one padded block; benchmarks)."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: x must be fp16, bf16 or fp32, got {x.dtype}")
    K = x.shape[-1]
    if not 0 < K <= MAX_K:
        raise ValueError(f"{name}: last dim {K} must be in 1..{MAX_K}")
    x2 = x.reshape(-1, K)  # (M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    return x2, q, scale, launch_meta(K, x.device, meta)


def launch_meta(K: int, device: torch.device, meta: dict | None = None) -> dict:
    """The row kernels' launch kwargs: `_row_meta`, overridden by `meta` (may hold SPLIT)."""
    meta = dict(meta or {})
    return {**_row_meta(K, device, meta.pop("SPLIT", None)), **meta}


def quant_per_token(x: torch.Tensor, meta: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float -> (q (..., K) int8, scale (...,) fp32), one scale per row."""
    x2, q, scale, meta = _launch_rows(x, "quant_per_token", meta)
    M = x2.shape[0]
    if M:
        _quant_per_token_kernel[(triton.cdiv(M, meta["ROWS"]),)](x2, q, scale, M, x2.stride(0), q.stride(0),
                                                                 K=x2.shape[1], **meta)
    return q.view(x.shape), scale.view(x.shape[:-1])


def quantize_rows_ref(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared per-row quantizer in plain PyTorch (fp32 in): the semantics of `_row_scales` + `_store_q`."""
    amax = y.abs().amax(-1).clamp(min=1e-5)  # (...,)
    inv = 127.0 / amax
    q = torch.round(y * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def quant_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch reference of `quant_per_token` (the CPU path)."""
    return quantize_rows_ref(x.float())
