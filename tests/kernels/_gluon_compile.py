"""Compile the Gluon W4 GEMM for sm_90a in this process and print what the compiled kernels say, one JSON line a case.

Run by test_w4a16_gemm.py in a child process: Triton 3.6's interpreter leaves triton.language patched after a
kernel that calls a jit helper function has run under TRITON_INTERPRET=1 (a device call's patch is never undone), and
a Gluon kernel compiled after that fails to trace, so the compile needs a process in which no kernel was interpreted.
    python -m _gluon_compile '[[M, N, K, G, "float16", [tile fields...]], ...]'   (from tests/kernels/, with the
    repository root on PYTHONPATH or tinyvila installed: test_w4a16_gemm.py's fixture runs it so)
"""

import json
import sys

import torch
from triton.runtime import driver
from triton_stub import HostOnlyDriver

from csrc_triton import w4a16_gemm_wgmma as gw


def compile_case(M: int, N: int, K: int, G: int, dtype: torch.dtype, tile: gw.Tile) -> dict:
    """The kernel as WgmmaLaunch launches it at this call shape: its shared memory and the wgmma count of its PTX."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    launch = gw.WgmmaLaunch(M, N, K, G, tile, dtype, True, N)
    x, q = torch.empty(M, K, dtype=dtype), torch.empty(N, K // 8, dtype=torch.int32)
    s, z, out = torch.empty(N, K // G, dtype=dtype), torch.empty(N, K // G), torch.empty(M, N, dtype=dtype)
    descs = [TensorDescriptor(t, t.shape, t.stride(), b, lay)
             for t, b, lay in ((x, launch.x_block, launch.x_layout), (q, launch.w_block, launch.w_layout))]
    kernel = gw._w4a16_wgmma_kernel.warmup(*descs, s, z, s, out, z, z, *launch.scalars, grid=launch.grid,
                                           **launch.meta)
    return {"shared": kernel.metadata.shared, "wgmma": kernel.asm["ptx"].count("wgmma.mma_async")}


if __name__ == "__main__":
    driver._active = HostOnlyDriver()
    for M, N, K, G, dtype, tile in json.loads(sys.argv[1]):
        print(json.dumps(compile_case(M, N, K, G, getattr(torch, dtype), gw.Tile(*tile))), flush=True)
