"""Kernel tests run on the GPU when there is one and under the Triton interpreter otherwise.

Without CUDA, TRITON_INTERPRET=1 is set before `triton.jit` decorates any kernel (i.e. before csrc_triton
is imported; pytest loads this conftest before collecting the test modules of this folder), DEVICE is
"cpu", and the tests run at small odd shapes; those that only make sense on a GPU (real shapes, CUDA
graphs, PTX) carry `@pytest.mark.gpu` and are skipped (tests/conftest.py).

With CUDA, DEVICE is "cuda" and every test here runs the compiled kernels, so every one is marked `gpu`
(except `cpu_only` ones): `pytest -m gpu` on a GPU machine runs this whole folder, and a CPU run's count
of GPU tests not run is the real-shape, graph and PTX ones alone.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
_HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `-m gpu` must keep them
def pytest_collection_modifyitems(config, items):
    if not ON_GPU:
        return
    for item in items:
        if item.path.is_relative_to(_HERE) and not item.get_closest_marker("cpu_only"):
            item.add_marker(pytest.mark.gpu)
