"""Triton for the kernel files: the real package where it is installed, else a stand-in that lets them import.

Every file of csrc_triton takes Triton from here (`from ._triton import tl, triton`, plus the few submodule names
they use). A CPU-only install (`pip install -e .`, no extras) has no Triton, yet its CPU path imports the kernel
files, since each holds its kernel's plain PyTorch reference `<op>_ref()` next to the kernel it checks. There the
stand-in gives what the files use at import time: `triton.jit` makes each kernel an `Unlaunchable`, `tl.constexpr(v)`
is v, `triton.cdiv` / `next_power_of_2` compute, and every other name (tl.float16, knobs, driver, libdevice,
TensorDescriptor) is a `_Placeholder`. Launching a kernel, or a launcher's first use of any such name (a call, an
index, an isinstance), raises `TritonMissingError`, an ImportError that says what to install.

Why not a stand-in in sys.modules["triton"]: the process is shared, and torch (torch.utils._triton), other
libraries and user code would take it for an installed Triton. Why not the references in files of their own: two
files per op, and the reference, the kernel's test oracle, away from the kernel. A real Triton always wins: the
stand-in exists only where no `triton` package is found, so a broken Triton raises its own error on import.
w8a8_gemm_wgmma.py (Gluon) imports Triton itself; w8a8_gemm imports it only under a real Triton 3.6.
"""

from __future__ import annotations

import functools
import importlib.util

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INSTALL = 'pip install -e ".[gpu]"'


class TritonMissingError(ImportError):
    """A Triton kernel, or a Triton API, used where Triton is not installed."""

    def __init__(self, what: str):
        super().__init__(f"{what}: Triton is not installed, and csrc_triton's GPU kernels need it: {INSTALL} (CUDA "
                         "builds of torch on Linux bring it too). On the CPU, tinyvila.ops runs the kernels' plain "
                         "PyTorch references, which need no Triton.", name="triton")


class _Placeholder:
    """A Triton name without Triton: attributes give further placeholders; any use at run time raises."""

    def __init__(self, path: str):
        self._path = path

    def __getattr__(self, name: str):
        if name.startswith("__"):  # protocols (copy, pickle, inspect) probe dunders: they have none
            raise AttributeError(name)
        return _Placeholder(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise TritonMissingError(self._path)

    __getitem__ = __instancecheck__ = __iter__ = __call__

    def __repr__(self) -> str:
        return f"<{self._path}: Triton is not installed>"


class Unlaunchable(_Placeholder):
    """A @triton.jit function without Triton: importable, documented, never launched (kernel[grid] raises)."""

    def __init__(self, fn):
        super().__init__(f"{fn.__module__}.{fn.__qualname__}")
        self.fn = fn
        functools.update_wrapper(self, fn)


def _jit(fn=None, **options):
    """`@triton.jit` and `@triton.jit(do_not_specialize=...)` without Triton."""
    return Unlaunchable(fn) if fn is not None else Unlaunchable


if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.language.extra import libdevice
    from triton.runtime import JITFunction, driver
    from triton.tools.tensor_descriptor import TensorDescriptor
else:
    triton, tl = _Placeholder("triton"), _Placeholder("triton.language")
    triton.jit, triton.__version__ = _jit, ""
    triton.cdiv = lambda a, b: -(-a // b)
    triton.next_power_of_2 = lambda n: 1 << (n - 1).bit_length() if n > 0 else 0
    tl.constexpr = lambda v: v  # read only inside kernel bodies, which never run here
    knobs, libdevice, JITFunction, driver = triton.knobs, tl.extra.libdevice, triton.runtime.JITFunction, triton.runtime.driver
    TensorDescriptor = triton.tools.tensor_descriptor.TensorDescriptor
