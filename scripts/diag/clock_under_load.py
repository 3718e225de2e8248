"""SM clock, power and throttle reasons while the 16K prefill-salience kernels run back to back (issue 5: is the
pass power-bound?). nvidia-smi samples every 50 ms over ~2 s of calls; prints ms per call, then the samples.

    PYTHONPATH=. python scripts/diag/clock_under_load.py     (one GPU, ~10 s; run S7-B, docs/perf_notes.md)
"""

import subprocess
import time

import torch

from csrc_triton.prefill_salience import prefill_salience


def main(seconds: float = 2.0) -> None:
    q, k = (torch.randn(1, 16, 16384, 80, device="cuda", dtype=torch.float16) for _ in "qk")
    for _ in range(3):
        prefill_salience(q, k)
    torch.cuda.synchronize()
    mon = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active,"
                            "temperature.gpu", "--format=csv,noheader", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            prefill_salience(q, k)
        torch.cuda.synchronize()
        n += 20
    dt = time.perf_counter() - t0
    time.sleep(0.3)
    mon.terminate()
    print(f"{n} calls, {1000 * dt / n:.3f} ms per call")
    print(mon.communicate()[0])


if __name__ == "__main__":
    main()
