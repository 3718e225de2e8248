"""Per-kernel benchmark modules for scripts/bench_kernels.py: each exposes `run(args) -> list[dict]`."""
