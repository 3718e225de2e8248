"""Command lines and benchmarks over tinyvila; run as modules from the repo root: `python -m scripts.bench`."""
