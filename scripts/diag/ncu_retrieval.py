"""One profiled call each of the retrieval-salience kernels (a 64-token question over a 32K range, Llama-3-8B
heads), for Nsight Compute's counters (issue 6, session 17: why the Gluon ping-pong kernel, built so the tensor
cores' work overlaps the exponentials, is no faster than the Triton kernels; docs/perf_notes.md).

    ncu --clock-control none --profile-from-start off --set full -o retrieval \\
        python scripts/diag/ncu_retrieval.py
    ncu -i retrieval.ncu-rep --page raw --csv > retrieval.csv      # then the pipe, issue and stall columns

Calls, in order: the Triton gather kernel over a slot tensor, the Triton gather kernel over the range, the Gluon
ping-pong and halves forms (csrc_triton/retrieval_salience_wgmma.py), and the ping-pong form's ablations of
scripts/diag/retrieval_ablate.py (noexp, nomma, neither). Needs an sm_90 GPU with Triton 3.6; prints "ok".
"""
import functools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benches import common  # noqa: E402
from benches.retrieval_variants import question  # noqa: E402
from csrc_triton import retrieval_salience as rs  # noqa: E402
from retrieval_ablate import EDITS, variant  # noqa: E402


def main() -> None:
    S = 32768
    q, k, _, lse = question(64)
    out = torch.empty(1, 8, S, device="cuda")
    slots = torch.arange(S, device="cuda", dtype=torch.int32)
    with tempfile.TemporaryDirectory() as d:
        mods = {name: variant(name, Path(d)) for name in EDITS}
        calls = [functools.partial(rs.retrieval_salience, q, k, slots, lse, impl="gather"),
                 functools.partial(rs.retrieval_salience, q, k, range(S), lse, impl="gather")]
        for form, names in (("pingpong", list(EDITS)), ("halves", ["real"])):
            for name in names:
                calls.append(functools.partial(mods[name].retrieval_salience_wgmma, q, k, range(S), lse, 128 ** -0.5,
                                               out, False, form=form))
        common.profiled_calls(calls)
    print("ok")


if __name__ == "__main__":
    main()
