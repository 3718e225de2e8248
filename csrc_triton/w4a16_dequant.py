"""W4 dequantization: packed (tinyvila/quant.py layout) -> dense (N, K) weight in fp16/bf16.

w[n, k] = q[n, k] * s[n, k // G] + b[n, k // G] in fp32, rounded once to the output dtype (what `_ref`,
tinyvila.quant.dequantize_w4 and a dense checkpoint hold). qweight int32 (N, K/8), nibble i of word j is
q[n, 8j + i]; scales (N, K/G) fp16/bf16; zeros fp32 (N, K/G). A program unpacks a (BLOCK_N, BLOCK_W)
word tile in registers (plain shifts and masks) and stores (BLOCK_N, 8 BLOCK_W) values with 16-byte stores.
Memory-bound (0.5 byte read, 2 bytes written per weight). Used by w4a16_gemm for long prompts (from
DEQUANT_MIN_M rows): one pass into a workspace reused across calls, then cuBLAS at full tensor-core rate.
"""

from __future__ import annotations

import torch

from ._common import INTERPRET, unpack_k_order
from ._triton import tl, triton
from .launch import Launch, Plans, tensor_key


@triton.jit
def _w4a16_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, K8, NG, G: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, UNPACK: tl.constexpr):
    BLOCK_K: tl.constexpr = BLOCK_W * 8
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_k * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_n.to(tl.int64)[:, None]
    n_mask = (offs_n < N)[:, None]
    words = tl.load(qw_ptr + rows * K8 + offs_w[None, :], mask=n_mask & (offs_w < K8)[None, :], other=0)
    q = unpack_k_order(words, UNPACK)  # (BN, BK) fp32
    NGT: tl.constexpr = BLOCK_K // G
    offs_g = pid_k * NGT + tl.arange(0, NGT)
    g_mask = n_mask & (offs_g < NG)[None, :]
    s = tl.load(s_ptr + rows * NG + offs_g[None, :], mask=g_mask, other=0).to(tl.float32)  # (BN, NGT)
    b = tl.load(z_ptr + rows * NG + offs_g[None, :], mask=g_mask, other=0.0)
    w = tl.reshape(q, (BLOCK_N, NGT, G)) * s[:, :, None] + b[:, :, None]
    w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(w_ptr.dtype.element_ty)
    tl.store(w_ptr + rows * K + offs_k[None, :], w, mask=n_mask & (offs_k < K)[None, :])


# Plans per distinct call (shapes, strides, dtypes, devices of every tensor, out's too): a long prefill makes the
# same few calls every layer, so each pays Triton's dispatch once (launch.py). A plan: (N, K, its launch).
_PLANS = Plans()


def _plan(qweight, scales, zeros, out) -> tuple[int, int, Launch]:
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous int32 (N, K/8) tensor, got {tuple(qweight.shape)} {qweight.dtype}")
    N, K = qweight.shape[0], qweight.shape[1] * 8
    if scales.dim() != 2 or scales.shape[0] != N or scales.shape[1] == 0 or K % scales.shape[1]:
        raise ValueError(f"scales must be (N, K/G) with N={N}, K={K}, got {tuple(scales.shape)}")
    if scales.dtype not in (torch.float16, torch.bfloat16) or zeros.dtype != torch.float32 or zeros.shape != scales.shape:
        raise ValueError("scales must be float16/bfloat16 and zeros float32 of the same (N, K/G) shape")
    G = K // scales.shape[1]
    if G % 8 or G > 128:
        raise ValueError(f"group size {G} not supported; use 32, 64 or 128")
    if out is not None and (out.shape != (N, K) or out.dtype != scales.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous ({N}, {K}) {scales.dtype} tensor")
    on_gpu = qweight.is_cuda and not INTERPRET
    BLOCK_N, BLOCK_W = (16, 64) if on_gpu else (8, 16)
    BLOCK_W = max(BLOCK_W, G // 8)  # a tile holds whole groups
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(K // 8, BLOCK_W))
    return N, K, Launch(_w4a16_dequant_kernel, grid, (N, K, K // 8, K // G),
                        dict(G=G, BLOCK_N=BLOCK_N, BLOCK_W=BLOCK_W, UNPACK=1 if on_gpu else 0, num_warps=4))


def w4a16_dequant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *,
                  out: torch.Tensor | None = None, direct: bool = True) -> torch.Tensor:
    """Packed W4 -> dense (N, K) in the scales' dtype. `out` (N, K) contiguous may be a reused workspace.
    direct: after the first launch, skip Triton's dispatch (csrc_triton/launch.py)."""
    key = (tensor_key(qweight), tensor_key(scales), tensor_key(zeros), tensor_key(out), INTERPRET)
    N, K, launch = _PLANS.get_or_build(key, lambda: _plan(qweight, scales, zeros, out))
    if out is None:
        out = torch.empty(N, K, dtype=scales.dtype, device=qweight.device)
    launch(qweight, scales.contiguous(), zeros.contiguous(), out, direct=direct)
    return out


def w4a16_dequant_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Reference: unpack, w = q * s + b in fp32, round to the scales' dtype."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight[..., None] >> shifts) & 0xF).reshape(qweight.shape[0], -1).float()  # (N, K)
    G = q.shape[1] // scales.shape[1]
    w = q * scales.float().repeat_interleave(G, dim=1) + zeros.repeat_interleave(G, dim=1)
    return w.to(scales.dtype)
