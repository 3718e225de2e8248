"""Where the Gluon retrieval kernel's time goes (issue 6): the kernel with parts of its work taken out.

    PYTHONPATH=. python scripts/diag/retrieval_ablate.py     (one H200, ~1 minute)

Copies of csrc_triton/retrieval_salience_wgmma.py with source edits, applied before the kernels compile, one
module per variant (written to a temporary directory and imported):
  real     the module as it is;
  noexp    each tile's sum over the question is of the raw logits (no FMA, no exp2: the MUFU idle);
  nomma    no wgmma (ping-pong form): each tile's "logits" are a per-key-row ramp (the tensor cores idle; the
           exponentials, the key loads and the ring's barriers stay);
  neither  both (what is left: the key loads through the ring, the barriers, the sums and the stores);
  polyexp  every exponential on the FMA pipe (a polynomial, POLY; not exact at padded rows: timing only);
  halfpoly the ping-pong's second warpgroup's tiles (every other tile) with the polynomial, the first's with MUFU.
Each at Llama-3-8B shapes (32 query heads, 8 KV heads, D = 128, fp16), a T-token question over a 32K range:
every variant in the ping-pong form, real and noexp in the halves form, graph-replayed like
scripts/benches/retrieval_variants.py. Then nvidia-smi's SM clock and power while the real kernel runs back to
back for ~2 s. Prints rows, then one JSON line.
"""

import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
from retrieval_variants import graph_us, question  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "csrc_triton" / "retrieval_salience_wgmma.py"
MASS = "    return gl.sum(gl.exp2(s * scale_log2 - gl.expand_dims(lse2, 0)), axis=1)"
NOEXP = "    return gl.sum(s, axis=1) + gl.sum(gl.expand_dims(lse2, 0) * 0.0, axis=1)"
MMA_PP = "        acc = warpgroup_mma(k_smem.index(s), q_t, zero, use_acc=False, is_async=True)"
NOMMA_PP = ("        acc = warpgroup_mma_init(zero + gl.expand_dims((offs + t).to(gl.float32), 1) * 1e-3)")
# 2^x on the FMA pipe (the MUFU idle): x = n + f, n = round(x) by the 1.5 * 2^23 trick, 2^f by a degree-5
# polynomial on [-0.5, 0.5] (Taylor: relative error ~3e-6, enough for timing), n added to the exponent bits;
# x clamped at -126 (padded rows give ~1e-38 instead of 0: a timing variant, not exact).
POLY = '''

@gluon.jit
def _exp2_fma(x):
    x = gl.maximum(x, -126.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = 1.3333558146428443e-03 * f + 9.6181291076284772e-03
    p = p * f + 5.5504108664821580e-02
    p = p * f + 2.4022650695910071e-01
    p = p * f + 6.9314718055994531e-01
    p = p * f + 1.0
    bits = p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _mass_poly(s, lse2, scale_log2, POLY: gl.constexpr):
    if POLY:
        return gl.sum(_exp2_fma(s * scale_log2 - gl.expand_dims(lse2, 0)), axis=1)
    return gl.sum(gl.exp2(s * scale_log2 - gl.expand_dims(lse2, 0)), axis=1)
'''
EMIT_PP = "_emit(o_base + t * BLOCK_N + offs, _mass(acc, lse2, scale_log2),"
EDITS = {"real": [], "noexp": [(MASS, NOEXP)], "nomma": [(MMA_PP, NOMMA_PP)],
         "neither": [(MASS, NOEXP), (MMA_PP, NOMMA_PP)],
         "polyexp": [(EMIT_PP, "_emit(o_base + t * BLOCK_N + offs, _mass_poly(acc, lse2, scale_log2, True),")],
         "halfpoly": [(EMIT_PP, "_emit(o_base + t * BLOCK_N + offs, _mass_poly(acc, lse2, scale_log2, WG == 1),")]}


def variant(name: str, tmp: Path):
    """Import a copy of the module with EDITS[name] applied (each edit must match exactly once)."""
    text = SRC.read_text()
    for old, new in EDITS[name]:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    text = text.replace("from triton.experimental.gluon.language.nvidia.hopper import (",
                        "from triton.experimental.gluon.language.nvidia.hopper import (warpgroup_mma_init, ")
    if "_mass_poly" in text:  # the helpers go right after _mass
        text = text.replace("\n\n@gluon.jit\ndef _emit(", POLY + "\n\n@gluon.jit\ndef _emit(", 1)
    path = tmp / f"rw_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"rw_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    rows = []
    S = 32768
    with tempfile.TemporaryDirectory() as d:
        mods = {name: variant(name, Path(d)) for name in EDITS}
        for T in (64, 16):
            q, k, _, lse = question(T, seed=T)
            out = torch.empty(1, 8, S, device="cuda")
            for form, names in (("pingpong", list(EDITS)), ("halves", ["real", "noexp"])):
                for name in names:
                    us = graph_us(functools.partial(mods[name].retrieval_salience_wgmma, q, k, range(0, S), lse,
                                                    128 ** -0.5, out, False, form=form))
                    rows.append(dict(T=T, form=form, variant=name, us=round(us, 2)))
                    print(f"T={T:<4} {form:<9} {name:<8} {us:8.2f} us", flush=True)
        q, k, _, lse = question(64)
        out = torch.empty(1, 8, S, device="cuda")
        real = mods["real"]
        mon = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                                "--format=csv,noheader", "-lms", "100"], stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 2.0:
            for _ in range(200):
                real.retrieval_salience_wgmma(q, k, range(0, S), lse, 128 ** -0.5, out, False)
            torch.cuda.synchronize()
            n += 200
        dt = time.perf_counter() - t0
        mon.terminate()
        samples = mon.communicate()[0].strip().splitlines()
        print(f"back to back: {n} calls, {1e6 * dt / n:.2f} us a call (eager); nvidia-smi samples:")
        print("\n".join(samples))
        rows.append(dict(case="back to back", us=round(1e6 * dt / n, 2), samples=samples))
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows)))


if __name__ == "__main__":
    main()
