"""Do the tensor cores and the MUFU (exp2) run at the same time on this GPU? (issues 5 and 6)

    PYTHONPATH=. python scripts/diag/pipe_overlap.py [--iters 2000] [--d 128]

The salience kernels' inner loop, without global memory traffic to speak of: each program keeps an (R, D) fp16
tile resident and, ITERS times, multiplies it by one of NB (D, S) tiles (L2-resident, the same for every
program) and sums exp2 of the scaled result over S, as pass 2 of the prefill salience and the retrieval kernel
do per key tile. Forms of the same loop, each a separate compile:

    base     x = s0 * c_i - 1              (s0: one product computed before the loop; FFMA + FADD a score)
    dot      x = (A B_i) * c_i - 1         (+ the wgmma)
    exp      x = exp2(s0 * c_i - 1)        (+ one MUFU ex2 a score)
    both     x = exp2((A B_i) * c_i - 1)   (the real loop)
    poly     exp as a cubic on the FMA pipe (FlashAttention-4's trick; ~1e-3 relative error: timing only)
    dotpoly  both, with the cubic

Each form's cost over base is its pipe's work; if the two pipes overlapped, `both` would cost about the larger
of the two, if they take turns, about their sum. Printed per tile config (R, S, warps, programs per SM): us per
launch (median of CUDA-event timings), the dot and exp costs over base, both's, and the overlap
(dot + exp - both) / min(dot, exp): 1 = the smaller pipe fully hidden, 0 = none. One JSON line at the end.
The streamed operand comes from L2 (2 D / R bytes a score with A resident, 2 D / S with --stream-a): at the
smaller tiles that traffic, not the pipes, can set the time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benches import common  # noqa: E402
from csrc_triton.retrieval_salience import _resident  # noqa: E402

NB = 4  # distinct streamed tiles (L2-resident)
FORMS = {"base": (False, 0), "dot": (True, 0), "exp": (False, 1), "both": (True, 1), "poly": (False, 2),
         "dotpoly": (True, 2)}
# (resident rows R, streamed rows S, num_warps, programs per SM, D): the salience passes' default tile first
# (their D = 80 is a chain of a 64 and a 16 dot; here D is a power of two).
# The D = 128 rows at the end: the same kind of tiles at the retrieval kernel's head dim, with the operands in the
# salience's roles (the wide operand streams); STREAM_CONFIGS put them in the retrieval kernel's roles.
CONFIGS = [(128, 64, 4, 4, 64), (128, 64, 4, 4, 128), (128, 64, 4, 2, 64), (128, 64, 8, 2, 64), (64, 64, 4, 4, 64),
           (64, 64, 4, 8, 64), (128, 128, 8, 1, 64), (128, 128, 8, 2, 64),
           (64, 256, 4, 2, 128), (64, 128, 4, 4, 128), (64, 64, 4, 4, 128), (64, 64, 4, 8, 128), (128, 64, 8, 2, 128)]
# --stream-a: the retrieval kernel's gather tile first (64 keys x 256 rows, 4 warps, 2 an SM), then splits of a KV
# group's 256 question rows over 2 or 4 programs.
STREAM_CONFIGS = [(64, 256, 4, 2, 128), (64, 128, 4, 4, 128), (128, 128, 8, 2, 128), (128, 64, 8, 2, 128),
                  (128, 64, 4, 4, 128), (64, 64, 4, 8, 128), (128, 256, 8, 1, 128)]


@triton.jit
def _exp2_cubic(x):
    """2^x on the FMA pipe: x = j + f (j rounded by the 1.5 * 2^23 trick, |f| <= 1/2), 2^f by a cubic, j added
    to the exponent bits. x >= -126 here (the loop's arguments are near -1)."""
    jm = x + 12582912.0
    f = x - (jm - 12582912.0)
    p = ((0.05550411 * f + 0.24022652) * f + 0.69314718) * f + 1.0
    return (p.to(tl.int32, bitcast=True) + (jm.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _pipes_kernel(a_ptr, b_ptr, out_ptr, iters, c, R: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                  NB_: tl.constexpr, DOT: tl.constexpr, EXP: tl.constexpr, STREAM_A: tl.constexpr):
    """See the module docstring; EXP: 0 none, 1 exp2 (MUFU), 2 the cubic (FMA pipe). STREAM_A: the (R, D)
    operand streams (NB tiles at a_ptr) and the (D, S) one stays (the retrieval kernel's roles)."""
    pid = tl.program_id(0)
    r = tl.arange(0, R)
    d = tl.arange(0, D)
    cols = tl.arange(0, S)
    if STREAM_A:
        b = tl.load(b_ptr + (pid % 8) * S * D + d[:, None] + cols[None, :] * D)  # (D, S) resident
        a = tl.load(a_ptr + r[:, None] * D + d[None, :])
    else:
        a = tl.load(a_ptr + (pid % 8) * R * D + r[:, None] * D + d[None, :])  # (R, D) resident
        b = tl.load(b_ptr + d[:, None] + cols[None, :] * D)
    s0 = tl.dot(a, b)  # (R, S) fp32, before the loop
    acc = tl.zeros([R], tl.float32)
    for i in range(iters):
        ci = c + i * 1e-9  # a scale that changes every step, so nothing is hoisted
        if DOT:
            if STREAM_A:
                s = tl.dot(tl.load(a_ptr + (i % NB_) * R * D + r[:, None] * D + d[None, :]), b)
            else:  # (D, S): B_i transposed
                s = tl.dot(a, tl.load(b_ptr + (i % NB_) * S * D + d[:, None] + cols[None, :] * D))
        else:
            s = s0
        x = s * ci - 1.0
        if EXP == 1:
            x = tl.exp2(x)
        elif EXP == 2:
            x = _exp2_cubic(x)
        acc += tl.sum(x, axis=1)
    tl.store(out_ptr + pid * R + r, acc)


def _meta(R: int, S: int, W: int, D: int, form: str, stream_a: bool) -> dict:
    dot, exp = FORMS[form]
    return dict(R=R, S=S, D=D, NB_=NB, DOT=dot, EXP=exp, STREAM_A=stream_a, num_warps=W, num_stages=2 if stream_a else 3)


def _inputs(R: int, S: int, D: int, programs: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = (0.1 * torch.randn(max(8, NB), R, D, device="cuda", generator=g)).half()
    b = (0.1 * torch.randn(max(8, NB), S, D, device="cuda", generator=g)).half()
    return a, b, torch.empty(programs, R, device="cuda")


def _fit(R: int, S: int, W: int, D: int, stream_a: bool) -> int:
    """Programs of the real loop (form both) that fit on one SM (the retrieval launcher's count: registers, shared
    memory, threads)."""
    k = _pipes_kernel[(1,)](*_inputs(R, S, D, 1), 1, 0.5, **_meta(R, S, W, D, "both", stream_a))
    return _resident(k, W, torch.device("cuda"))


def _time(R: int, S: int, W: int, per_sm: int, D: int, form: str, iters: int, stream_a: bool) -> float:
    """us per launch of per_sm programs per SM."""
    grid = torch.cuda.get_device_properties(0).multi_processor_count * per_sm
    a, b, out = _inputs(R, S, D, grid)
    meta = _meta(R, S, W, D, form, stream_a)

    def call():
        _pipes_kernel[(grid,)](a, b, out, iters, 0.5, **meta)

    return 1e3 * common.bench(call, [()], warmup=3, iters=15)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--d", type=int, help="only the configs of this head dim")
    ap.add_argument("--stream-a", action="store_true", help="stream the (R, D) operand, keep the (D, S) one "
                    "(the retrieval kernel's roles: R keys a tile, S question rows a program; STREAM_CONFIGS)")
    args = ap.parse_args()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print("R, S, warps, programs/SM, D | us per launch: base dot exp both | costs over base: dot exp both | overlap "
          "| exp2 per SM per ns (MUFU peak at 1.98 GHz: 31.7) | poly: us poly dotpoly, costs poly dotpoly, overlap")
    configs = STREAM_CONFIGS if args.stream_a else CONFIGS
    for R, S, W, per_sm, D in (c for c in configs if args.d in (None, c[4])):
        per_sm = min(per_sm, _fit(R, S, W, D, args.stream_a))  # whole waves of what fits
        t = {f: _time(R, S, W, per_sm, D, f, args.iters, args.stream_a) for f in FORMS}
        dot, exp, both = (t[f] - t["base"] for f in ("dot", "exp", "both"))
        overlap = (dot + exp - both) / min(dot, exp)
        poly, dotpoly = t["poly"] - t["base"], t["dotpoly"] - t["base"]
        overlap_poly = (dot + poly - dotpoly) / min(dot, poly)
        exps = n_sm * per_sm * args.iters * R * S
        rate = exps / n_sm / (t["both"] * 1e3)
        rows.append(dict(R=R, S=S, warps=W, per_sm=per_sm, D=D, **{f"us_{f}": t[f] for f in FORMS},
                         cost_dot=dot, cost_exp=exp, cost_both=both, overlap=overlap, exp2_per_sm_ns=rate,
                         cost_poly=poly, cost_dotpoly=dotpoly, overlap_poly=overlap_poly))
        print(f"{R}, {S}, {W}, {per_sm}, {D} | {t['base']:.1f} {t['dot']:.1f} {t['exp']:.1f} {t['both']:.1f} | "
              f"{dot:.1f} {exp:.1f} {both:.1f} | {overlap:.2f} | {rate:.1f} | {t['poly']:.1f} {t['dotpoly']:.1f}, "
              f"{poly:.1f} {dotpoly:.1f}, {overlap_poly:.2f}")
    print(json.dumps({"bench": "pipe_overlap", "iters": args.iters, "stream_a": args.stream_a,
                      "env": common.environment(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
