"""The one definition of tinyvila's quantized weight formats.

W4 (LLM linears, W4A16): asymmetric uint4 per group of G input channels (G = 128, 64 or 32).
W8A8 (vision linears): int8 per output channel x per-token int8 activations; see the section at the end.
For a Linear with N outputs and K inputs, stored in the checkpoint exactly as the kernels read it:

    qweight  int32   (N, K // 8)   word j of row n holds q[n, 8j + i] in bits [4i, 4i + 4), i = 0..7
    scales   fp16/bf16 (N, K // G) s[n, g]  (the activation dtype)
    zeros    float32 (N, K // G)   b[n, g] = -z[n, g] * s[n, g]   (the "scaled zero")

    w[n, k] = q[n, k] * s[n, k // G] + b[n, k // G]      evaluated in fp32, then cast

Why this form: rows of `qweight` are contiguous along K, so a GEMV program streams whole 16-byte
loads per row and a GEMM tile is a plain (BLOCK_N, BLOCK_K / 8) load; one FMA dequantizes. The
bias is fp32 so that the fp32 FMA is exact for both published layouts we import: AutoAWQ's
`(q - z) * s` (b = -z*s is exact in fp32) and llm-awq's `q * s + scaled_zeros` (an fp16 scaled_zero
widens exactly); the single rounding to the activation dtype then reproduces each source's own
dequantization bit for bit. Cost: 6 bytes of metadata per group, 9.4% over the int4 payload at G=128.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from . import ops
from .config import QuantConfig
from .options import DEFAULT, Options

W4_GROUP_SIZES = (32, 64, 128)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a tensor that must keep its dtype; from meta (`to_empty`) it becomes fresh storage."""
    return torch.empty_like(t, device=device) if t.is_meta and device.type != "meta" else t.to(device)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integers in [0, 15] -> (N, K // 8) int32, nibble i of word j = q[:, 8j + i]."""
    N, K = q.shape
    if K % 8:
        raise ValueError(f"K={K} must be a multiple of 8 to pack int4")
    if q.min() < 0 or q.max() > 15:
        raise ValueError("int4 values must lie in [0, 15]")
    q = q.to(torch.int64).view(N, K // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (q << shifts).sum(-1)  # (N, K/8), < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K // 8) int32 -> (N, K) uint8 in [0, 15]; the exact inverse of `pack_int4`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight[..., None] >> shifts) & 0xF  # arithmetic shift is fine: the mask drops sign bits
    return q.reshape(qweight.shape[0], -1).to(torch.uint8)


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Packed W4 -> dense (N, K) weight in `dtype` (default: the scales' dtype), the reference math."""
    q = unpack_int4(qweight).float()  # (N, K)
    G = q.shape[1] // scales.shape[1]
    s = scales.float().repeat_interleave(G, dim=1)
    b = zeros.float().repeat_interleave(G, dim=1)
    return (q * s + b).to(dtype or scales.dtype)


def quantize_w4(w: torch.Tensor, group_size: int = 128, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Round-to-nearest asymmetric W4 of a dense (N, K) weight -> {"qweight", "scales", "zeros"}.

    Per group: s = (max - min) / 15, z = round(-min / s) clamped to [0, 15], q = clamp(round(w / s) + z).
    This is the quantizer of AWQ (and of `--method rtn`); AWQ changes w (scaling, clipping) first.
    """
    if group_size not in W4_GROUP_SIZES:
        raise ValueError(f"group size {group_size} not supported; use one of {W4_GROUP_SIZES}")
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"K={K} is not a multiple of the group size {group_size}")
    dtype = dtype or w.dtype
    wg = w.float().view(N, K // group_size, group_size)
    wmax, wmin = wg.amax(-1).clamp(min=0), wg.amin(-1).clamp(max=0)
    s = ((wmax - wmin).clamp(min=1e-5) / 15).to(dtype)  # the stored scale is what dequantizes
    sf = s.float()
    z = torch.clamp(torch.round(-wmin / sf), 0, 15)
    q = torch.clamp(torch.round(wg / sf[..., None]) + z[..., None], 0, 15)
    return {"qweight": pack_int4(q.view(N, K)), "scales": s, "zeros": (-z * sf).float()}


def int4pack_cpu(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format above -> PyTorch's packed-int4 CPU form (ops.w4a16_linear's int4=): (packed weight, (K // G, N, 2)
    bf16 scales and zeros). Its matmul computes w = (q - 8) * scale + zero, so zero = b + 8 s, rounded to bf16 with
    the scale: the op's only fast dtype (fp16 or fp32 operands take a path 10-30x slower)."""
    s = scales.float()
    sz = torch.stack([s, zeros.float() + 8 * s], -1).transpose(0, 1).to(torch.bfloat16).contiguous()  # (K/G, N, 2)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(qweight).int(), 1), sz


class W4A16Linear(nn.Module):
    """A Linear with packed W4 weights (the layout above): y = x @ dequant(W)^T + bias, via ops.w4a16_linear.

    `qweight`, `scales`, `zeros` are buffers (not trained), `bias` a parameter when present; all load
    with `load_state_dict(assign=True)` onto a meta-device build. `zeros` stays float32 whatever the
    module is cast to (`_apply`), because the format's fp32 FMA needs it; `scales` follows the model dtype.
    """

    KEEP_DTYPE = ("zeros",)  # tensors a checkpoint stores in their own dtype, not config.dtype (loader)
    options: Options = DEFAULT  # runtime switches (options.set_options); the decode step's fused forms: decode_step.py

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        if group_size not in W4_GROUP_SIZES:
            raise ValueError(f"group size {group_size} not supported; use one of {W4_GROUP_SIZES}")
        if in_features % group_size:
            raise ValueError(f"in_features={in_features} is not a multiple of the group size {group_size}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        N, K, n_groups = out_features, in_features, in_features // group_size
        self.register_buffer("qweight", torch.empty(N, K // 8, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(N, n_groups, dtype=dtype, device=device))
        self.register_buffer("zeros", torch.empty(N, n_groups, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(N, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) -> (..., N)."""
        w, opts = (self.qweight, self.scales, self.zeros), self.options
        dense = int4 = None
        if opts.w4_cpu_cache and not x.is_cuda:
            dense = self._cached(x.dtype, lambda: ops.w4_reference_weight(*w, x.dtype))
        elif opts.w4_cpu_int4 and not x.is_cuda and ops.w4_int4_fits(x, self.qweight):
            int4 = self._cached("int4", lambda: int4pack_cpu(*w))
        return ops.w4a16_linear(x, *w, self.bias, opts=opts, dense=dense, int4=int4)

    def _cached(self, key, make):
        """A CPU form of the weights kept from its first use until the buffers are loaded, moved or cast (else a CPU
        decode step dequantizes every weight): Options.w4_cpu_cache's dense copy (key: its dtype) or w4_cpu_int4's."""
        if getattr(self, "_cpu_form", (None,))[0] != key:
            self._cpu_form = (key, make())
        return self._cpu_form[1]

    def _load_from_state_dict(self, *args, **kwargs):
        self._cpu_form = (None, None)  # new weights
        return super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        self._cpu_form = (None, None)  # moved or cast: made again from the new buffers on the next call
        # Module.to(dtype=...) / .half() would round the fp32 zeros; move them by device only.
        zeros = self._buffers.pop("zeros")
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers["zeros"] = zeros
        self._buffers["zeros"] = _to_device(zeros, self.qweight.device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


# The quantizable linears of each text.layers.{i} block; embeddings, lm_head and norms stay dense.
LLM_LINEARS = ("attn.wqkv", "attn.wo", "mlp.w13", "mlp.w2")


def swap_linears(model: nn.Module, quant: QuantConfig) -> list[str]:
    """Replaces the LLM's quantizable nn.Linears (LLM_LINEARS of every text layer) with W4A16Linear of
    the same shape, bias, dtype and device, in place. `model` is a VLM or a TextModel. Returns the
    replaced names (relative to `model`). Only quant.llm == "w4a16" is a W4 format."""
    if quant.llm != "w4a16":
        raise ValueError(f"swap_linears: quant.llm is {quant.llm!r}; only 'w4a16' has packed linears")
    text, prefix = (model.text, "text.") if hasattr(model, "text") else (model, "")
    swapped = []
    for i, block in enumerate(text.layers):
        for path in LLM_LINEARS:
            parent_name, attr = path.split(".")
            parent = getattr(block, parent_name)
            lin = getattr(parent, attr)
            name = f"{prefix}layers.{i}.{path}"
            if not isinstance(lin, nn.Linear):
                raise TypeError(f"{name}: expected an nn.Linear to quantize, found {type(lin).__name__}")
            if lin.in_features % quant.group_size:
                raise ValueError(f"{name}: in_features {lin.in_features} is not a multiple of group size "
                                 f"{quant.group_size}; choose a group size that divides it (32, 64 or 128)")
            setattr(parent, attr, W4A16Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                              group_size=quant.group_size, dtype=lin.weight.dtype,
                                              device=lin.weight.device))
            swapped.append(name)
    return swapped


# == W8A8 (vision encoders): int8 weights per output channel x int8 activations per token ===========
#
#     weight        int8    (N, K)   q[n, k] = round_half_even(w[n, k] / s[n]), |q| <= 127
#     weight_scale  float32 (N,)     s[n] = max(max_k |w[n, k]|, 1e-5) / 127
#     bias          config dtype (N,)  (always present: a Linear without one stores zeros)
#
# Activations are quantized at run time per token (row) the same symmetric way, by the kernel that
# produces them: ops.layer_norm_quant (before wqkv, fc1), ops.gelu_quant (before fc2),
# ops.quant_per_token (before wo). y = (x_q @ q^T) * x_scale[:, None] * s[None, :] + bias, int32 sums.


class QTensor(NamedTuple):
    """Per-token int8 activations: `q` (..., K) int8, `scale` (...,) fp32; x ~= q * scale[..., None]."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[..., None]).to(dtype)


def quantize_w8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Dense (N, K) weight -> {"weight": int8 (N, K), "weight_scale": fp32 (N,)}, symmetric per output channel."""
    wf = w.float()
    s = wf.abs().amax(-1).clamp(min=1e-5) / 127
    q = torch.round(wf / s[:, None]).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": s}


def dequantize_w8(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 (N, K) + fp32 (N,) -> dense (N, K) in `dtype`."""
    return (weight.float() * weight_scale[:, None]).to(dtype)


class W8A8Linear(nn.Module):
    """A Linear with int8 weights (the layout above) and per-token int8 activations.

    forward takes a float tensor (quantized per token here, through ops.quant_per_token) or a
    `QTensor` from a fused producer (LayerNorm+quant, GELU+quant); output (..., N) in the bias dtype.
    Buffers load with `load_state_dict(assign=True)` onto a meta-device build; `weight_scale` stays
    float32 whatever the module is cast to (KEEP_DTYPE, `_apply`).
    """

    KEEP_DTYPE = ("weight_scale",)  # tensors a checkpoint stores in their own dtype (loader)
    options: Options = DEFAULT  # runtime switches (options.set_options)

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype or torch.get_default_dtype(), device=device))

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "W8A8Linear":
        """Quantizes a dense nn.Linear (round to nearest, per output channel)."""
        m = cls(lin.in_features, lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device)
        qw = quantize_w8(lin.weight.detach())
        m.weight.copy_(qw["weight"])
        m.weight_scale.copy_(qw["weight_scale"])
        m.bias.copy_(lin.bias.detach() if lin.bias is not None else torch.zeros_like(m.bias))
        return m

    def forward(self, x: torch.Tensor | QTensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """(..., K) float or QTensor -> (..., N) in the bias dtype; `residual` (..., N), when given, is
        added in the GEMM's epilogue (a fused skip connection)."""
        if not isinstance(x, QTensor):
            x = QTensor(*ops.quant_per_token(x))
        return ops.w8a8_linear(x.q, x.scale, self.weight, self.weight_scale, self.bias, residual, opts=self.options)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype=...) / .half() would round the fp32 scales; move them by device only.
        scale = self._buffers.pop("weight_scale")
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers["weight_scale"] = scale
        self._buffers["weight_scale"] = _to_device(scale, self.weight.device)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"
