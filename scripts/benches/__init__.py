"""Per-kernel benchmark modules for scripts/bench_kernels.py: each exposes `run(args) -> list[dict]`, and
`add_args(parser)` when it has flags of its own."""
