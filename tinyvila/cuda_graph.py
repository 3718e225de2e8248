"""CUDA-graph replay of a fixed-shape forward: one captured graph per input signature.

A ViT forward at one image is launch-bound (26 layers x ~10 kernels, each a few microseconds of GPU
work behind tens of microseconds of Python and launch overhead); replaying a captured graph removes
the host side entirely. Used by `VisionEncoder` (tinyvila/vision.py); CUDA only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphCache:
    """Calls `fn(x)` through a CUDA graph captured once per (shape, dtype, device) of `x`.

    Inputs are copied into the graph's static input and the static output is cloned out, so results
    never alias a later replay. The captured graphs bake in the addresses of the module's weights:
    call `clear()` after moving or reloading them. Graphs share one memory pool (replays are serial
    on the current stream, so their intermediates may overlap); at most `max_graphs` are kept.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], max_graphs: int = 8):
        self.fn, self.max_graphs = fn, max_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            raise ValueError(f"GraphCache: CUDA graphs need a CUDA input, got one on {x.device}")
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in self.graphs:
            if len(self.graphs) >= self.max_graphs:
                self.clear()  # rare (many batch sizes): start over rather than grow without bound
            self.graphs[key] = self._capture(x)
        graph, static_in, static_out = self.graphs[key]
        static_in.copy_(x)
        graph.replay()
        return static_out.clone()

    def _capture(self, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        static_in = x.clone()
        # Warm-up on a side stream, as torch.cuda.graphs asks: compiles the Triton kernels and lets
        # cuBLAS/SDPA pick their algorithms outside the capture (which must not synchronize).
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(static_in)
        torch.cuda.current_stream(x.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = self.fn(static_in)
        return graph, static_in, static_out
