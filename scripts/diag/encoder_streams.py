"""Do concurrent streams fill the W8A8 encoder's partial waves? (issue 4, session 16)

At 8 SigLIP images the encoder's persistent int8 GEMMs end in partial waves (fc2: 207 tiles of 256 x 128 on 132
SMs, wo: 414 tiles of 128 x 128), each kernel's ramp and drain leave SMs idle, and stream-K measured slower (S16).
This times the synthetic so400m encoder (scripts/benches/w8a8.py's) with its images split into `branches` equal
groups, each group's forward on its own CUDA stream (forked from and joined to the caller's, one graph), so one
group's kernels can run on the SMs another's leave idle; fp16 and W8A8 alike, graph-replayed, and checks that every
split gives each image the unsplit forward's features bit for bit.

    PYTHONPATH=. python scripts/diag/encoder_streams.py [--images 8,64] [--branches 1,2,4] [--rounds 3]
    PYTHONPATH=. python scripts/diag/encoder_streams.py --row-split 1,2,3      (one image: row_split_forward)
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benches import common  # noqa: E402
from benches import w8a8 as wb  # noqa: E402
from tinyvila.cuda_graph import GraphCache  # noqa: E402


def split_forward(enc, branches: int):
    """fn(px): enc._forward over `branches` groups of px's images, one stream each, concatenated."""
    streams = [torch.cuda.Stream() for _ in range(branches)]

    def fn(px):
        if branches == 1:
            return enc._forward(px)
        cur = torch.cuda.current_stream()
        outs = []
        for s, chunk in zip(streams, px.chunk(branches)):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                outs.append(enc._forward(chunk))
        for s in streams:
            cur.wait_stream(s)
        return torch.cat(outs)
    return fn


def row_split_forward(enc, parts: int):
    """fn(px) for B = 1: per layer LayerNorm, qkv and attention over all tokens, then the rest of the layer (the
    o-projection with its input quantization, LayerNorm, MLP, residuals: all row-local) on `parts` groups of token
    rows, one stream each, joined (torch.cat) before the next layer. No LayerScale (SigLIP)."""
    from tinyvila import ops
    from tinyvila.vision import _linear_add

    streams = [torch.cuda.Stream() for _ in range(parts)] if parts > 1 else []

    def rest(layer, o, x):
        a = _linear_add(layer.attn.wo, o, x)
        return layer.mlp(layer.norm2(a), residual=a)

    def fn(px):
        x = enc.embed(px)
        B, T, D = x.shape
        cur = torch.cuda.current_stream() if streams else None
        for layer in enc.layers:
            q, k, v = layer.attn.qkv(layer.norm1(x))
            o = ops.attention(q, k, v, causal=False).transpose(1, 2).reshape(B, T, D)
            if parts == 1:
                x = rest(layer, o, x)
                continue
            outs = []
            for s, oc, xc in zip(streams, o.chunk(parts, dim=1), x.chunk(parts, dim=1)):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    outs.append(rest(layer, oc, xc))
            for s in streams:
                cur.wait_stream(s)
            x = torch.cat(outs, dim=1)
        x = x if enc.post_norm is None else enc.post_norm(x)
        return enc.select(x)
    return fn


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", default="8,64")
    ap.add_argument("--branches", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--row-split", default="", help="e.g. 1,2: one image, the post-attention part of each layer on "
                    "that many groups of token rows (row_split_forward)")
    args = ap.parse_args()
    dense, q = wb._encoders()
    S = q.cfg.image_size
    if args.row_split:
        px = [(torch.randn(1, 3, S, S, device="cuda", dtype=torch.float16),) for _ in range(2)]
        ms, outs = {}, {}
        for _ in range(args.rounds):
            for name, enc in (("fp16", dense), ("w8a8", q)):
                for b in [0] + [int(x) for x in args.row_split.split(",")]:  # 0: the encoder's own forward
                    g = GraphCache(enc._forward if b == 0 else row_split_forward(enc, b))
                    outs.setdefault((name, b), g(*px[0]).clone())
                    ms.setdefault((name, b), []).append(common.bench(g, px, warmup=5, iters=50))
                    del g
        print("== 1 image, token rows split after each attention (graph ms, each round; 0 = the encoder's forward)")
        for (name, b), t in ms.items():
            times = " ".join(f"{x:.3f}" for x in t)
            diff = (outs[(name, b)].float() - outs[(name, 0)].float()).abs().max().item()
            print(f"  {name:5s} {b} groups  {times}  min {min(t):.3f}  max abs diff to the encoder's forward {diff:.3g}",
                  flush=True)
        return 0
    for n in (int(x) for x in args.images.split(",")):
        px = [(torch.randn(n, 3, S, S, device="cuda", dtype=torch.float16),) for _ in range(2)]
        ms, outs = {}, {}
        for _ in range(args.rounds):
            for name, enc in (("fp16", dense), ("w8a8", q)):
                for b in (int(x) for x in args.branches.split(",")):
                    g = GraphCache(split_forward(enc, b))
                    outs.setdefault((name, b), g(*px[0]).clone())
                    ms.setdefault((name, b), []).append(common.bench(g, px, warmup=3, iters=20))
                    del g
                    torch.cuda.empty_cache()
        print(f"== {n} images (graph ms, each round; min)")
        for (name, b), t in ms.items():
            same = torch.equal(outs[(name, b)], outs[(name, 1)])
            ratios = ""
            if name == "w8a8":
                ratios = (f"  x fp16 (same branches) {min(ms[('fp16', b)]) / min(t):.3f}"
                          f"  x fp16 (1 branch) {min(ms[('fp16', 1)]) / min(t):.3f}")
            times = " ".join(f"{x:.3f}" for x in t)
            print(f"  {name:5s} {b} branches  {times}  min {min(t):.3f}{ratios}  same bits as 1 branch {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
