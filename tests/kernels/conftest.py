"""Kernel tests run the Triton kernels under the interpreter (TRITON_INTERPRET=1) when there is no GPU.

The variable must be set before `triton.jit` decorates any kernel, i.e. before csrc_triton is
imported; pytest loads this conftest before collecting the test modules of this folder.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
