"""The single seam between the model code and the kernels.

Every attention, norm, activation and quantized linear of the models goes through a function here. On CUDA
these dispatch to `csrc_triton` kernels; everywhere else the kernels' plain PyTorch references run. Only this
module imports `csrc_triton`. Functions with a choice of form take the runtime `Options` (`opts=`, from the
calling module) and pass the kernel forms on to the launchers as arguments: no module state.

Numerics follow the HuggingFace reference models the checkpoints were trained with: RMSNorm in fp32
with the weight applied after casting back, attention softmax by SDPA.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from .cuda_graph import building
from .options import DEFAULT, Options


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, (..., D) -> (..., D). Statistics in fp32 (or wider) like HF LlamaRMSNorm."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _fused_kernels(x: torch.Tensor) -> bool:
    """The fused decoder kernels (add_rms_norm, rope_qkv, silu_mul) run on CUDA in fp16/bf16."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def _pdl(opts: Options) -> dict:
    """Launch arguments of a decode-step kernel: PDL and the direct launch, as the options say."""
    return {"pdl": opts.pdl, "direct": opts.direct_launch}


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 opts: Options = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused with the next RMSNorm: x, residual (..., D) -> (rms_norm(residual + x),
    residual + x); residual None -> (rms_norm(x), x). The sum is PyTorch's add bit for bit. One Triton
    launch on CUDA fp16/bf16 (weight in x's dtype); elsewhere exactly `residual + x`, then `rms_norm`."""
    if _fused_kernels(x) and weight.dtype == x.dtype:
        from csrc_triton.add_rms_norm import add_rms_norm as kernel

        return kernel(x, residual, weight, eps, **_pdl(opts))
    from csrc_triton.add_rms_norm import add_rms_norm_ref

    return add_rms_norm_ref(x, residual, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim, (..., D) -> (..., D)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The GELU variants of the supported encoders: "gelu" (erf), "gelu_tanh", "quick_gelu" (the same
    PyTorch expressions as the fused GELU+quant kernel's reference, defined once there)."""
    from csrc_triton.gelu_quant import gelu_ref

    return gelu_ref(x, kind)


def silu_mul(gate_up: torch.Tensor, *, opts: Options = DEFAULT) -> torch.Tensor:
    """SwiGLU on the fused gate/up projection: (..., 2F) -> (..., F) = silu(gate) * up, PyTorch's
    rounding (silu, then the product, each rounded to the dtype). Kernel on CUDA fp16/bf16."""
    if _fused_kernels(gate_up):
        from csrc_triton.silu_mul import silu_mul as kernel

        return kernel(gate_up, **_pdl(opts))
    from csrc_triton.silu_mul import silu_mul_ref

    return silu_mul_ref(gate_up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF Llama layout: dim d pairs with d + D/2).

    x: (B, H, T, D); cos, sin: (T, D) or (B, 1, T, D), in x's dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, n_heads: int, n_kv_heads: int,
             second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
             opts: Options = DEFAULT) -> torch.Tensor:
    """The fused q/k/v projection's output qkv (B, T, (H + 2 Hkv) D) -> rotated q (B, H, T, D); rotated k
    and raw v are written into k_cache, v_cache (B, Hkv, S, D) at sequence slots `slots` (T,) (a device
    tensor: graph-capturable; the caller checks the bounds), and into `second` = (k2, v2, slots2), e.g.
    the packed decode buffer, when given. cos, sin: (T, D) in qkv's dtype; `rope`'s rounding. One
    Triton launch on CUDA fp16/bf16 (q contiguous); elsewhere the unfused reference, whose q is the
    transposed-layout result of `rope` (the same values)."""
    if _fused_kernels(qkv):
        from csrc_triton.rope_qkv import rope_qkv as kernel

        return kernel(qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads, second=second, **_pdl(opts))
    from csrc_triton.rope_qkv import rope_qkv_ref

    return rope_qkv_ref(qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads, second=second)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              q_start: int = 0) -> torch.Tensor:
    """Softmax attention with GQA, (B, H, T, D) x (B, Hkv, S, D) -> (B, H, T, D).

    `causal`: query row t sits at absolute position q_start + t and sees keys 0..q_start + t
    (S = q_start + T when prefilling against a cache). Non-causal (vision) sees all S keys.
    """
    n_rep = q.shape[1] // k.shape[1]
    T, S = q.shape[2], k.shape[2]
    if causal and S == q_start + T and _flash_ok(q) and (q_start > 0 or T < SDPA_SQUARE_MIN_T):
        # Causal rows over a cache (a question, a prefill chunk, a short first turn): one flash call, GQA
        # in the kernel (cached K/V never expanded), no (T, S) mask (see _attention_lse_flash).
        return _attention_lse_flash(q, k, v, q_start)[0]
    if n_rep > 1:  # GQA: each KV head serves n_rep consecutive query heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    if not causal:
        return F.scaled_dot_product_attention(q, k, v)
    if q_start == 0 and T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    q_pos = torch.arange(q_start, q_start + T, device=q.device)
    mask = torch.arange(S, device=q.device)[None, :] <= q_pos[:, None]  # (T, S) True = attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# Square causal attention (a first turn over an empty cache) from this many rows on goes to SDPA with K/V expanded
# per query head, where PyTorch picks cuDNN, which beats the one flash call there from about 1K rows on (measured
# on the H200, docs/perf_notes.md). Rows over a cache prefix always take the flash call.
SDPA_SQUARE_MIN_T = 1024


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def prefill_salience(q: torch.Tensor, k: torch.Tensor, *, n_query: int | None = None,
                     lse: torch.Tensor | None = None, opts: Options = DEFAULT) -> torch.Tensor:
    """Mean attention each key receives over the first n_query rows (default all) and all heads:
    q (B, H, T, Dh), k (B, H, N, Dh) -> (B, N) fp32. `lse` (B, H, n_query) fp32, the attention's own
    natural-log row normaliser, saves the kernel one QK^T pass. Kernel on CUDA, reference elsewhere."""
    if q.is_cuda:
        from csrc_triton.prefill_salience import prefill_salience as kernel

        return kernel(q, k, n_query=n_query, lse=lse, direct=opts.direct_launch)
    from csrc_triton.prefill_salience import prefill_salience_ref

    return prefill_salience_ref(q, k, n_query=n_query)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Non-causal attention (the vision salience layer), (B, H, T, D) -> o (B, H, T, D) and each row's
    natural-log LSE (B, H, T) fp32, which `prefill_salience` reuses (one QK^T pass saved). On CUDA
    fp16/bf16: PyTorch's flash kernel, the one SDPA picks there, with its LSE. Elsewhere: `attention`
    and None: the CPU salience reference needs no LSE, and the output stays exactly the plain path's."""
    if _flash_ok(q):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False)[:2]
    return attention(q, k, v, causal=False), None


def dense_linear(x: torch.Tensor, weight: torch.Tensor, *, opts: Options = DEFAULT) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T without bias, for the output layer: (..., K) -> (..., N) in x's dtype.
    On CUDA fp16/bf16 with at most GEMV_MAX_M rows (decode) the Triton GEMV of csrc_triton/dense_gemv
    (graph-capturable, fp32 accumulation; measured against cuBLAS in docs/benchmarks.md), else F.linear."""
    x2 = x.reshape(-1, x.shape[-1])
    if (opts.dense_gemv and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and x2.shape[0] <= GEMV_MAX_M and weight.stride(-1) == 1):
        from csrc_triton.dense_gemv import dense_gemv

        return dense_gemv(x2.contiguous(), weight, pdl=opts.pdl).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def argmax_step(logits: torch.Tensor, token: torch.Tensor, out: torch.Tensor, count: torch.Tensor,
                steps: torch.Tensor, lengths: torch.Tensor, *, opts: Options = DEFAULT) -> None:
    """The tail of a greedy decode step, in place: i = argmax(logits) (torch.argmax's first maximal index, NaN
    counting as maximal) becomes the next input token (one int64) and out[count] (out (R,) int64, count one int64
    in 0..R-1); then count, steps (S,) int64 and lengths (B,) int32 each += 1. On CUDA:
    csrc_triton/argmax.argmax_step, two launches doing all of it (graph-capturable; PyTorch's one-stage argmax of
    the 128256 Llama-3 logits alone took 27.5 us of a ~2.6 ms step on the H200); elsewhere its PyTorch
    reference (those six ops)."""
    if logits.is_cuda and logits.dim() == 1 and logits.is_floating_point() and logits.stride(0) == 1:
        from csrc_triton.argmax import argmax_step as kernel

        return kernel(logits, token, out, count, steps, lengths, pdl=opts.pdl)
    from csrc_triton.argmax import argmax_step_ref

    return argmax_step_ref(logits, token, out, count, steps, lengths)


GEMV_MAX_M = 8  # rows up to which the decode GEMVs (W4 and dense) take over from the GEMMs (they stream W once)


def w4_reference_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
                        ) -> torch.Tensor:
    """The dense (N, K) weights a W4 linear stands for, in `dtype`: w = q * s + b in fp32, rounded to `dtype` as a
    dense checkpoint would hold them."""
    from csrc_triton._common import dequantize_ref

    return dequantize_ref(qweight, scales, zeros).to(dtype)


# The int4 CPU matmul is 1.1-20x the reference path's speed up to 256 rows at SmolLM2's shapes, slower from ~1024.
CPU_INT4_MAX_M = 256


def w4_int4_fits(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether w4a16_linear may take x through PyTorch's packed-int4 CPU matmul (quant.int4pack_cpu): CPU fp16/bf16
    x of at most CPU_INT4_MAX_M rows, N a multiple of 16 (the packing's tile), and the op in this torch."""
    return (x.device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and x.dtype in (torch.float16, torch.bfloat16) and x.numel() <= CPU_INT4_MAX_M * x.shape[-1]
            and qweight.shape[0] % 16 == 0)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
                 opts: Options = DEFAULT, dense: torch.Tensor | None = None,
                 int4: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Linear with packed W4 weights (tinyvila/quant.py layout): (..., K) -> (..., N) in x's dtype.

    On CUDA: the Triton GEMV for at most GEMV_MAX_M rows (decode), the GEMM otherwise (prefill), which
    itself dispatches: the fused dequantizing kernel (fixed tiles per M bucket, no autotuning) below
    w4a16_gemm.DEQUANT_MIN_M rows, dequantize into a reused workspace + cuBLAS from there on.
    Elsewhere: the reference, w = q * s + b in fp32 rounded to x's dtype, then an fp32 matmul.
    norm (part, eps): x is an RMSNorm's weight * h, not yet normalised (decode_step.NormedRows.xg); each row's
    product is scaled by rsqrt(mean(h^2) + eps) from the partial sums `part`. Rows <= GEMV_MAX_M.
    dense: off CUDA, `w4_reference_weight(..., x.dtype)` kept by the caller (quant.W4A16Linear's cache,
    Options.w4_cpu_cache): the linear is then F.linear with those weights, bit for bit the dense model's linear (a
    few ulps from the fp32 reference, at the dense model's speed instead of dequantizing every weight every call).
    int4: where w4_int4_fits, quant.int4pack_cpu's form kept by the caller (Options.w4_cpu_int4): PyTorch's int4 CPU
    matmul in bf16 (x, scales, zeros and the product rounded to bf16, fp32 sums), the bias added in fp32.
    """
    if dense is not None and norm is None and not x.is_cuda:
        return F.linear(x, dense, bias)
    if int4 is not None and norm is None:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # (M, K); fp16 operands take the op's slow path
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, int4[0], x2.shape[1] // int4[1].shape[0], int4[1]).float()
        return (y if bias is None else y + bias.float()).to(x.dtype).reshape(*x.shape[:-1], -1)
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    if norm is not None and x2.shape[0] > GEMV_MAX_M:
        raise ValueError(f"w4a16_linear: norm= takes at most {GEMV_MAX_M} rows (the decode GEMV), got {x2.shape[0]}")
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        from csrc_triton.w4a16_gemm import w4a16_gemm
        from csrc_triton.w4a16_gemv import w4a16_gemv

        if x2.shape[0] <= GEMV_MAX_M:
            y = w4a16_gemv(x2.contiguous(), qweight, scales, zeros, bias, prenorm=norm, kernel=opts.w4_gemv_kernel,
                           pdl=opts.pdl)
        else:
            y = w4a16_gemm(x2.contiguous(), qweight, scales, zeros, bias, unpack=2 if opts.w4_gemm_pairs else None,
                           direct=opts.direct_launch, wgmma=opts.w4_gemm_wgmma and building())
    else:
        ct = torch.promote_types(x.dtype, torch.float32)  # fp32 math, or fp64 for a float64 model
        y = x2.to(ct) @ w4_reference_weight(qweight, scales, zeros, x.dtype).to(ct).T
        if norm is not None:
            part, eps = norm
            y = y * torch.rsqrt(part.to(ct).sum(0)[: x2.shape[0]] / x2.shape[1] + eps)[:, None]
        y = (y if bias is None else y + bias.to(ct)).to(x.dtype)
    return y.reshape(*x.shape[:-1], qweight.shape[0])


def w4a16_linear_norm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      bias: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                      norm: tuple[torch.Tensor, float] | None = None, opts: Options = DEFAULT
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A W4 linear whose output joins the residual stream, fused with the next RMSNorm's first half:
    y = w4a16_linear(x, ...), h = residual + y (PyTorch's add, bit for bit) -> (h, weight * h, part: the row
    sums of h^2 per block of columns, (NP, 8) fp32; decode_step.NormedRows), at most GEMV_MAX_M rows. One GEMV
    launch on CUDA fp16/bf16 (csrc_triton.w4a16_gemv_norm); elsewhere the same expressions in PyTorch."""
    x2 = x.reshape(-1, x.shape[-1])
    M, N = x2.shape[0], qweight.shape[0]
    if M > GEMV_MAX_M:
        raise ValueError(f"w4a16_linear_norm takes at most {GEMV_MAX_M} rows (the decode GEMV), got {M}")
    shape = (*x.shape[:-1], N)
    r2 = residual.reshape(M, N)
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        from csrc_triton.w4a16_gemv_norm import w4a16_gemv_norm

        h, xg, part = w4a16_gemv_norm(x2.contiguous(), qweight, scales, zeros, bias, r2.contiguous(), weight,
                                      prenorm=norm, kernel=opts.w4_gemv_kernel, pdl=opts.pdl)
    else:
        y = w4a16_linear(x2, qweight, scales, zeros, bias, norm=norm, opts=opts)
        h = (r2.float() + y.float()).to(x.dtype)
        xg = (weight.float() * h.float()).to(x.dtype)
        part = torch.zeros(1, 8, dtype=torch.float32, device=x.device)
        part[0, :M] = h.float().pow(2).sum(-1)
    return h.view(shape), xg.view(shape), part


def _epilogue_gemv_config(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, opts: Options
                          ) -> tuple[dict, int] | None:
    """(the W4 GEMV's launch config, group size) for x2 (M, K) when a fused-epilogue GEMV may run (CUDA
    fp16/bf16, at most GEMV_MAX_M rows, a valid group), else None: computed once and passed to the launcher."""
    M, K = x2.shape
    if not (x2.is_cuda and x2.dtype in (torch.float16, torch.bfloat16) and M <= GEMV_MAX_M and scales.dim() == 2
            and scales.shape[1] and K % scales.shape[1] == 0 and K // scales.shape[1] in (32, 64, 128)):
        return None
    from csrc_triton.w4a16_gemv import gemv_config

    G = K // scales.shape[1]
    return gemv_config(M, qweight.shape[0], K, G, kernel=opts.w4_gemv_kernel), G


def w4a16_linear_silu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      bias: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
                      opts: Options = DEFAULT) -> torch.Tensor:
    """silu_mul(w4a16_linear(x, ...)) for the fused gate/up projection [gate; up] (2F, K): (..., K) -> (..., F),
    the same bits. At decode row counts on CUDA one launch where the GEMV can end in SwiGLU
    (the mma kernel, no bias, Options.fused_silu), else the two ops."""
    x2 = x.reshape(-1, x.shape[-1])
    N, K = qweight.shape[0], x2.shape[1]
    fit = _epilogue_gemv_config(x2, qweight, scales, opts) if opts.fused_silu and bias is None else None
    if fit is not None:
        from csrc_triton.w4a16_gemv_silu import silu_ok, w4a16_gemv_silu

        cfg, G = fit
        if silu_ok(N, K, G, cfg):
            y = w4a16_gemv_silu(x2.contiguous(), qweight, scales, zeros, prenorm=norm, config=cfg, pdl=opts.pdl)
            return y.reshape(*x.shape[:-1], N // 2)
    return silu_mul(w4a16_linear(x, qweight, scales, zeros, bias, norm=norm, opts=opts), opts=opts)


def w4a16_linear_rope(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, n_heads: int, n_kv_heads: int, *,
                      second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      norm: tuple[torch.Tensor, float] | None = None, opts: Options = DEFAULT) -> torch.Tensor:
    """rope_qkv(w4a16_linear(x, ...), ...) for the fused qkv projection: x (B, T, K) -> rotated q (B, H, T, D), k and
    v stored as rope_qkv stores them; the same bits. On CUDA fp16/bf16 at decode row counts one launch where
    Options.fused_rope_gemv is on and the kernel allows (the mma kernel, half its row tile dividing D / 2),
    else the two ops."""
    B, T, K = x.shape
    N = qweight.shape[0]
    fit = (_epilogue_gemv_config(x.reshape(B * T, K), qweight, scales, opts)
           if opts.fused_rope_gemv and N % (n_heads + 2 * n_kv_heads) == 0 else None)
    if fit is not None:
        from csrc_triton.w4a16_gemv_rope import rope_ok, w4a16_gemv_rope

        cfg, G = fit
        D = N // (n_heads + 2 * n_kv_heads)
        if rope_ok(N, K, G, cfg, D):
            return w4a16_gemv_rope(x.reshape(B * T, K).contiguous(), qweight, scales, zeros, bias, cos, sin, k_cache,
                                   v_cache, slots, n_heads, n_kv_heads, second=second, prenorm=norm, config=cfg,
                                   pdl=opts.pdl)
    return rope_qkv(w4a16_linear(x, qweight, scales, zeros, bias, norm=norm, opts=opts), cos, sin, k_cache, v_cache,
                    slots, n_heads, n_kv_heads, second=second, opts=opts)


# -- SparseVILA decode: prefill attention with LSE, retrieval salience, packing, decode attention --
def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention of T new rows at positions q_start.. over k, v (B, Hkv, q_start+T, D),
    also returning each row's natural-log log-sum-exp of its scaled logits: -> o (B, H, T, D),
    lse (B, H, T) fp32. On CUDA (fp16/bf16) PyTorch's flash kernel, which returns the LSE; else a
    reference in fp32 (or wider)."""
    if _flash_ok(q):
        return _attention_lse_flash(q, k, v, q_start)
    return _attention_lse_ref(q, k, v, q_start)


def _flash_ok(q: torch.Tensor) -> bool:
    """PyTorch's flash attention kernel takes these queries (CUDA, fp16/bf16, head dim % 8, <= 256)."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def _attention_lse_ref(q, k, v, q_start):
    B, H, T, D = q.shape
    wide = torch.promote_types(q.dtype, torch.float32)
    n_rep = H // k.shape[1]
    kr = k.to(wide).repeat_interleave(n_rep, dim=1)  # (B, H, S, D)
    s = (q.to(wide) @ kr.transpose(-1, -2)) * attention_scale(D)  # (B, H, T, S)
    visible = torch.arange(k.shape[2], device=q.device)[None, :] <= torch.arange(q_start, q_start + T, device=q.device)[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    lse = s.logsumexp(-1)  # (B, H, T)
    o = torch.exp(s - lse[..., None]) @ v.to(wide).repeat_interleave(n_rep, dim=1)
    return o.to(q.dtype), lse.float()


def _attention_lse_flash(q, k, v, q_start):
    """One call of PyTorch's flash kernel (torch.ops.aten._scaled_dot_product_flash_attention) for the T
    new rows over all q_start + T keys. Its causal mask is FlashAttention-2's, aligned bottom-right (row t
    sees keys <= t + S - T = q_start + t), which is this function's contract; F.scaled_dot_product_attention
    aligns is_causal top-left and refuses T != S on this backend, hence the direct call. GQA is native (the
    Hkv cached heads are read as they are, never expanded; checked against the fp32 reference on an H200 with
    torch 2.11 and by tests/test_cache_attention.py on any GPU). One call rather than two (cached prefix, then the
    new rows) merged by their LSEs: a follow-up question's prefill is host-bound on small ops."""
    if k.shape[2] != q_start + q.shape[2]:
        raise ValueError(f"attention over a cache: k/v hold {k.shape[2]} keys for {q.shape[2]} new rows at position "
                         f"{q_start}; pass the cache up to the last new row ({q_start + q.shape[2]} keys)")
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[:2]


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows, *, lse: bool = False,
                   opts: Options = DEFAULT) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal GQA attention of T rows at the slots of `rows` (kv_cache.RowsIndex: the start is a device value)
    over a whole cache layer k, v (1, Hkv, S, D), row t seeing slots 0..start + t -> o (1, H, T, D) and, with
    `lse`, each row's log-sum-exp (1, H, T) fp32 (else None). What a follow-up prefill's CUDA graph captures:
    no host value of the start is baked in.

    On CUDA fp16/bf16 (Options.split_rows_attention): csrc_triton.rows_attention, split over the keys, reading the
    used key count start + T from the device; else one call of PyTorch's varlen flash kernel given that count
    (`seqused_k`), whose causal mask aligns bottom-right to it, unsplit over the keys (generate's
    FOLLOWUP_GRAPH_MAX_KEYS). Elsewhere: the start is read back (a host sync: this path is never captured) and the
    rows go through `attention` / `attention_lse` over exactly those keys, as the eager prefill of those rows does."""
    T = q.shape[2]
    if _flash_ok(q) and q.shape[0] == 1:
        from csrc_triton.rows_attention import rows_attention, supports
        if opts.split_rows_attention and supports(q, k):
            return rows_attention(q, k, v, rows.keys, lse=lse)
        out = torch.ops.aten._flash_attention_forward(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), rows.cu_rows, rows.cu_keys, T,
            k.shape[2], 0.0, True, False, seqused_k=rows.keys)  # (T, H, D) views, strided as they lie
        return out[0].transpose(0, 1)[None], out[1][None] if lse else None  # lse (H, T): unpadded varlen layout
    n = int(rows.keys[0])
    k, v = k[:, :, :n], v[:, :, :n]
    if lse:
        return attention_lse(q, k, v, n - T)
    return attention(q, k, v, causal=True, q_start=n - T), None


def retrieval_salience(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor | range, lse: torch.Tensor,
                       out: torch.Tensor | None = None, *, opts: Options = DEFAULT) -> torch.Tensor:
    """Attention mass each retrievable cached slot idx (N,) (or a range of consecutive slots) receives from the question rows q
    (B, H, T, D) (post-RoPE) with their lse (B, H, T), summed per KV group -> (B, Hkv, N) fp32,
    accumulated into `out` when given. Kernel on CUDA, reference elsewhere."""
    if q.is_cuda:
        from csrc_triton.retrieval_salience import retrieval_salience as kernel

        return kernel(q, k, idx, lse, out=out, direct=opts.direct_launch)
    from csrc_triton.retrieval_salience import retrieval_salience_ref

    return retrieval_salience_ref(q, k, idx, lse, out=out)


def kv_pack(src, idx: torch.Tensor, dst, *, opts: Options = DEFAULT):
    """dst[..., :L, :] = src gathered at slots idx (..., Hkv, L) along the sequence dim; src, dst are
    (..., Hkv, S, D) tensors (e.g. every layer stacked) or (K, V) pairs packed together. Returns dst."""
    if (src[0] if isinstance(src, (tuple, list)) else src).is_cuda:
        from csrc_triton.kv_pack import kv_pack as kernel

        return kernel(src, idx, dst, direct=opts.direct_launch)
    from csrc_triton.kv_pack import kv_pack_ref

    return kv_pack_ref(src, idx, dst)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, *,
                     opts: Options = DEFAULT) -> torch.Tensor:
    """One query per sequence: q (B, H, D) over slots 0..lengths[b]-1 of k, v (B, Hkv, L, D) -> (B, H, D).
    `lengths` (B,) int32 lives on the device (graph-capturable). Split-K kernel on CUDA fp16/bf16."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from csrc_triton.decode_attention import decode_attention as kernel

        return kernel(q, k, v, lengths, pdl=opts.pdl)
    from csrc_triton.decode_attention import decode_attention_ref

    return decode_attention_ref(q, k, v, lengths)


# -- W8A8 vision linears: per-token int8 activations x per-channel int8 weights (tinyvila/quant.py) --
# Triton kernels on CUDA; the references (same rounding, exact int32 sums) elsewhere.
def quant_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) float -> (q (..., K) int8, scale (...,) fp32), symmetric per row, round half to even."""
    if x.is_cuda:
        from csrc_triton.quant_per_token import quant_per_token as kernel

        return kernel(x)
    from csrc_triton.quant_per_token import quant_per_token_ref

    return quant_per_token_ref(x)


def layer_norm_quant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm (fp32 math) fused with per-token int8 quantization: (..., K) -> (q, scale)."""
    if x.is_cuda:
        from csrc_triton.layer_norm_quant import layer_norm_quant as kernel

        return kernel(x, weight, bias, eps)
    from csrc_triton.layer_norm_quant import layer_norm_quant_ref

    return layer_norm_quant_ref(x, weight, bias, eps)


def gelu_quant(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU `kind` (as `gelu`) fused with per-token int8 quantization: (..., K) -> (q, scale)."""
    if x.is_cuda:
        from csrc_triton.gelu_quant import gelu_quant as kernel

        return kernel(x, kind)
    from csrc_triton.gelu_quant import gelu_quant_ref

    return gelu_quant_ref(x, kind)


def w8a8_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor, residual: torch.Tensor | None = None, *, opts: Options = DEFAULT) -> torch.Tensor:
    """int8 x (..., K) with scales (...,) times int8 weight (N, K) with fp32 scales (N,), + bias (N,)
    [+ residual (..., N)] -> (..., N) in bias's dtype. int32 accumulation, fp32 epilogue with the
    residual added before the one rounding (csrc_triton/w8a8_gemm.py)."""
    x2 = xq.reshape(-1, xq.shape[-1])  # (M, K)
    s2 = x_scale.reshape(-1)  # (M,)
    r2 = None if residual is None else residual.reshape(-1, weight.shape[0]).to(bias.dtype)  # (M, N)
    if xq.is_cuda:
        from csrc_triton.w8a8_gemm import w8a8_gemm

        y = w8a8_gemm(x2, weight, s2, weight_scale, bias, out_dtype=bias.dtype, residual=r2,
                      persistent=opts.w8a8_persistent, wgmma=opts.w8a8_wgmma)
    else:
        from csrc_triton.w8a8_gemm import w8a8_gemm_ref

        y = w8a8_gemm_ref(x2, weight, s2, weight_scale, bias, out_dtype=bias.dtype, residual=r2)
    return y.reshape(*xq.shape[:-1], weight.shape[0])


def attention_key_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                         keep: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention (as `attention`) that also hides the slots where keep (S,) bool is False;
    for permanent-pruning baselines (FastV-style), so a reference is all it needs."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    T, S = q.shape[2], k.shape[2]
    q_pos = torch.arange(q_start, q_start + T, device=q.device)
    mask = (torch.arange(S, device=q.device)[None, :] <= q_pos[:, None]) & keep[None, :]  # (T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
