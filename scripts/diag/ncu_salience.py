"""One profiled call each of the prefill-salience kernels at the issue-5 long-sequence shapes (H = 16, D = 80; 16K and
4K keys: the standalone call's pass 1 and pass 2, and the fused call's pass 2 alone), for Nsight Compute's pipe
counters (session 17: do the tensor cores and the MUFU take turns here as in the retrieval kernel? docs/perf_notes.md).

    ncu --clock-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,\\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\\
sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \\
        python scripts/diag/ncu_salience.py

Needs a CUDA GPU; prints "ok".
"""
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benches import common  # noqa: E402
from csrc_triton.prefill_salience import prefill_salience  # noqa: E402
from tinyvila import ops  # noqa: E402


def main() -> None:
    calls = []
    for n in (16384, 4096):
        q, k, v = (torch.randn(1, 16, n, 80, device="cuda", dtype=torch.float16) for _ in range(3))
        lse = ops.attention_lse(q, k, v, 0)[1]  # an LSE of the right shape (causal: the work does not depend on it)
        calls += [functools.partial(prefill_salience, q, k), functools.partial(prefill_salience, q, k, lse=lse)]
    common.profiled_calls(calls)
    print("ok")


if __name__ == "__main__":
    main()
