"""What a read-only kernel gets from HBM at the W4 decode GEMVs' shapes (issues 3, 7): the ceiling any GEMV with
the same grid could reach, per call, graph-replayed.

Each program reads BN rows x K/8 int32 words of packed weights, W words a row per step, pipelined over `stages`,
and stores one word (so the loads are not dead code): a GEMV's weight traffic with none of its arithmetic. Three
layouts of the same bytes at the same grid: `rows` (the runtime's row-major packed weights: each step reads BN
runs of 4 W bytes, rows K/2 bytes apart), `tiled` (each program-step's BN x W block contiguous, as a pre-tiled
checkpoint layout would make it), `flat` (each program one contiguous range). Fractions are of the measured
device-to-device copy bandwidth (read + write bytes), the unit of issue 3's target.

    PYTHONPATH=. python scripts/diag/read_pattern.py      (one GPU, ~15 s; a table, then one JSON line)

`--pdl` instead times the `rows` layout launched three ways, graph-replayed back to back as the GEMV bench replays
the GEMVs: `plain` (no programmatic dependent launch), `enter` (PDL, each program waiting for its predecessor before
its first load, as every decode-step kernel does: csrc_triton/pdl.py), and `early` (PDL, the loads issued before the
wait, which only guards the one store: a weight read depends on no earlier kernel, so this is the most overlap of
consecutive calls any GEMV could get for its weights). The question it answers (issue 3): what a kernel that only
reads a GEMV's weights reaches per call in the GEMV bench's own conditions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benches import common  # noqa: E402
from csrc_triton import pdl  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TILES = [(128, 64, 3, 4), (64, 128, 3, 4), (64, 64, 4, 4), (32, 128, 4, 4), (16, 128, 4, 4), (128, 128, 3, 8)]
LAYOUTS = ("rows", "tiled", "flat")


@triton.jit
def _read(ptr, out_ptr, K8, BN: tl.constexpr, W: tl.constexpr, STAGES: tl.constexpr, LAYOUT: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    acc = tl.zeros((BN, W), dtype=tl.int32)
    n_steps = K8 // W
    for s in tl.range(0, n_steps, num_stages=STAGES):
        if LAYOUT == 0:  # rows: row r's words [s W, s W + W) at r K8 + s W
            offs = rows[:, None] * K8 + s * W + tl.arange(0, W)[None, :]
        elif LAYOUT == 1:  # tiled: block (pid, s) is BN W contiguous words
            offs = (pid * n_steps + s) * (BN * W) + tl.arange(0, BN)[:, None] * W + tl.arange(0, W)[None, :]
        else:  # flat: program pid's BN K8 words in one range, BN W of them per step
            offs = pid * BN * K8 + s * (BN * W) + tl.arange(0, BN)[:, None] * W + tl.arange(0, W)[None, :]
        acc ^= tl.load(ptr + offs)
    tl.store(out_ptr + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0))


@triton.jit
def _read_pdl(ptr, out_ptr, K8, BN: tl.constexpr, W: tl.constexpr, STAGES: tl.constexpr, EARLY: tl.constexpr):
    """`_read`'s `rows` layout under PDL: EARLY issues every load before waiting for the predecessor (only the
    store waits), else the program waits first (pdl.enter)."""
    if EARLY:
        pdl.launch_dependents(True)
    else:
        pdl.enter(True)
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    acc = tl.zeros((BN, W), dtype=tl.int32)
    for s in tl.range(0, K8 // W, num_stages=STAGES):
        acc ^= tl.load(ptr + rows[:, None] * K8 + s * W + tl.arange(0, W)[None, :])
    if EARLY:
        pdl.wait(True)
    tl.store(out_ptr + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def read_gbs(N: int, K: int, bn: int, w: int, stages: int, warps: int, layout: int, mode: str | None = None) -> float:
    """GB/s of the weights read, per call graph-replayed; mode None: `_read` (layout), else "plain" / "enter" /
    "early" (`--pdl`, the rows layout)."""
    K8 = K // 8
    sets = [(torch.randint(-2**31, 2**31 - 1, (N * K8,), dtype=torch.int32, device="cuda"),) for _ in range(4)]
    sink = torch.empty(N // bn, dtype=torch.int32, device="cuda")
    if mode is None or mode == "plain":
        fn = lambda wt: _read[(N // bn,)](wt, sink, K8, BN=bn, W=w, STAGES=stages, LAYOUT=layout, num_warps=warps)
    else:
        fn = lambda wt: _read_pdl[(N // bn,)](wt, sink, K8, BN=bn, W=w, STAGES=stages, EARLY=mode == "early",
                                              num_warps=warps, launch_pdl=True)
    ms = common.graph_ms(fn, sets)
    return N * K8 * 4 / ms / 1e6


def main_pdl() -> int:
    """The `--pdl` table: fraction of copy bandwidth per shape, tile and launch mode (rows layout)."""
    copy = common.copy_bandwidth_gbs()
    rows = []
    for name, (N, K) in SHAPES.items():
        for bn, w, stages, warps in TILES:
            row = {"shape": name, "BN": bn, "W": w, "stages": stages, "warps": warps, "programs": N // bn}
            for mode in ("plain", "enter", "early"):
                row[f"{mode}_of_copy"] = round(read_gbs(N, K, bn, w, stages, warps, 0, mode) / copy, 3)
            rows.append(row)
            print(row, flush=True)
    common.print_table(rows)
    print(json.dumps({"bench": "read_pattern_pdl", "copy_gbs": round(copy), "rows": rows, **common.environment()}))
    return 0


def main() -> int:
    copy = common.copy_bandwidth_gbs()
    rows = []
    for name, (N, K) in SHAPES.items():
        for bn, w, stages, warps in TILES:
            row = {"shape": name, "N": N, "K": K, "BN": bn, "W": w, "stages": stages, "warps": warps,
                   "programs": N // bn}
            for i, lay in enumerate(LAYOUTS):
                row[f"{lay}_of_copy"] = round(read_gbs(N, K, bn, w, stages, warps, i) / copy, 3)
            rows.append(row)
            print(row, flush=True)
    common.print_table(rows)
    print(json.dumps({"bench": "read_pattern", "copy_gbs": round(copy), "rows": rows, **common.environment()}))
    return 0


if __name__ == "__main__":
    sys.exit(main_pdl() if "--pdl" in sys.argv else main())
