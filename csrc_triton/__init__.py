"""Triton kernels of tinyvila. Imports only torch and triton; only tinyvila/ops.py imports it.

Every file takes Triton from `_triton.py`: the real package, or, where none is installed (a CPU-only install), a
stand-in under which the files import, the `<op>_ref()` references (the CPU path) run and a kernel launch raises
TritonMissingError saying what to install; its docstring says why a stand-in rather than separate reference files.

Each kernel lives in its own file: a docstring with the math and layouts, `_<op>_kernel`, the
launcher `<op>()` and the plain PyTorch `<op>_ref()`, tested by tests/kernels/test_<op>.py. Launchers take
their runtime forms as keyword arguments (`pdl`, `direct`, `kernel`, ...), never from globals or the
environment. Shared pieces live in files whose names start with `_` (`_common.py`: the interpreter flag,
device capabilities, the row-wise int8 quantizer, packed-W4 and RoPE argument checks; `_w4a16_gemv_*.py`:
the W4 GEMV's operands and epilogues) and in pdl.py, rounding.py and launch.py; no kernel file imports
another kernel file's private names.
"""
