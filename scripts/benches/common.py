"""Shared measurement helpers for the kernel benchmarks (CUDA only).

Rules (CONVENTIONS.md): time with device events after warm-up, take medians, rotate inputs larger
than L2 so a kernel is not timed on cache-resident data, report GB/s or TFLOP/s against measured
ceilings, print a table then one JSON line.
"""

from __future__ import annotations

import json
import subprocess

import torch

L2_BYTES = 64 << 20  # larger than any current GPU's L2 (H200: 50 MB)


def n_copies(bytes_per_set: int) -> int:
    """How many input sets to rotate through so that together they exceed L2 (at least 2)."""
    return max(2, -(-2 * L2_BYTES // max(bytes_per_set, 1)))


def bench(fn, inputs: list, warmup: int = 10, iters: int = 50, spin_cycles: int = 0) -> float:
    """Median milliseconds of fn(*inputs[i % len(inputs)]) timed with CUDA events, one per call.

    `spin_cycles` > 0 queues a GPU spin before each call so host launch latency is hidden and only
    device time is measured (for kernels of a few microseconds).
    """
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = inputs[i % len(inputs)]
        if spin_cycles:
            torch.cuda._sleep(spin_cycles)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn, inputs: list, calls: int = 16, iters: int = 20) -> float | None:
    """Median ms per call of fn(*inputs[i % len]) from replays of one CUDA graph of max(calls, len(inputs))
    back-to-back calls: a kernel's device time as a captured decode step or encoder runs it (no host
    launch overhead; each launch overlaps the previous one's tail). Every input is run once on a side
    stream first (compiles, grows workspaces outside the capture). None, with a message, when the call
    cannot be captured."""
    n = max(calls, len(inputs))
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for args in inputs:
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                fn(*inputs[i % len(inputs)])
    except RuntimeError as e:
        print(f"graph capture failed: {e}")
        return None
    ms = bench(graph.replay, [()], warmup=3, iters=iters) / n
    del graph
    return ms


_CEILINGS: dict[str, float] = {}


def spin_cycles_per_ms() -> float:
    """GPU clock cycles that torch.cuda._sleep spins per millisecond (measured once per process:
    the spin counts SM clock cycles, whose rate moves with the clock)."""
    if "spin" not in _CEILINGS:
        cycles = 2_000_000
        _CEILINGS["spin"] = cycles / bench(lambda: torch.cuda._sleep(cycles), [()], warmup=2, iters=5)
    return _CEILINGS["spin"]


def device_ms(fn, inputs: list, host_ms: float, warmup: int = 2, iters: int = 50,
              min_spin_ms: float = 0.2, max_spin_ms: float = 2.0) -> float:
    """Median device ms of fn(*inputs[i % len]): `bench` with a GPU spin of 2 x host_ms, clamped to
    [min_spin_ms, max_spin_ms], queued before each call. host_ms: an upper bound of the call's host time;
    its eager `bench` time is one (that time covers the host's enqueueing). While the GPU spins, the
    host enqueues the whole call, so the events time the kernels back to back."""
    spin_ms = min(max(2 * host_ms, min_spin_ms), max_spin_ms)
    return bench(fn, inputs, warmup, iters, spin_cycles=int(spin_ms * spin_cycles_per_ms()))


def copy_bandwidth_gbs() -> float:
    """Measured device-to-device copy bandwidth (bytes read + written), GB/s; cached per process."""
    if "copy" not in _CEILINGS:
        n = 1 << 30
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        ms = bench(lambda: dst.copy_(src), [()], warmup=5, iters=30)
        _CEILINGS["copy"] = 2 * n / ms / 1e6
        del src, dst
    return _CEILINGS["copy"]


def matmul_tflops(dtype=torch.float16) -> float:
    """Measured dense matmul ceiling (8192^3 through torch.matmul), TFLOP/s; cached per process."""
    key = f"mm_{dtype}"
    if key not in _CEILINGS:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        ms = bench(lambda: a @ b, [()], warmup=5, iters=20)
        _CEILINGS[key] = 2 * n**3 / ms / 1e9
    return _CEILINGS[key]


def environment() -> dict:
    """GPU, versions and commit, for the JSON line (triton: None where it is not installed, e.g. a CPU-only bench)."""
    try:
        import triton
    except ImportError:
        triton = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton and triton.__version__, "commit": commit or "unknown"}


def ints(text: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64] (an argparse type for the benches' list flags)."""
    return [int(v) for v in text.split(",") if v.strip()]


def print_table(rows: list[dict]) -> None:
    """Rows (dicts with the same keys) as an aligned text table."""
    if not rows:
        return
    keys = list(rows[0])
    cells = [[k for k in keys]] + [[_fmt(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def emit(name: str, rows: list[dict]) -> None:
    """The table, then one JSON line with the environment."""
    print(f"\n== {name} ==")
    print_table(rows)
    print(json.dumps({"bench": name, **environment(), "rows": rows}))
