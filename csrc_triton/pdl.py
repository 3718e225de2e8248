"""Programmatic dependent launch (PDL) for the decode step's kernels (sm_90+).

A decode step is a chain of short kernels (per layer: qkv GEMV, RoPE+cache write, decoding attention, o GEMV,
gate/up GEMV, down GEMV, the norms and SwiGLU inside the GEMVs; csrc_triton/w4a16_gemv.py, whose TRIGGER
settings move `launch_dependents` later where an early start hurts). Launched plainly, each kernel starts
only after the previous one has fully drained, so every launch pays the ramp-up of its programs and the
GPU's memory system idles through each small kernel. With PDL (`launch_pdl=True`, CUDA's programmatic
stream serialization) a kernel may start as soon as every program of its predecessor has executed
`launch_dependents`; it then must `wait` (griddepcontrol.wait: the predecessor has completed and its
memory is visible) before it reads anything the predecessor wrote or writes anything at all.

Every PDL kernel here calls `enter` first: `wait`, then `launch_dependents` (the W4 GEMV may call the latter
after its K loop instead: its TRIGGER). So nothing is read or written before the predecessor is done (waiting is
transitive: each kernel waits for its predecessor, which waited for its own), and the next kernel may be scheduled
onto free SM slots while this one runs: what PDL saves is the launch latency and ramp-up between consecutive
kernels, not any memory ordering. Kernels launched without PDL (cuBLAS, PyTorch ops) keep plain stream order in
both directions. Measurements (and the L2 weight prefetch tried and removed): docs/perf_notes.md.

Not a kernel of its own: device-side helpers every decode-step kernel calls. A launcher takes `pdl: bool = True`
and passes `**options(device, pdl)` (the kernel's PDL constexpr and Triton's launch_pdl option): PDL when asked
for, on CUDA devices of compute capability >= 9.0, outside the interpreter. `options_ref()` is the plain
launch, the reference: the same kernel launched with it gives the same bits (tests/kernels/test_pdl.py,
kernel by kernel and for a whole decode-like chain, eager and graph-replayed). In the interpreter and on
other devices `options` is `options_ref()`.
"""

from __future__ import annotations

import torch

from ._common import INTERPRET
from ._triton import tl, triton

_SUPPORTED: dict[int, bool] = {}


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL: a CUDA device of sm_90+, not the interpreter."""
    if device.type != "cuda" or INTERPRET:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SUPPORTED:
        _SUPPORTED[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _SUPPORTED[index]


def options(device: torch.device, enabled: bool = True) -> dict:
    """Launch keywords of a decode-step kernel on `device`: its PDL constexpr and Triton's launch_pdl, on when
    `enabled` (the launcher's `pdl` argument) and the device supports it."""
    on = enabled and supported(device)
    return {"PDL": on, "launch_pdl": on}


def options_ref() -> dict:
    """The plain launch (no PDL): the reference every PDL launch must match bit for bit."""
    return {"PDL": False, "launch_pdl": False}


@triton.jit
def wait(PDL: tl.constexpr):
    """griddepcontrol.wait: the preceding kernel has completed and its writes are visible (no-op if not PDL)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """griddepcontrol.launch_dependents: the next kernel may start once every program got here (or exited)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def enter(PDL: tl.constexpr):
    """The start of every PDL kernel: wait for the predecessor, then let the next kernel start."""
    wait(PDL)
    launch_dependents(PDL)
