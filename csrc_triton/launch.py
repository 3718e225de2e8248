"""Eager Triton launches without Triton's per-call dispatch: `Launch` (reference: `launch_ref`), `Plans`.

Why: an eager launch through `kernel[grid](...)` spends tens of microseconds of host time binding the arguments,
specialising them, hashing the cache key and building launch metadata: at one SigLIP frame the salience kernels run
for microseconds, and a follow-up question's eager prefill is host-bound. A launcher builds its launches once per
distinct call (its plan: checks, tiles, grid, scalar arguments, constexprs, options) and keeps them in a bounded
`Plans` table; each `Launch` then goes through Triton's dispatch only once per (device, debug flag, tensor
alignments) and afterwards calls the compiled kernel's C launcher directly. Why that is exact: see `Launch`. The
interpreter, pre-run hooks and launch hooks (profilers) always take Triton's dispatch, and so does every call with
`direct=False` (benches time both, tests compare). `--host` timings: scripts/benches/prefill_salience.py --host.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from ._triton import JITFunction, driver, knobs


def _no_hooks(fn) -> bool:
    """True when Triton's own launch would call no hook (profilers add launch hooks): then calling the
    compiled launcher with no hooks and no launch metadata is the same launch."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return not fn.pre_run_hooks and (enter is None or type(enter) is knobs.HookChain and not enter.calls) and (
        leave is None or type(leave) is knobs.HookChain and not leave.calls)


def launch_ref(fn, grid: tuple[int, ...], tensors: tuple, scalars: tuple, meta: dict):
    """The reference of a direct launch: the same launch through Triton's own dispatch (binding,
    specialisation, cache lookup or compile, launch with metadata and hooks). `Launch` takes this path on
    its first call per compiled-kernel key, under the interpreter, with hooks, and when called with direct=False;
    tests/kernels/test_launch.py checks that its direct calls pass exactly what this one does. Returns
    Triton's compiled kernel (None when a JIT cache hook skipped the launch)."""
    return fn[grid](*tensors, *scalars, **meta)


class Launch:
    """One kernel launch with its grid, scalar arguments, constexprs and options fixed; called with the
    kernel's tensor arguments, which must be its leading parameters, in order.

    The first launch per (device, Triton debug flag, 16-byte alignment of each tensor) goes through
    Triton's dispatch, which compiles or finds the kernel, launches it and returns it; later ones call
    that compiled kernel's launcher directly, skipping the per-call argument binding, specialisation,
    cache key and launch metadata. Exact: Triton picks a compiled kernel by dtypes, integer arguments
    (== 1, % 16, 32/64 bits), constexprs and options, all fixed by the plan that owns this launch (its
    key holds every shape, stride, dtype and option the launch derives from), and by device, debug flag
    and pointer alignment, which key `compiled`; the direct call passes the arguments Triton binds
    (constexprs included, in parameter order) on the stream Triton would use (the current one, so a
    CUDA-graph capture records it like any launch). The interpreter, pre-run hooks and launch hooks
    always take Triton's dispatch, and so does a call with direct=False. Returns Triton's compiled kernel when
    dispatch ran (None otherwise)."""

    def __init__(self, fn, grid: tuple[int, ...], scalars: tuple, meta: dict):
        self.fn, self.grid, self.scalars, self.meta = fn, (*grid, 1, 1)[:3], scalars, meta
        self.compiles = isinstance(fn, JITFunction)  # not the interpreter's InterpretedFunction
        # The compiled launcher takes every parameter in order, constexprs included (and ignored).
        self.tail = (*scalars, *(meta[a] for a in fn.arg_names if a in meta)) if self.compiles else ()
        self.compiled = {}  # key -> (compiled launcher, kernel handle, packed metadata)

    def __call__(self, *tensors: torch.Tensor, direct: bool = True):
        if not (direct and self.compiles and _no_hooks(self.fn)):
            return launch_ref(self.fn, self.grid, tensors, self.scalars, self.meta)
        device = driver.active.get_current_device()
        key = (device, knobs.runtime.debug, *[t.data_ptr() % 16 == 0 for t in tensors])
        entry = self.compiled.get(key)
        if entry is None:
            assert len(tensors) + len(self.tail) == len(self.fn.arg_names)
            kernel = launch_ref(self.fn, self.grid, tensors, self.scalars, self.meta)
            if kernel is not None:  # None: a JIT cache hook skipped the launch
                self.compiled[key] = (kernel.run, kernel.function, kernel.packed_metadata)
            return kernel
        launch, function, packed = entry
        launch(*self.grid, driver.active.get_current_stream(device), function, packed, None, None, None, *tensors,
               *self.tail)
        return None


class Plans(dict):
    """A launcher's plans: call key -> plan, at most `limit` kept (a model makes a handful of distinct
    calls per launcher; past the limit the table starts over). A plan whose build raises is not kept, so
    a bad call raises the same error on every call."""

    def __init__(self, limit: int = 256):
        super().__init__()
        self.limit = limit

    def get_or_build(self, key: Hashable, build: Callable[[], object]):
        plan = self.get(key)
        if plan is None:
            plan = self.put(key, build())
        return plan

    def put(self, key: Hashable, plan):
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan
        return plan


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a plan may derive from a tensor besides its data: shape, strides, dtype, device."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)
