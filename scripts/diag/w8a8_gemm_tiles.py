"""W8A8 GEMMs at the SigLIP-so400m encoder's shapes (issue 4), each alone and graph-replayed, under configs other than
the launcher's: 256-deep K tiles (half the K steps, so half the per-step wgmma waits, but only 2 stages fit), as
persistent (plain and loop-flattened) and default kernels. Every config must give the launcher's output bit for bit
(DIFF otherwise; ERR where it does not fit).

    PYTHONPATH=. python scripts/diag/w8a8_gemm_tiles.py      (~30 s; session 13, run S13-G)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benches import common  # noqa: E402
import csrc_triton.w8a8_gemm as wg  # noqa: E402


def _persistent(bm, bn, bk, warps, stages, split, flatten):
    return wg.persistent_config((bm, bn, bk, warps, stages, split, flatten))


CONFIGS = {"auto": None,
           "p128x256x256s2": _persistent(128, 256, 256, 8, 2, 2, False),
           "p128x256x256s2f": _persistent(128, 256, 256, 8, 2, 2, True),
           "p256x128x256s2": _persistent(256, 128, 256, 8, 2, 2, False),
           "d128x256x256s2": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=256, GROUP_M=8, num_warps=8, num_stages=2, EPI_SPLIT=2)}
SHAPES = (("qkv", 3456, 1152, False), ("wo", 1152, 1152, True), ("fc1", 4304, 1152, False), ("fc2", 1152, 4304, True))


def main() -> int:
    for n_img in (8, 64):
        M = n_img * 729
        for name, N, K, res in SHAPES:
            sets = [(torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda"),
                     torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda"),
                     torch.rand(M, device="cuda"), torch.rand(N, device="cuda") * 1e-3,
                     torch.randn(N, device="cuda", dtype=torch.float16),
                     torch.randn(M, N, device="cuda", dtype=torch.float16) if res else None) for _ in range(2)]
            ref, row = None, []
            for cname, cfg in CONFIGS.items():
                def f(a, b, sa, sb, bias, r, cfg=cfg):
                    return wg.w8a8_gemm(a, b, sa, sb, bias, residual=r, config=cfg)
                try:
                    out = f(*sets[0])
                    ref = out if ref is None else ref
                    ms = min(common.graph_ms(f, sets) for _ in range(3))
                    row.append(f"{cname} {ms * 1000:.1f}us {2 * M * N * K / ms / 1e9:.0f}T{'' if torch.equal(out, ref) else ' DIFF'}")
                except Exception as e:  # noqa: BLE001 - a config that does not fit is a row, not the end
                    row.append(f"{cname} ERR {type(e).__name__}: {str(e)[:60]}")
            print(f"x{n_img} {name}: " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
