"""Triton kernels of tinyvila. Imports only torch and triton; only tinyvila/ops.py imports it.

Each kernel lives in its own file: a docstring with the math and layouts, `_<op>_kernel`, the
launcher `<op>()` and the plain PyTorch `<op>_ref()`. The kernels arrive with the issues that need
them (W4A16 GEMV/GEMM, W8A8 GEMM, salience, decoding attention); this package is empty until then.
"""
