"""Prefill salience per call, graph-replayed, in interleaved rounds (issue 5): the working tree's kernels against
another version of the kernel file, and/or against other default tiles.

    git show REV:csrc_triton/prefill_salience.py > /tmp/before.py
    PYTHONPATH=. python scripts/diag/salience_ab.py --before /tmp/before.py [--shapes siglip8,siglip64,4k,16k]
    PYTHONPATH=. python scripts/diag/salience_ab.py --tiles "128,64,4,3;256,64,8,3;128,64,4,2"
    PYTHONPATH=. python scripts/diag/salience_ab.py --tiles "128,64,4,3;128,64,8,3,0,0;64,64,4,3,128,128"

--before: both modules run the same fp16 inputs, standalone (both passes) and fused (the column pass alone, given a
natural-log LSE computed in fp32), and their maximum relative difference is printed. --tiles: each
(resident, streamed, warps, stages) is put in place as the module's DEFAULT_TILES, so it runs with the register caps of
the default (MAXNREG), which the bench's tile sweep (`tiles=`) does not apply, unless the config names its own
caps (",C1,C2": pass 1 and pass 2, 0 = none). Every config must give the first one's salience. Session 18 (run
S18-A) ran this code with a "/ss" or "/rs" suffix that set the since removed RESIDENT_IN_REGISTERS (commit d153117).
Per row: ms per call of each round (common.graph_ms: median over replays of a graph of back-to-back calls), then
the best. Session 13 (runs S13-A..C) ran this code from an uncommitted copy that took the min of 5
replays instead of the median.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benches import common  # noqa: E402
from benches.prefill_salience import SHAPES  # noqa: E402
import csrc_triton.prefill_salience as current  # noqa: E402


def _module(path: str):
    spec = importlib.util.spec_from_file_location("prefill_salience_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(B: int, H: int, N: int, D: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, H, N, D, device="cuda", generator=g, dtype=torch.float16) for _ in "qk")
    lse = torch.stack([torch.stack([torch.logsumexp((q[b, h].float() @ k[b, h].float().T) * D ** -0.5, -1)
                                    for h in range(H)]) for b in range(B)])  # per head: N x N fp32 at most
    return q, k, lse


def _row(name: str, times: list[float]) -> str:
    return f"  {name:28s} " + " ".join(f"{t:.4f}" for t in times) + f"  best {min(times):.4f} ms"


def _config(spec: str):
    """"R,S,W,P[,C1,C2]" -> (spec, (tiles, register caps or None: the default's))."""
    nums = [int(x) for x in spec.split(",")]
    caps = None if len(nums) == 4 else tuple(c or None for c in nums[4:6])
    return spec, (tuple(nums[:4]), caps)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="another version of csrc_triton/prefill_salience.py")
    ap.add_argument("--tiles", help='"R,S,W,P;..." default-tile configs to compare (the first is the baseline)')
    ap.add_argument("--shapes", default="siglip8,siglip64,4k,16k", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not args.before and not args.tiles:
        ap.error("give --before FILE and/or --tiles CONFIGS")
    before = _module(args.before) if args.before else None
    tiles = [_config(c) for c in args.tiles.split(";")] if args.tiles else []
    default = current.DEFAULT_TILES, current.MAXNREG
    for name in args.shapes.split(","):
        B, H, N, D = SHAPES[name]
        q, k, lse = _inputs(B, H, N, D)
        rows: dict[str, list[float]] = {}
        if before is not None:
            ref, old = current.prefill_salience(q, k), before.prefill_salience(q, k)
            print(f"{name} (B{B} H{H} N{N} D{D}): max relative difference, this tree vs --before: "
                  f"{((ref - old).abs().max() / old.abs().max()).item():.2e}")
            for _ in range(args.rounds):
                for tag, mod in (("before", before), ("this tree", current)):
                    rows.setdefault(f"{tag} standalone", []).append(common.graph_ms(mod.prefill_salience, [(q, k)]))
                    fused = lambda q_, k_, lse_, m=mod: m.prefill_salience(q_, k_, lse=lse_)  # noqa: E731
                    rows.setdefault(f"{tag} fused", []).append(common.graph_ms(fused, [(q, k, lse)]))
        if tiles:
            print(f"{name} (B{B} H{H} N{N} D{D}): default tiles")
            base = None
            try:
                for _ in range(args.rounds):
                    for name_t, (t, caps) in tiles:
                        current.DEFAULT_TILES = t
                        current.MAXNREG = default[1] if caps is None else caps
                        out = current.prefill_salience(q, k)
                        base = out if base is None else base
                        if (out - base).abs().max() > 1e-6 * base.abs().max():
                            raise AssertionError(f"tiles {name_t} give another salience")
                        rows.setdefault(name_t, []).append(common.graph_ms(current.prefill_salience, [(q, k)]))
            finally:
                current.DEFAULT_TILES, current.MAXNREG = default
        for key, times in rows.items():
            print(_row(key, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
