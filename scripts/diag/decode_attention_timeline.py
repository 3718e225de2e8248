# ruff: noqa: E501  (the source fragments it patches are matched verbatim)
"""Where a decoding-attention call's time goes (issue 6: 8K keys at 0.66-0.70 of copy bandwidth, target 0.75).

Builds a copy of csrc_triton/decode_attention.py with %globaltimer stamps in `_decode_attention_kernel` (into
tmp_gpu/): each program records its start, the PDL wait's release, the end of its key loop, its arrival at the
split counter, and (the merging program) the merge's end. Captures a CUDA graph of CALLS back-to-back calls with
programmatic dependent launch, as scripts/bench_kernels.py --only decode_attention times them, replays it, and
reports per call (median over calls 2..CALLS-1, us): the call's period (last merge end to last merge end), the
wait (previous call's end to this call's releases), the key loop (release to loop end, median and max over
programs), and the tail (last loop end to last merge end). Also the unstamped call's graph time for the stamps'
cost.

    PYTHONPATH=. python scripts/diag/decode_attention_timeline.py [--cases 8192:8192,16384:8192]   (H200, ~30 s)
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import csrc_triton.decode_attention as da  # noqa: E402
from benches import common  # noqa: E402

CALLS = 16
STAMPS = 5  # start, PDL release, loop end, counter arrival, merge end
NOW = 'tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)'


def stamped_module():
    src = Path(da.__file__).read_text()
    edits = [
        ("    FUSED: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,\n",
         "    FUSED: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, dbg_ptr, call,\n"),
        ("    b, g, bg, split = _program(HKV)\n    length = tl.load(len_ptr + b)\n",
         f"    b, g, bg, split = _program(HKV)\n    _row = (call * tl.num_programs(0) * tl.num_programs(1) + bg * N_SPLITS + split) * {STAMPS}\n"
         f"    tl.store(dbg_ptr + _row, {NOW})\n    length = tl.load(len_ptr + b)\n"),
        ("    pdl.enter(PDL)  # a decode-step kernel",
         f"    pdl.enter(PDL)\n    tl.store(dbg_ptr + _row + 1, {NOW})  # a decode-step kernel"),
        ("    # An empty split (start >= length) leaves l_i = 0: it stores lse = -inf and o = 0.\n",
         f"    tl.store(dbg_ptr + _row + 2, {NOW})\n    # An empty split (start >= length) leaves l_i = 0: it stores lse = -inf and o = 0.\n"),
        ("            arrived = tl.atomic_add(cnt_ptr + bg, 1, sem=\"acq_rel\", scope=\"gpu\")\n",
         f"            arrived = tl.atomic_add(cnt_ptr + bg, 1, sem=\"acq_rel\", scope=\"gpu\")\n            tl.store(dbg_ptr + _row + 3, {NOW} + arrived * 0)\n"),
        ("                tl.store(cnt_ptr + bg, 0)  # ready for the next launch (kernel boundary orders it)\n",
         f"                tl.store(cnt_ptr + bg, 0)  # ready for the next launch (kernel boundary orders it)\n                tl.store(dbg_ptr + _row + 4, {NOW})\n"),
        ("                     prefetch: int | None = None) -> torch.Tensor:",
         "                     prefetch: int | None = None, dbg=None, call=0) -> torch.Tensor:"),
        ("        FUSED=fused, UPCAST=_interpreting() and q.dtype == torch.bfloat16, PREFETCH=prefetch,",
         "        FUSED=fused, UPCAST=_interpreting() and q.dtype == torch.bfloat16, dbg_ptr=dbg, call=call, PREFETCH=prefetch,"),
        ("from . import pdl\n", "from csrc_triton import pdl\n"),
    ]
    for old, new in edits:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    Path("tmp_gpu").mkdir(exist_ok=True)
    path = Path("tmp_gpu/_decode_attention_stamped.py")
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("_decode_attention_stamped", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="8192:8192,16384:8192", help="buffer slots:keys, comma-separated")
    args = ap.parse_args()
    st = stamped_module()
    H, HKV, D = 32, 8, 128
    for case in args.cases.split(","):
        slots, keys = (int(x) for x in case.split(":"))
        sets = [(torch.randn(1, H, D, device="cuda", dtype=torch.float16),
                 torch.randn(1, HKV, slots, D, device="cuda", dtype=torch.float16),
                 torch.randn(1, HKV, slots, D, device="cuda", dtype=torch.float16)) for _ in range(CALLS)]
        lengths = torch.full((1,), keys, dtype=torch.int32, device="cuda")
        out = torch.empty(1, H, D, device="cuda", dtype=torch.float16)
        plain_us = common.graph_ms(lambda q, k, v, n=lengths, o=out: da.decode_attention(q, k, v, n, out=o), sets) * 1000
        n_splits = da.default_splits(slots, HKV, torch.device("cuda"), da.default_config(slots)[3])
        n_prog = HKV * n_splits
        dbg = torch.zeros(CALLS * n_prog * STAMPS, dtype=torch.int64, device="cuda")
        for i, s in enumerate(sets):  # eager once (compiles; sizes the counters)
            st.decode_attention(*s, lengths, out=out, dbg=dbg, call=i)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i, s in enumerate(sets):
                st.decode_attention(*s, lengths, out=out, dbg=dbg, call=i)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        d = dbg.view(CALLS, n_prog, STAMPS).double().cpu() / 1000.0  # us
        ends = d[:, :, 4].max(dim=1).values  # the merges' end: the call's end
        rows = []
        for i in range(2, CALLS - 1):
            rel = d[i]
            release = rel[:, 1]
            loop = rel[:, 2] - rel[:, 1]
            rows.append({"period": float(ends[i] - ends[i - 1]),
                         "start_after_prev_end": float(rel[:, 0].min() - ends[i - 1]),
                         "release_after_prev_end": float(release.median() - ends[i - 1]),
                         "release_spread": float(release.max() - release.min()),
                         "loop_median": float(loop.median()), "loop_max": float(loop.max()),
                         "arrive_after_loop": float((rel[:, 3] - rel[:, 2]).median()),
                         "tail": float(ends[i] - rel[:, 2].max())})
        med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
        print(f"== {keys} keys in {slots} slots, {n_splits} splits x {HKV} KV heads, config {da.default_config(slots)}: "
              f"unstamped graph {plain_us:.2f} us a call; stamped, median over calls 2..{CALLS - 2} (us): "
              + ", ".join(f"{k} {v:.2f}" for k, v in med.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
