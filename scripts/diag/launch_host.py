"""Host time per call of the launchers a prefill calls per layer (issue 7), on the CPU: Triton's dispatch
runs against a stub driver whose compiled kernels launch nothing (scripts/triton_stub.py), so a call costs
only its host work. vila-8b shapes at a follow-up question's T = 53 rows (fp16, W4 g128).

    PYTHONPATH=. python scripts/diag/launch_host.py [CALLS [BASE]]      (CPU only; run without TRITON_INTERPRET)

Columns: base (the launchers of git revision BASE, loaded with `git show BASE:`; default BASE_REV, the last
commit before the launch plans of csrc_triton/launch.py, so the column keeps meaning "before"), dispatch (this tree's plans, every
launch through Triton's dispatch: csrc_triton.launch.DIRECT_LAUNCH = False), direct (this tree as it runs).
Best of 5 x CALLS calls each (CPU noise only adds). CPU tensors, so torch.empty and views cost what they cost
on the CPU (~1 us), not CUDA's allocator; the C launch itself (cuLaunchKernelEx, a few us) is not included.
Prints a table, then one JSON line.
"""

import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
assert os.environ.get("TRITON_INTERPRET", "0") != "1", "the compiled-kernel path is timed: unset TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime import JITFunction, driver  # noqa: E402
from triton_stub import HostOnlyDriver, stub_compile  # noqa: E402

import csrc_triton.launch as launch  # noqa: E402

MODULES = ["add_rms_norm", "silu_mul", "rope_qkv", "w4a16_gemm", "w4a16_dequant", "retrieval_salience"]
T, DIM, H, HKV, HD, FFN, G, S = 53, 4096, 32, 8, 128, 14336, 128, 1024  # vila-8b (Llama-3-8B) prefill


BASE_REV = "d7548b8"  # the launchers before csrc_triton/launch.py's plans (session 8)


def _head_modules(tmp: Path, base: str = BASE_REV) -> dict:
    """Revision `base`'s csrc_triton as package `csrc_triton_head` (relative imports inside it resolve there)."""
    pkg = tmp / "csrc_triton_head"
    pkg.mkdir()
    files = subprocess.run(["git", "ls-tree", "--name-only", base, "csrc_triton/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        blob = subprocess.run(["git", "show", f"{base}:{f}"], cwd=ROOT, check=True, capture_output=True).stdout
        (pkg / Path(f).name).write_bytes(blob)
    sys.path.insert(0, str(tmp))
    return {m: importlib.import_module(f"csrc_triton_head.{m}") for m in MODULES}


def _stub_kernels(mods) -> list:
    """Every JITFunction of the modules launches nothing (Triton's dispatch still runs in full)."""
    fns = []
    for mod in mods:
        for v in vars(mod).values():
            if isinstance(v, JITFunction) and v.__name__.endswith("_kernel") and v not in fns:
                stub_compile(v, lambda *args: None)
                fns.append(v)
    return fns


def _w4(N, K):
    return (torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32), torch.rand(N, K // G).half() / 64,
            -torch.rand(N, K // G))


def _calls(mods: dict) -> dict:
    """name -> thunk calling module set `mods` at the issue's shapes."""
    x = torch.randn(1, T, DIM).half()
    r, w = torch.randn_like(x), torch.randn(DIM).half()
    gate_up = torch.randn(1, T, 2 * FFN).half()
    qkv = torch.randn(1, T, (H + 2 * HKV) * HD).half()
    cos, sin = torch.randn(T, HD).half(), torch.randn(T, HD).half()
    kc, vc = torch.zeros(1, HKV, S, HD).half(), torch.zeros(1, HKV, S, HD).half()
    slots = torch.arange(300, 300 + T)
    q = torch.randn(1, H, T, HD).half()
    lse = torch.randn(1, H, T)
    idx = torch.arange(5, 201, dtype=torch.int32)
    x2 = x.view(T, DIM)
    weights = {"qkv": _w4(6144, DIM), "o": _w4(DIM, DIM), "gate_up": _w4(2 * FFN, DIM), "down": _w4(DIM, FFN)}
    xs = {"qkv": x2, "o": x2, "gate_up": x2, "down": torch.randn(T, FFN).half()}
    ws = torch.empty(2 * FFN * DIM, dtype=torch.float16)
    out = {f"w4a16_gemm {n}": (lambda n=n: mods["w4a16_gemm"].w4a16_gemm(xs[n], *weights[n])) for n in weights}
    out |= {f"w4a16_dequant {n}": (lambda n=n: mods["w4a16_dequant"].w4a16_dequant(
        *weights[n], out=ws[:weights[n][0].shape[0] * weights[n][0].shape[1] * 8].view(weights[n][0].shape[0], -1)))
        for n in ("qkv", "gate_up")}
    out |= {
        "add_rms_norm 4096": lambda: mods["add_rms_norm"].add_rms_norm(x, r, w, 1e-5),
        "silu_mul 14336": lambda: mods["silu_mul"].silu_mul(gate_up),
        "rope_qkv 32/8 x 128": lambda: mods["rope_qkv"].rope_qkv(qkv, cos, sin, kc, vc, slots, H, HKV),
        "retrieval span 196": lambda: mods["retrieval_salience"].retrieval_salience(q, kc, range(5, 201), lse),
        "retrieval slots 196": lambda: mods["retrieval_salience"].retrieval_salience(q, kc, idx, lse),
    }
    return out


def _us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(calls: int, base: str = BASE_REV) -> None:
    saved = driver._active
    driver.set_active(HostOnlyDriver())
    with tempfile.TemporaryDirectory() as tmp:
        head = _head_modules(Path(tmp), base)
        new = {m: importlib.import_module(f"csrc_triton.{m}") for m in MODULES}
        _stub_kernels(list(head.values()) + list(new.values()))
        rows = {}
        old_calls, new_calls = _calls(head), _calls(new)
        for name in new_calls:
            t_head = _us(old_calls[name], calls)
            launch.DIRECT_LAUNCH = False
            t_dispatch = _us(new_calls[name], calls)
            launch.DIRECT_LAUNCH = True
            rows[name] = (t_head, t_dispatch, _us(new_calls[name], calls))
    driver.set_active(saved)
    print(f"host us per call, T={T} vila-8b prefill shapes, CPU tensors, C launch stubbed, best of 5 x {calls}")
    print(f"launcher | base {base} | plans + Triton dispatch | plans + direct launch | base / direct")
    for name, (a, b, c) in rows.items():
        print(f"{name} | {a:.1f} | {b:.1f} | {c:.1f} | {a / c:.1f}x")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(json.dumps({"bench": "launch_host", "cpu": platform.processor() or platform.machine(),
                      "torch": torch.__version__, "triton": triton.__version__, "commit": commit.strip(),
                      "dirty": True, "calls": calls, "us": {n: [round(v, 2) for v in r] for n, r in rows.items()},
                      "columns": ["head", "dispatch", "direct"]}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000, sys.argv[2] if len(sys.argv) > 2 else BASE_REV)
