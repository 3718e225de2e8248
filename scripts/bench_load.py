"""Load time of a checkpoint with and without the finite-weight check (`tinyvila.load(verify=...)`).

    python -m scripts.bench_load --preset vila-8b --layers 4 --device cpu
    python -m scripts.bench_load --preset vila-8b --device cuda          # the whole 8B (17 GB on disk)

Writes a synthetic checkpoint of the preset (its LLM cut to --layers) into a temporary folder beside --dir, loads it
--repeats times each way (the page cache warm after the first load, as a second start of the same model is), and
prints the median load times and their difference, then one JSON line. The check reads every weight once: on the CPU
that is every page of the memory map, on a GPU one pass over the uploaded weights (tinyvila/loader.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import tinyvila
from scripts.benches import common
from tinyvila.config import preset
from tinyvila.loader import build_synthetic


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="vila-8b")
    p.add_argument("--layers", type=int, help="LLM layers (default: the preset's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoint is written")
    return p.parse_args(argv)


def load_ms(folder: Path, device: str, verify: bool) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    vlm = tinyvila.load(folder, device=device, verify=verify)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - t0)
    del vlm
    return ms


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = preset(args.preset)
    if args.layers:
        cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_layers=args.layers))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = build_synthetic(Path(tmp) / "model", cfg, seed=0)
        gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
        load_ms(folder, args.device, False)  # warm the page cache
        times = {v: statistics.median(load_ms(folder, args.device, v) for _ in range(args.repeats))
                 for v in (False, True)}
    print(f"{args.preset} ({gb:.2f} GB of weights) on {args.device}: load {times[False]:.0f} ms, with the finite "
          f"check {times[True]:.0f} ms (+{times[True] - times[False]:.0f} ms)")
    print(json.dumps({"bench": "load", **vars(args), "weights_gb": gb, "load_ms": times[False],
                      "load_verify_ms": times[True], **common.environment()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
