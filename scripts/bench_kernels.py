"""Kernel benchmarks on the GPU: each tinyvila kernel against its naive form and its peer.

    PYTHONPATH=. python scripts/bench_kernels.py [--only NAME ...]

Every bench module in scripts/benches/ (one per kernel family) exposes `run(args) -> list[dict]`;
this script runs the selected ones and prints, for each, a table then one JSON line (GPU, versions,
commit). Results that back a claim go into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benches import common  # noqa: E402


def available() -> list[str]:
    folder = Path(__file__).resolve().parent / "benches"
    return sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if m.name != "common")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=None, help=f"subset of: {', '.join(available())}")
    p.add_argument("--quick", action="store_true", help="fewer shapes and iterations (smoke run)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 1
    failed = []
    for name in args.only or available():
        try:  # one broken bench must not hide the others' numbers
            module = importlib.import_module(f"benches.{name}")
            common.emit(name, module.run(args))
        except Exception:
            traceback.print_exc()
            failed.append(name)
        torch.cuda.empty_cache()
    if failed:
        print(f"failed benches: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
