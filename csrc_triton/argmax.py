"""Argmax of a 1-D float vector on the device (greedy decoding over the vocabulary), torch.argmax's answer.

    i = argmax_j x[j]: the first maximal index; NaN counts as larger than every number (its first index wins)

Two launches, no host sync, no allocation beyond two small per-device buffers, so a decode step can be captured
in a CUDA graph: `_block_kernel` (one program per BLOCK values) writes each block's maximum, the first index holding
it and the first NaN index; `_final_kernel` (one program) reduces those partials with the same rules. Why: PyTorch's
one-stage argmax was slower (docs/perf_notes.md).

`argmax_step` is the tail of a greedy decode step in the same two launches: its final program (`_step_kernel`) also
writes i as the next input token and into the step's record out[count], then adds 1 to count and to every entry of
two counter vectors (the step's int64 cache slot / packed row / RoPE position, and its int32 attention lengths),
~6 tiny PyTorch kernels fewer per step; `argmax_step_ref` is exactly those PyTorch ops.
"""

from __future__ import annotations

import torch

from . import pdl
from ._triton import tl, triton
from .pdl import options as pdl_options

BLOCK = 4096
MAX_BLOCKS = 1024  # the final program holds every partial at once: up to BLOCK * MAX_BLOCKS values
MAX_COUNTERS = 1024  # entries per counter vector of argmax_step (one program adds 1 to each)


@triton.jit
def _block_kernel(x_ptr, val_ptr, idx_ptr, nan_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + offs, mask=ok, other=-float("inf")).to(tl.float32)
    nan = (x != x) & ok
    first_nan = tl.min(tl.where(nan, offs, 2147483647), axis=0)
    x = tl.where(nan, -float("inf"), x)
    best = tl.max(x, axis=0)
    # The first index holding the maximum (a block of only -inf / NaN reports its first valid index).
    first = tl.min(tl.where((x == best) & ok, offs, 2147483647), axis=0)
    tl.store(val_ptr + b, best)
    tl.store(idx_ptr + b, first)
    tl.store(nan_ptr + b, first_nan)


@triton.jit
def _reduce_partials(val_ptr, idx_ptr, nan_ptr, N_BLOCKS, BLOCKS: tl.constexpr):
    """The block kernel's partials -> the argmax, an int64 scalar (the first NaN's index if any)."""
    offs = tl.arange(0, BLOCKS)
    ok = offs < N_BLOCKS
    val = tl.load(val_ptr + offs, mask=ok, other=-float("inf"))
    idx = tl.load(idx_ptr + offs, mask=ok, other=2147483647)
    first_nan = tl.min(tl.load(nan_ptr + offs, mask=ok, other=2147483647), axis=0)
    best = tl.max(val, axis=0)
    first = tl.min(tl.where((val == best) & ok, idx, 2147483647), axis=0)
    return tl.where(first_nan < 2147483647, first_nan, first).to(tl.int64)


@triton.jit
def _final_kernel(val_ptr, idx_ptr, nan_ptr, out_ptr, N_BLOCKS, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    tl.store(out_ptr, _reduce_partials(val_ptr, idx_ptr, nan_ptr, N_BLOCKS, BLOCKS))


@triton.jit
def _step_kernel(val_ptr, idx_ptr, nan_ptr, token_ptr, rec_ptr, count_ptr, c64_ptr, c32_ptr, N_BLOCKS, N_REC,
                 N_C64, N_C32, BLOCKS: tl.constexpr, B64: tl.constexpr, B32: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    # The state first: these loads do not depend on the partials, so their latency overlaps the reduction's.
    # Every value below is stored by the one thread that owns it (Triton stores a scalar or an element
    # once), after that thread loaded it: one program, so no atomics.
    c = tl.load(count_ptr)
    o64 = tl.arange(0, B64)
    c64 = tl.load(c64_ptr + o64, mask=o64 < N_C64)
    o32 = tl.arange(0, B32)
    c32 = tl.load(c32_ptr + o32, mask=o32 < N_C32)
    i = _reduce_partials(val_ptr, idx_ptr, nan_ptr, N_BLOCKS, BLOCKS)
    tl.store(token_ptr, i)
    tl.store(rec_ptr + c, i, mask=(c >= 0) & (c < N_REC))  # past the record: nothing (never a stray write)
    tl.store(count_ptr, c + 1)
    tl.store(c64_ptr + o64, c64 + 1, mask=o64 < N_C64)
    tl.store(c32_ptr + o32, c32 + 1, mask=o32 < N_C32)


_PARTIALS: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _partials(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-device partial buffers, allocated once (outside any graph capture: the first call)."""
    key = str(device)
    if key not in _PARTIALS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("argmax: call it once outside the CUDA graph capture first (it allocates its "
                               "partial buffers on the first call)")
        _PARTIALS[key] = (torch.empty(MAX_BLOCKS, device=device, dtype=torch.float32),
                          torch.empty(MAX_BLOCKS, device=device, dtype=torch.int32),
                          torch.empty(MAX_BLOCKS, device=device, dtype=torch.int32))
    return _PARTIALS[key]


def _blocks(x: torch.Tensor, pdl: bool) -> tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor], dict]:
    """Checks x, launches the block kernel -> (number of blocks, the partials, launch options)."""
    if x.dim() != 1 or x.stride(0) != 1 or not 1 <= x.numel() <= BLOCK * MAX_BLOCKS:
        raise ValueError(f"argmax: x must be a contiguous 1-D tensor of 1..{BLOCK * MAX_BLOCKS} values, "
                         f"got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"argmax: x must be a float tensor, got {x.dtype}")
    n_blocks = triton.cdiv(x.numel(), BLOCK)
    val, idx, nan = _partials(x.device)
    opts = pdl_options(x.device, pdl)
    _block_kernel[(n_blocks,)](x, val, idx, nan, x.numel(), BLOCK=BLOCK, num_warps=8, **opts)
    return n_blocks, (val, idx, nan), opts


def _final_blocks(n_blocks: int) -> int:
    return max(16, triton.next_power_of_2(n_blocks))


def argmax(x: torch.Tensor, out: torch.Tensor | None = None, *, pdl: bool = True) -> torch.Tensor:
    """x (N,) float (unit stride, 1 <= N <= BLOCK * MAX_BLOCKS) -> (1,) int64 index, as torch.argmax(x).
    pdl: programmatic dependent launch where the device has it (csrc_triton/pdl.py)."""
    n_blocks, partials, opts = _blocks(x, pdl)
    out = torch.empty(1, device=x.device, dtype=torch.int64) if out is None else out
    _final_kernel[(1,)](*partials, out, n_blocks, BLOCKS=_final_blocks(n_blocks), num_warps=4, **opts)
    return out


def _check_step(x: torch.Tensor, named: dict[str, tuple[torch.Tensor, torch.dtype]]) -> None:
    """argmax_step's state tensors: contiguous, on x's device, of their dtype; metadata only (no sync)."""
    for name, (t, dtype) in named.items():
        if t.dtype != dtype or t.device != x.device or not t.is_contiguous() or t.numel() < 1:
            raise ValueError(f"argmax_step: {name} must be a contiguous {dtype} tensor on {x.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if named["token"][0].numel() != 1 or named["count"][0].numel() != 1:
        raise ValueError("argmax_step: token and count must hold one value each")
    if max(named["steps"][0].numel(), named["lengths"][0].numel()) > MAX_COUNTERS:
        raise ValueError(f"argmax_step: at most {MAX_COUNTERS} steps / lengths entries")


def argmax_step(x: torch.Tensor, token: torch.Tensor, out: torch.Tensor, count: torch.Tensor, steps: torch.Tensor,
                lengths: torch.Tensor, *, pdl: bool = True) -> None:
    """A greedy decode step's tail, in place: i = argmax(x) (x as for `argmax`) -> token (one int64) and
    out[count] (out (R,) int64, count one int64; nothing is written when count is not in 0..R-1); then
    count += 1, steps += 1 (S,) int64 and lengths += 1 (B,) int32. Two launches, graph-capturable.
    pdl: programmatic dependent launch where the device has it (csrc_triton/pdl.py)."""
    _check_step(x, dict(token=(token, torch.int64), out=(out, torch.int64), count=(count, torch.int64),
                        steps=(steps, torch.int64), lengths=(lengths, torch.int32)))
    n_blocks, partials, opts = _blocks(x, pdl)
    S, B = steps.numel(), lengths.numel()
    _step_kernel[(1,)](*partials, token, out, count, steps, lengths, n_blocks, out.numel(), S, B,
                       BLOCKS=_final_blocks(n_blocks), B64=max(16, triton.next_power_of_2(S)),
                       B32=max(16, triton.next_power_of_2(B)), num_warps=4, **opts)


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """The reference: torch.argmax, as a (1,) int64 tensor."""
    return torch.argmax(x).view(1)


def argmax_step_ref(x: torch.Tensor, token: torch.Tensor, out: torch.Tensor, count: torch.Tensor,
                    steps: torch.Tensor, lengths: torch.Tensor) -> None:
    """The reference of `argmax_step` in PyTorch ops (count must lie in 0..R-1: index_copy_ checks it)."""
    i = argmax_ref(x)
    token.copy_(i.view_as(token))
    out.index_copy_(0, count.view(1), i)
    count.add_(1)
    steps.add_(1)
    lengths.add_(1)
