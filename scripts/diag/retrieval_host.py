"""Host time of one question's retrieval scoring and packing, eager (issue 6's "retrieval plus packing <= 5% of a
50-token turn" row of scripts/benches/decode_attention.py, overhead_rows, is host-bound): where it goes.

    PYTHONPATH=. python scripts/diag/retrieval_host.py      (one GPU, ~30 s)

The cache of overhead_rows (8K slots, retrievable from slot 32 on, a 64-token question, keep 0.1, Llama-3-8B
heads, 32 layers). Prints the host time of each part (begin_scoring, the 32 layers' _score calls, pack + unpack;
the GPU idle at the start, median of 20) and of a whole question with its GPU work waited for, then cProfile's
top functions over 20 questions (score + pack).
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benches.decode_attention import LAYERS, question_cache  # noqa: E402


def main(S: int = 8192, T: int = 64, keep: float = 0.1, turn: int = 50) -> None:
    cache, q, lse = question_cache(S, T, turn)
    k_all = [cache.k[layer][:, :, :S + T] for layer in range(LAYERS)]

    def begin():
        cache.begin_scoring(S)

    def layers():
        for layer in range(LAYERS):
            cache._score(layer, S, q, k_all[layer], lse)

    def pack():
        cache.pack(keep, S + T)
        cache.unpack()

    def timed(fn, setup=lambda: None, sync_each=False, n=20):
        """Median host us of fn() after setup(), the GPU idle at the start (and waited for at the end if
        sync_each)."""
        out = []
        for _ in range(n + 3):
            setup()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if sync_each:
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return 1e6 * sorted(out[3:])[n // 2]

    def scored():
        begin()
        layers()

    for name, us in (("begin_scoring", timed(begin)), ("32 x _score (no sync)", timed(layers, begin)),
                     ("pack + unpack (no sync)", timed(pack, scored)),
                     ("question: score + pack, synced", timed(lambda: (scored(), pack()), sync_each=True))):
        print(f"{name:<34} {us:9.1f} us", flush=True)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        begin()
        layers()
        pack()
    torch.cuda.synchronize()
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(22)
    st.sort_stats("cumulative").print_stats(22)


if __name__ == "__main__":
    main()
