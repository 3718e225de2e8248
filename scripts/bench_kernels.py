"""Kernel benchmarks on the GPU: each tinyvila kernel against its naive form and its peer.

    python -m scripts.bench_kernels [--only NAME ...] [--quick] [a bench's own flags, see --help]

Every module in scripts/benches/ but common (one per kernel family) exposes `run(args) -> list[dict]` and
may add flags of its own (sweeps, shapes) with `add_args(parser)`; this runs the selected benches and
prints, for each, a table then one JSON line (GPU, versions, commit). Results that back a claim go into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import traceback
from pathlib import Path

import torch

from scripts.benches import common


def available() -> list[str]:
    folder = Path(__file__).resolve().parent / "benches"
    return sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if m.name != "common")


def load_benches() -> tuple[dict, dict]:
    """({name: module}, {name: the import's traceback}): one bench that does not import must not hide the others."""
    modules, broken = {}, {}
    for name in available():
        try:
            modules[name] = importlib.import_module(f"scripts.benches.{name}")
        except Exception:
            broken[name] = traceback.format_exc()
    return modules, broken


def parse_args(argv, modules: dict):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=None, choices=available(), metavar="NAME",
                   help=f"subset of: {', '.join(available())}")
    p.add_argument("--quick", action="store_true", help="fewer shapes and iterations (smoke run)")
    for name, module in modules.items():
        if hasattr(module, "add_args"):
            module.add_args(p.add_argument_group(f"{name} (scripts/benches/{name}.py)"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    modules, broken = load_benches()
    for name, trace in broken.items():  # said before parsing: a broken bench's own flags are unknown
        print(f"bench {name} does not import: {trace.strip().splitlines()[-1]}", file=sys.stderr)
    args = parse_args(argv, modules)
    names = args.only or available()
    if not torch.cuda.is_available() and not all(getattr(modules.get(n), "CPU_OK", False) for n in names):
        print("bench_kernels needs a CUDA GPU (of the benches, only encode_path also runs on the CPU)", file=sys.stderr)
        return 1
    failed = []
    for name in names:
        if name in broken:
            print(broken[name], file=sys.stderr)
            failed.append(name)
            continue
        try:  # one broken bench must not hide the others' numbers
            common.emit(name, modules[name].run(args))
        except Exception:
            traceback.print_exc()
            failed.append(name)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if failed:
        print(f"failed benches: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
