"""A later turn's attention over the cache (graph-replayed follow-up questions), Llama-3-8B heads (32 / 8, D 128).

    python -m scripts.bench_kernels --only rows_attention [--quick] [--rows-attention-keys 600,3200,13000,51000]

Per (new rows T, cached keys n): per-call device time, replayed from one CUDA graph of back-to-back calls of one
layer's attention, as the later-turn graph runs it (ops.attention_rows, the key count read from the device), of
csrc_triton.rows_attention (split over the keys, its merge included) and of PyTorch's varlen flash
call (FlashAttention-2, unsplit over the keys: the form before). `floor_us`: the layer's K/V bytes at the measured
device-copy bandwidth (which counts bytes read + written): reading the n keys once takes at least this long.
"""

from __future__ import annotations

import torch

from csrc_triton.rows_attention import rows_attention
from scripts.benches import common
from tinyvila import ops
from tinyvila.kv_cache import RowsIndex
from tinyvila.options import Options

H, HKV, D = 32, 8, 128


def add_args(p) -> None:
    p.add_argument("--rows-attention-keys", type=common.ints, default=None, metavar="N,...",
                   help="cached keys (default 600,3200,13000,51000: one image, 64 and 256 frames kept, 256 dense)")


def _inputs(T: int, n: int, copies: int) -> list[tuple]:
    out = []
    for _ in range(copies):
        q = torch.randn(T, H, D, device="cuda", dtype=torch.float16).transpose(0, 1)[None]  # as the model passes it
        k = torch.randn(1, HKV, n + T, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        st = torch.tensor([n], device="cuda")
        two = torch.arange(2, device="cuda")
        rows = RowsIndex(st, torch.arange(T, device="cuda") + st, (st + T).int(), (two * T).int(),
                         (two * (n + T)).int())
        out.append((q, k, v, rows))
    return out


def run(args) -> list[dict]:
    keys = args.rows_attention_keys or ([600, 13000] if args.quick else [600, 3200, 13000, 51000])
    copy = common.copy_bandwidth_gbs()
    rows = []
    for T in (48, 256):
        for n in keys:
            kv_bytes = 2 * HKV * (n + T) * D * 2
            sets = _inputs(T, n, common.n_copies(kv_bytes))
            row = {"T": T, "keys": n, "floor_us": kv_bytes / copy / 1e3}  # bytes / (GB/s) -> us
            for name, fn in (("split_us", lambda q, k, v, r: rows_attention(q, k, v, r.keys, lse=True)),
                             ("flash_us", lambda q, k, v, r: ops.attention_rows(
                                 q, k, v, r, lse=True, opts=Options(split_rows_attention=False)))):
                ms = common.graph_ms(fn, sets)
                row[name] = None if ms is None else 1e3 * ms
            rows.append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            del sets
            torch.cuda.empty_cache()
    return rows
