"""CUDA-graph replay of a fixed-shape forward: one captured graph per input signature.

A ViT forward at one image, an LLM decode step and a short prefill are launch-bound (tens of layers x
~10 kernels, each a few microseconds of GPU work behind tens of microseconds of Python and launch
overhead); replaying a captured graph removes the host side entirely. `capture` records one callable;
`GraphLRU` keeps captured graphs by key, least recently used dropped first (generate.Decoder's decode and
prefill graphs); `GraphCache` is the input-copying form used by `VisionEncoder` (tinyvila/vision.py) and
`VLM.encode_images` (encoder + projector, and SparseVILA's prune with its fixed-k top-k). CUDA only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import torch

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


_SIDE: dict[int, torch.cuda.Stream] = {}
_STATE = threading.local()


def building() -> bool:
    """Whether this thread is inside `capture` (its eager warm-ups or the capture): there a launch's host time is
    paid once per graph, so kernels that launch slower but run faster may be chosen (ops.w4a16_linear's Gluon GEMM)."""
    return getattr(_STATE, "building", False)


def _side_stream(device: int) -> torch.cuda.Stream:
    """One warm-up stream per device for every capture: cuBLAS keeps a workspace per stream it runs on, so a
    new stream per capture would hold one more workspace per graph for the life of the process."""
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def capture(fn: Callable[[], object], pool, warmups: int = 1, restore: tuple[torch.Tensor, ...] = ()):
    """Capture `fn()` into a CUDA graph in memory pool `pool` -> (graph, fn's output in the pool).

    `warmups` eager calls first on a side stream, as torch.cuda.graphs asks: they compile the Triton
    kernels, let cuBLAS/SDPA pick their algorithms and grow the kernels' workspaces outside the capture
    (which must not synchronize or allocate outside the pool). Tensors in `restore` (device state the
    warm-up advances, e.g. a decode step's slot) are put back before the capture."""
    saved = [t.clone() for t in restore]
    side = _side_stream(torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    outer, _STATE.building = building(), True
    try:
        with torch.cuda.stream(side):
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        for t, v in zip(restore, saved):
            t.copy_(v)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:
        _STATE.building = outer
    return graph, out


class GraphLRU:
    """Captured graphs by hashable key, at most `max_graphs`, the least recently used dropped first. Entries
    are whatever the caller captured (e.g. (graph, outputs, buffers)); all share one memory pool, which is
    safe because replays are serial on one stream and every state that outlives a replay lives outside it."""

    def __init__(self, max_graphs: int = 8):
        self.max_graphs = max_graphs
        self.entries: dict[Hashable, tuple] = {}  # insertion order is the LRU order
        self._pool = None
        self.captures = 0

    @property
    def pool(self):
        """The graphs' shared memory pool, made on first use (CUDA only)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def get(self, key: Hashable, make: Callable[[], tuple]) -> tuple:
        """The entry of `key`, made by `make()` (which captures, in `self.pool`) when absent."""
        entry = self.entries.pop(key, None)
        if entry is None:
            if len(self.entries) >= self.max_graphs:
                del self.entries[next(iter(self.entries))]
            entry = make()
            self.captures += 1
        self.entries[key] = entry
        return entry

    def clear(self, which: Callable[[Hashable], bool] | None = None) -> None:
        """Drop every graph, or those whose key `which(key)` accepts."""
        for key in [k for k in self.entries if which is None or which(k)]:
            del self.entries[key]

    def __len__(self) -> int:
        return len(self.entries)


class GraphCache:
    """Calls `fn(x, *static)` through a CUDA graph captured once per (shape, dtype, device) of `x` and
    value of the hashable `static` arguments (constants baked into the graph, e.g. a top-k's k).

    `fn` returns a tensor or a tuple of tensors. Inputs are copied into the graph's static input and
    the static outputs are cloned out, so results never alias a later replay. The captured graphs bake
    in the addresses of the module's weights: call `clear()` after moving or reloading them. Graphs
    share one memory pool (replays are serial on the current stream, so their intermediates may
    overlap); at most `max_graphs` are kept. `captures` counts captures (a replay that recaptures
    would show here: benchmarks and tests read it).
    """

    def __init__(self, fn: Callable[..., Outputs], max_graphs: int = 8):
        self.fn, self.max_graphs = fn, max_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, Outputs]] = {}
        self.pool = None
        self.captures = 0

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, *static: Hashable) -> Outputs:
        if not x.is_cuda:
            raise ValueError(f"GraphCache: CUDA graphs need a CUDA input, got one on {x.device}")
        key = (tuple(x.shape), x.dtype, x.device, static)
        if key not in self.graphs:
            if len(self.graphs) >= self.max_graphs:
                self.clear()  # rare (many batch sizes): start over rather than grow without bound
            self.graphs[key] = self._capture(x, static)
        graph, static_in, static_out = self.graphs[key]
        static_in.copy_(x)
        graph.replay()
        if isinstance(static_out, tuple):
            return tuple(t.clone() for t in static_out)
        return static_out.clone()

    def _capture(self, x: torch.Tensor, static: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Outputs]:
        static_in = x.clone()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.device(x.device):
            graph, static_out = capture(lambda: self.fn(static_in, *static), self.pool, warmups=2)
        self.captures += 1
        return graph, static_in, static_out


class GraphOwner:
    """nn.Module mixin (listed before nn.Module) for a module that keeps a GraphCache in the attribute
    named by GRAPHS_ATTR: moving, casting or reloading its weights drops the captured graphs, which hold
    the old weight addresses."""

    GRAPHS_ATTR = "graphs"

    def _drop_graphs(self) -> None:
        graphs = getattr(self, self.GRAPHS_ATTR, None)
        if graphs is not None:
            graphs.clear()

    def _apply(self, fn, recurse=True):
        self._drop_graphs()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._drop_graphs()
        return super()._load_from_state_dict(*args, **kwargs)
