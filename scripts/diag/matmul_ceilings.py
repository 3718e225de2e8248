"""What the tensor cores deliver on this GPU, per precision, and at what clock and power (issue 4).

The W8A8 encoder's target (1.5x the fp16 encoder) presumes int8 runs near twice fp16, as the data sheet
says (H100/H200: 989 dense fp16 TFLOP/s, 1979 int8 TOPS). Run R7 measured torch._int_mm at 943 TOPS against
fp16's 754 TFLOP/s: 1.25x. This script asks whether that is the chip under its power cap or the int8 path:
fp16 and bf16 matmul, torch._int_mm (int8 -> int32), torch._scaled_mm in fp8 e4m3 (the same tensor-core rate
as int8 on Hopper), and tinyvila's Triton w8a8_gemm, at 8192^3 and at the SigLIP-so400m fc1 shape of 64 images
(M = 46656, K = 1152, N = 4304). Each case runs back to back for ~1 s (the chip settles at its power
limit), then nvidia-smi reports SM clock, power and throttle reasons while the same loop is still running.

    PYTHONPATH=. python scripts/diag/matmul_ceilings.py      (one GPU, ~1 min; a table, then one JSON line)
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402

SHAPES = {"8192^3": (8192, 8192, 8192), "siglip fc1 x64": (46656, 1152, 4304)}


def smi() -> str:
    """SM clock, power draw and active throttle reasons, now."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return repr(e)


def cases(M: int, K: int, N: int) -> dict:
    """name -> zero-argument call computing (M, K) x (K, N) in that precision."""
    dev = "cuda"
    a16 = torch.randn(M, K, device=dev, dtype=torch.float16)
    b16 = torch.randn(N, K, device=dev, dtype=torch.float16)
    abf, bbf = a16.bfloat16(), b16.bfloat16()
    a8 = torch.randint(-127, 128, (M, K), device=dev, dtype=torch.int8)
    b8 = torch.randint(-127, 128, (N, K), device=dev, dtype=torch.int8)
    out = {"fp16 mm": lambda: a16 @ b16.t(), "bf16 mm": lambda: abf @ bbf.t(),
           "int8 torch._int_mm": lambda: torch._int_mm(a8, b8.t())}
    try:
        af, bf = a16.to(torch.float8_e4m3fn), b16.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        torch._scaled_mm(af, bf.t(), one, one, out_dtype=torch.float16)
        out["fp8 e4m3 torch._scaled_mm"] = lambda: torch._scaled_mm(af, bf.t(), one, one, out_dtype=torch.float16)
    except (RuntimeError, AttributeError, TypeError) as e:
        print(f"fp8 _scaled_mm unavailable: {e}")
    from csrc_triton.w8a8_gemm import w8a8_gemm
    sa = torch.rand(M, device=dev) + 0.5
    sb = torch.rand(N, device=dev) + 0.5
    out["int8 tinyvila w8a8_gemm"] = lambda: w8a8_gemm(a8, b8, sa, sb)
    return out


def measure(fn, seconds: float = 1.0) -> tuple[float, str]:
    """Median ms per call over a back-to-back loop of ~`seconds`, and nvidia-smi sampled mid-loop."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = max(5, int(seconds / max(time.perf_counter() - t0, 1e-6)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    sample = {}
    timer = threading.Timer(0.6 * seconds, lambda: sample.setdefault("smi", smi()))
    timer.start()
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    timer.join()
    ms = sorted(s.elapsed_time(e) for s, e in events)
    return ms[len(ms) // 2], sample.get("smi", "")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("matmul_ceilings.py needs a CUDA GPU")
    rows = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  idle: {smi()}")
    for shape, (M, K, N) in SHAPES.items():
        for name, fn in cases(M, K, N).items():
            ms, state = measure(fn)
            rate = 2 * M * K * N / ms / 1e9
            rows.append({"shape": shape, "case": name, "ms": round(ms, 4), "T(FL)OP/s": round(rate, 1),
                         "smi (clock, power, throttle)": state})
            print(f"{shape:16s} {name:28s} {ms:9.4f} ms {rate:8.1f} T/s   {state}", flush=True)
        torch.cuda.empty_cache()
    print(json.dumps({"matmul_ceilings": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
