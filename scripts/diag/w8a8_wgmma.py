"""The Gluon W8A8 GEMM (csrc_triton/w8a8_gemm_wgmma.py: int8 wgmma kept in flight across K steps) against the
Triton kernel (csrc_triton/w8a8_gemm.py's own kernels, as the launcher ran them before the Gluon dispatch), at the
SigLIP-so400m encoder's GEMMs (wo and fc2 with the residual), each alone and graph-replayed (min of 3 rounds), 8
and 64 images by default (issue 4; at one image the Triton row is the launcher's non-persistent config). Per
config: us, TOPS, and whether the output equals the Triton kernel's bit for bit (else the fraction of equal
elements); max_diff_vs_ref against the plain PyTorch reference. `inflight0` is the same Gluon kernel waiting for
each wgmma before the next K step, the A/B for the overlap itself; `pingpong` the warp-specialised form (two
consumer warpgroups taking tiles in turn, one producer warp).

    PYTHONPATH=. python scripts/diag/w8a8_wgmma.py [--images 8,64] [--skip pingpong] [--grid] [--gemms fc2,qkv]
                                                                                   (~1-2 min on the H200)
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benches import common  # noqa: E402
import csrc_triton.w8a8_gemm as wg  # noqa: E402
import csrc_triton.w8a8_gemm_wgmma as gw  # noqa: E402

SHAPES = (("qkv", 3456, 1152, False), ("wo", 1152, 1152, True), ("fc1", 4304, 1152, False), ("fc2", 1152, 4304, True))
# name -> keyword arguments of w8a8_gemm_wgmma (tile: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES))
GLUON = {"p128x256s3": dict(tile=(128, 256, 128, 8, 3)),
         "p128x256s3_inflight0": dict(tile=(128, 256, 128, 8, 3), in_flight=0),
         "p256x128s3 (row halves)": dict(tile=(256, 128, 128, 8, 3)),
         "p256x128s3 g4": dict(tile=(256, 128, 128, 8, 3), group_m=4),  # fc2's dispatched form
         "pingpong128x128s4": dict(pingpong=True, tile=(128, 128, 128, 4, 4)),
         "pingpong128x128s5": dict(pingpong=True, tile=(128, 128, 128, 4, 5)),
         "pingpong64x128s4": dict(pingpong=True, tile=(64, 128, 128, 4, 4)),
         "pingpong64x128s6": dict(pingpong=True, tile=(64, 128, 128, 4, 6))}
# --grid adds these (session 15's sweep for fc2, run S15-C): ping-pong over GROUP_M and stages, 64-deep K steps,
# the row-halves form over GROUP_M (1, 2, 3, 6 and its 64-deep K steps added in session 16).
GRID = {**{f"pingpong s{s} g{g}": dict(pingpong=True, tile=(128, 128, 128, 4, s), group_m=g)
           for s in (4, 5) for g in (1, 4, 8, 16, 32)},
        **{f"pingpong bk64 s{s}": dict(pingpong=True, tile=(128, 128, 64, 4, s)) for s in (6, 8)},
        **{f"p256x128s3 g{g}": dict(tile=(256, 128, 128, 8, 3), group_m=g) for g in (1, 2, 3, 4, 6, 16)},
        "p256x128 bk64 s6 g4": dict(tile=(256, 128, 64, 8, 6), group_m=4)}


def _triton(a, b, sa, sb, bias, r):
    """The Triton kernel at the launcher's config, whatever USE_WGMMA says."""
    with wg.triton_kernels_only():
        return wg.w8a8_gemm(a, b, sa, sb, bias, residual=r)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", default="8,64")
    ap.add_argument("--skip", default="", help="comma-separated substrings: Gluon configs whose names hold one are skipped")
    ap.add_argument("--grid", action="store_true", help="also the GRID configs (GROUP_M, stages, K depth)")
    ap.add_argument("--gemms", default=",".join(s[0] for s in SHAPES))
    args = ap.parse_args()
    configs = {**GLUON, **(GRID if args.grid else {})}
    rows = []
    for n_img in (int(n) for n in args.images.split(",")):
        M = n_img * 729
        for name, N, K, res in SHAPES:
            if name not in args.gemms.split(","):
                continue
            sets = [(torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda"),
                     torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda"),
                     torch.rand(M, device="cuda") * 0.02, torch.rand(N, device="cuda") * 1e-3,
                     torch.randn(N, device="cuda", dtype=torch.float16),
                     torch.randn(M, N, device="cuda", dtype=torch.float16) if res else None) for _ in range(2)]
            fns = {"triton": _triton}
            skip = [x for x in args.skip.split(",") if x]
            for cname, kw in configs.items():
                if any(x in cname for x in skip):
                    continue
                fns[cname] = (lambda a, b, sa, sb, bias, r, kw=kw: gw.w8a8_gemm_wgmma(a, b, sa, sb, bias, residual=r,
                                                                                       **kw))
            ref = fns["triton"](*sets[0])
            want = wg.w8a8_gemm_ref(*sets[0][:5], residual=sets[0][5])
            t_ref = None
            for cname, f in fns.items():
                row = {"images": n_img, "gemm": name, "config": cname}
                try:
                    out = f(*sets[0])
                    ms = min(common.graph_ms(f, sets) for _ in range(3))
                    t_ref = ms if t_ref is None else t_ref
                    row.update(us=round(ms * 1000, 2), tops=round(2 * M * N * K / ms / 1e9), x_triton=round(t_ref / ms, 3),
                               same_bits=bool(torch.equal(out, ref)), frac_equal=round((out == ref).float().mean().item(), 5),
                               max_diff_vs_ref=float((out.float() - want.float()).abs().max()))
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is a row
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(row, flush=True)
            del sets
    common.print_table(rows)
    print(json.dumps({"bench": "w8a8_wgmma", "rows": rows, **common.environment()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
