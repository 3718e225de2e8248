"""Where a SigLIP-so400m encoder's device time goes (issue 4): one eager forward of the W8A8 and the fp16 encoder
(synthetic weights, scripts/benches/w8a8.py's) under torch.profiler, device ms per kernel name, largest first.

    PYTHONPATH=. python scripts/diag/encoder_profile.py [--images 64] [--top 25]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benches import w8a8  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    dense, quant = w8a8._encoders()
    S = quant.cfg.image_size
    px = torch.randn(args.images, 3, S, S, device="cuda", dtype=torch.float16)
    for name, fn in (("w8a8", quant._forward), ("fp16", dense._forward)):
        with torch.no_grad():
            for _ in range(3):
                fn(px)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn(px)
                torch.cuda.synchronize()
        rows = sorted(((e.key, e.count, e.self_device_time_total / 1000) for e in prof.key_averages()
                       if e.self_device_time_total > 0), key=lambda r: -r[2])
        print(f"== {name} x{args.images}: total device {sum(r[2] for r in rows):.2f} ms")
        for key, count, ms in rows[:args.top]:
            print(f"  {ms:8.3f} ms  {count:5d}x  {ms / count * 1000:8.1f} us  {key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
