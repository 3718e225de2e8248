"""A/B of the W8A8 SigLIP-so400m encoder (synthetic weights, scripts/benches/w8a8.py's) under variants of the int8
GEMM dispatch or of the environment, graph-replayed, with the fp16 encoder timed in the same process for the ratio
(issue 4). Per image count and variant: ms of each round, x fp16, and whether the output equals the first
variant's bit for bit. `--rows` also times the three row kernels alone (graph-replayed) per variant.

    PYTHONPATH=. python scripts/diag/w8a8_encoder_ab.py [--images 1,8,64] [--rounds 3] [--rows]
        [--variants default,triton,s14,pp-all,pp64,one-pp64,one-pp128,env:TINYVILA_PDL=0]

Variants: default (the launcher as it is), triton (csrc_triton.w8a8_gemm.USE_WGMMA off), s14 (session 14's
dispatch: the 128 x 256 Gluon form for the residual GEMMs only), pp-all (ping-pong for every persistent-config
GEMM, fc2 included), pp64 (ping-pong at 64 x 128 tiles where the default runs it at 128 x 128), one-pp64 /
one-pp128 (also the one-image, non-persistent calls at K <= PINGPONG_MAX_K on ping-pong at that tile),
env:NAME=VALUE (the default dispatch with an environment variable set for the variant's run, e.g. a kernel's
A/B switch of a past commit: TINYVILA_PDL=0 at bf14043). Session 15 ran this logic from session-local copies
(runs S15-A, S15-B, S15-D, S15-F in docs/benchmarks.md).
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import csrc_triton.w8a8_gemm as wg  # noqa: E402
from benches import common  # noqa: E402
from benches import w8a8 as wb  # noqa: E402
from tinyvila.cuda_graph import GraphCache  # noqa: E402

DEFAULT_FORM = wg._wgmma_form
PP128, PP64 = (128, 128, 128, 4, 4), (64, 128, 128, 4, 4)


def _one_image(tile):
    """The default dispatch, plus ping-pong at `tile` for the non-persistent calls at short K (one image)."""
    def form(persistent, K, residual):
        if persistent:
            return DEFAULT_FORM(persistent, K, residual)
        return {"pingpong": True, "tile": tile} if K <= wg.PINGPONG_MAX_K else None
    return form


def _pp64(persistent, K, residual):
    f = DEFAULT_FORM(persistent, K, residual)
    return {"pingpong": True, "tile": PP64} if f == {"pingpong": True} else f


FORMS = {"default": DEFAULT_FORM, "triton": None, "pp64": _pp64, "one-pp64": _one_image(PP64),
         "one-pp128": _one_image(PP128),
         "s14": lambda p, K, r: ({"tile": (128, 256, 128, 8, 3)} if p and r is not None else None),
         "pp-all": lambda p, K, r: ({"pingpong": True} if p else None)}


class _Variant:
    """Within it, w8a8_gemm dispatches as the variant says (and its environment variable is set)."""

    def __init__(self, name: str):
        self.env = name[4:].split("=", 1) if name.startswith("env:") else None
        self.form = DEFAULT_FORM if self.env else FORMS[name]

    def __enter__(self):
        self.saved_env = os.environ.get(self.env[0]) if self.env else None
        if self.env:
            os.environ[self.env[0]] = self.env[1]
        wg.USE_WGMMA = self.form is not None
        wg._wgmma_form = self.form or DEFAULT_FORM

    def __exit__(self, *exc):
        wg.USE_WGMMA, wg._wgmma_form = True, DEFAULT_FORM
        if self.env:
            if self.saved_env is None:
                os.environ.pop(self.env[0], None)
            else:
                os.environ[self.env[0]] = self.saved_env


def _row_kernels(n_img: int, variants: list[str], rounds: int) -> None:
    from csrc_triton.gelu_quant import gelu_quant
    from csrc_triton.layer_norm_quant import layer_norm_quant
    from csrc_triton.quant_per_token import quant_per_token

    M = n_img * 729
    xs = [(torch.randn(M, 1152, device="cuda").half(),) for _ in range(3)]
    hs = [(torch.randn(M, 4304, device="cuda").half(),) for _ in range(3)]
    w, b = torch.randn(1152, device="cuda").half(), torch.randn(1152, device="cuda").half()
    for name, f, ins in (("layer_norm_quant", lambda x: layer_norm_quant(x, w, b, 1e-6), xs),
                         ("quant_per_token", quant_per_token, xs), ("gelu_quant", lambda h: gelu_quant(h, "gelu_tanh"), hs)):
        us, outs = {}, {}
        for _ in range(rounds):
            for v in variants:
                with _Variant(v):
                    us.setdefault(v, []).append(common.graph_ms(f, ins) * 1000)
                    outs.setdefault(v, f(*ins[0]))
        first = outs[variants[0]]
        print(f"{n_img:3d} images {name:17s} " + " | ".join(
            f"{v} {min(us[v]):.2f} us same {torch.equal(outs[v][0], first[0]) and torch.equal(outs[v][1], first[1])}"
            for v in variants), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="default,triton")
    ap.add_argument("--rows", action="store_true", help="also time the row kernels alone per variant")
    args = ap.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        if not v.startswith("env:") and v not in FORMS:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(FORMS)}, env:NAME=VALUE")
    images = [int(n) for n in args.images.split(",")]
    if args.rows:
        for n in images:
            _row_kernels(n, variants, args.rounds)
    dense, q = wb._encoders()
    S = q.cfg.image_size
    for n in images:
        px = [(torch.randn(n, 3, S, S, device="cuda", dtype=torch.float16),) for _ in range(2)]
        ms, outs = {}, {}
        for _ in range(args.rounds):
            g = GraphCache(dense._forward)
            ms.setdefault("fp16", []).append(common.bench(g, px, warmup=3, iters=20))
            del g
            for v in variants:
                with _Variant(v):
                    g = GraphCache(q._forward)
                    outs.setdefault(v, g(*px[0]).clone())
                    ms.setdefault(v, []).append(common.bench(g, px, warmup=3, iters=20))
                    del g
                torch.cuda.empty_cache()
        fp16 = min(ms.pop("fp16"))
        print(f"== {n} images: fp16 encoder {fp16:.3f} ms (min of {args.rounds})")
        for v in variants:
            print(f"  {v:24s} {' '.join(f'{t:.3f}' for t in ms[v])} ms  x fp16 {fp16 / min(ms[v]):.3f}  "
                  f"same bits as {variants[0]} {torch.equal(outs[v], outs[variants[0]])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
