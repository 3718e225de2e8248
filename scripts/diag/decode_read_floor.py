"""What a kernel that only READS a packed decode buffer's keys and values gets per call (issue 6): the floor under
the decoding-attention targets, in the bench's own conditions.

    PYTHONPATH=. python scripts/diag/decode_read_floor.py      (one GPU, ~1 minute; a table, then one JSON line)

Llama-3-8B attention (8 KV heads, D = 128, fp16). For each case (buffer slots, keys): the runtime's decoding
attention (ops.decode_attention) and a read-only kernel with the same grid (KV heads x the split count and key tile
that csrc_triton/decode_attention.py picks for that buffer length, the same split bounds from the device length),
which loads every K and V row of its split and stores one word. Launched three ways, graph-replayed back to back as
the decode bench replays the attention: `plain` (no programmatic dependent launch), `enter` (PDL, each program
waiting for its predecessor before its first load, as the attention and every decode-step kernel does), `early`
(PDL, every load before the wait: consecutive calls' reads overlap, which no kernel whose inputs the previous kernel
writes may do). Inputs rotate past L2 (scripts/benches/common.py). Targets (issue 6): a full buffer of >= 8K at
>= 0.75 of the copy bandwidth; keep 0.25 / 0.1 of a 32K and a 128K cache, in the buffer KVCache.pack allocates, at
>= 0.8 x the ideal bytes ratio faster than PyTorch SDPA over the full cache (timed here the same way): us <=
SDPA us / (0.8 / keep).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benches import common  # noqa: E402
from benches.decode_attention import D, H, HKV, TURN_ROOM, _kv  # noqa: E402
from csrc_triton import pdl  # noqa: E402
from csrc_triton.decode_attention import default_config, default_splits  # noqa: E402
from tinyvila import ops  # noqa: E402
from tinyvila.kv_cache import packed_slots  # noqa: E402
# (label, full cache for the SDPA reference or None, keep): the buffer is the runtime's packed one for the kept keys
CASES = [("8K full buffer", None, 8192), ("keep 0.25 of 32K", 32768, 0.25), ("keep 0.1 of 32K", 32768, 0.1),
         ("keep 0.25 of 128K", 131072, 0.25), ("keep 0.1 of 128K", 131072, 0.1)]


@triton.jit
def _read_kv(k_ptr, v_ptr, len_ptr, out_ptr, skh, N_SPLITS, BLOCK_N: tl.constexpr, W: tl.constexpr,
             STAGES: tl.constexpr, EARLY: tl.constexpr):
    """Program (g, split): K and V rows [start, end) of the split (the attention's _split_rows), W int32 words a
    row, xor-folded into one stored word. EARLY: every load before the PDL wait; else the wait comes first."""
    if EARLY:
        pdl.launch_dependents(True)
    else:
        pdl.enter(True)
    g = tl.program_id(0)
    split = tl.program_id(1)
    length = tl.load(len_ptr)
    per = tl.cdiv(tl.cdiv(length, BLOCK_N), N_SPLITS)
    start = split * per * BLOCK_N
    end = tl.minimum(start + per * BLOCK_N, length)
    w = tl.arange(0, W)
    acc = tl.zeros((BLOCK_N, W), dtype=tl.int32)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        rows = n0 + tl.arange(0, BLOCK_N)
        offs = g * skh + rows[:, None] * W + w[None, :]
        ok = (rows < end)[:, None]
        acc ^= tl.load(k_ptr + offs, mask=ok, other=0) ^ tl.load(v_ptr + offs, mask=ok, other=0)
    if EARLY:
        pdl.wait(True)
    tl.store(out_ptr + g * N_SPLITS + split, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def _sets(slots: int, keys: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K / V buffers of `slots` rows, enough sets that the `keys` rows read from each exceed L2."""
    return _kv(slots, common.n_copies(4 * HKV * keys * D))


def read_us(sets, slots: int, keys: int, mode: str) -> float:
    """us per call of the read-only kernel on the attention's grid for a `slots` buffer holding `keys` keys."""
    block_n, warps, stages, per_sm, _ = default_config(slots)
    splits = default_splits(slots, HKV, torch.device("cuda"), per_sm)
    lens = torch.tensor([keys], dtype=torch.int32, device="cuda")
    sink = torch.empty(HKV * splits, dtype=torch.int32, device="cuda")
    W = D // 2  # fp16 pairs as int32 words

    def fn(k, v):
        _read_kv[(HKV, splits)](k.view(torch.int32), v.view(torch.int32), lens, sink, slots * W, splits,
                                BLOCK_N=block_n, W=W, STAGES=stages, EARLY=mode == "early", num_warps=warps,
                                **({} if mode == "plain" else {"launch_pdl": True}))

    return 1000 * common.graph_ms(fn, sets)


def main() -> int:
    copy = common.copy_bandwidth_gbs()
    q = torch.randn(1, H, D, device="cuda", dtype=torch.float16)
    sdpa = {}
    for S in sorted({c for _, c, _ in CASES if c}):
        sets = _sets(S, S)
        sdpa[S] = 1000 * common.graph_ms(lambda k, v: F.scaled_dot_product_attention(q[:, :, None], k, v,
                                                                                     enable_gqa=True), sets)
        del sets
    rows = []
    print(f"copy {copy:.0f} GB/s; SDPA over the full cache (graph): " + ", ".join(f"{S}: {t:.2f} us" for S, t in sdpa.items()))
    print("case | slots | keys | attention us | read-only plain / enter / early us | target us | "
          "attention, read-only enter: fraction of copy")
    for label, S, keep in CASES:
        keys = keep if S is None else round(keep * S)
        slots = keys if S is None else min(S, packed_slots(keys, TURN_ROOM))
        target = 4 * HKV * keys * D / (0.75 * copy * 1e3) if S is None else sdpa[S] * keep / 0.8
        sets = _sets(slots, keys)
        lens = torch.tensor([keys], dtype=torch.int32, device="cuda")
        attn = 1000 * common.graph_ms(lambda k, v, lens=lens: ops.decode_attention(q, k, v, lens), sets)
        ro = {m: read_us(sets, slots, keys, m) for m in ("plain", "enter", "early")}
        frac = {n: 4 * HKV * keys * D / (t * 1e3) / copy for n, t in (("attention", attn), ("enter", ro["enter"]))}
        rows.append(dict(case=label, slots=slots, keys=keys, attention_us=attn, **{f"read_{m}_us": t for m, t in ro.items()},
                         target_us=target, attention_of_copy=frac["attention"], read_enter_of_copy=frac["enter"]))
        print(f"{label} | {slots} | {keys} | {attn:.2f} | {ro['plain']:.2f} / {ro['enter']:.2f} / {ro['early']:.2f} | "
              f"{target:.2f} | {frac['attention']:.3f}, {frac['enter']:.3f}", flush=True)
        del sets
    print(json.dumps({"bench": "decode_read_floor", "copy_gbs": round(copy), "sdpa_us": sdpa, "rows": rows,
                      **common.environment()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
