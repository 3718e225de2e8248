"""csrc_triton.argmax against torch.argmax: lengths across block edges, ties (the first index wins), NaN (the
first NaN wins), all -inf, fp16/bf16/fp32 inputs, bad arguments; on CUDA also the Llama-3 vocabulary and a
CUDA-graph replay. argmax_step (the greedy decode step's tail) against argmax_step_ref: every state tensor
after a run of steps, a count past the record, bad state; on CUDA graph-replayed at the Llama-3 vocabulary."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from csrc_triton.argmax import BLOCK, argmax, argmax_ref, argmax_step, argmax_step_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_matches_torch(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(DEVICE, dtype)
    assert argmax(x).tolist() == argmax_ref(x).tolist()
    if n > 3:
        top = x.float().max().item()
        x[n // 3] = top + 1
        x[n - 1] = top + 1  # a later tie, in another block when n > BLOCK: the first index wins
        assert argmax(x).tolist() == [n // 3] == argmax_ref(x).tolist()
        x[n // 2] = float("nan")
        x[n - 2] = float("nan")
        assert argmax(x).tolist() == [n // 2] == argmax_ref(x).tolist()


def test_all_minus_infinity_and_out_buffer():
    x = torch.full((BLOCK + 9,), float("-inf"), device=DEVICE)
    out = torch.full((1,), -1, device=DEVICE, dtype=torch.int64)
    assert argmax(x, out=out).data_ptr() == out.data_ptr()
    assert out.tolist() == argmax_ref(x).tolist() == [0]


@pytest.mark.parametrize("bad", ["2d", "strided", "int", "empty"])
def test_bad_arguments_are_named(bad):
    x = {"2d": torch.zeros(2, 3, device=DEVICE), "strided": torch.zeros(10, device=DEVICE)[::2],
         "int": torch.zeros(4, dtype=torch.int32, device=DEVICE), "empty": torch.zeros(0, device=DEVICE)}[bad]
    with pytest.raises(ValueError, match="argmax"):
        argmax(x)


@pytest.mark.gpu  # CUDA graphs
def test_vocabulary_and_graph():
    x = torch.randn(128256, device=DEVICE)
    out = torch.empty(1, device=DEVICE, dtype=torch.int64)
    argmax(x, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax(x, out=out)
    x[77777] = 100.0
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [77777] == argmax_ref(x).tolist()


def step_state(B: int, R: int = 6, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(token, out, count, steps, lengths) as a decode step holds them; token and out poisoned."""
    g = torch.Generator().manual_seed(seed)
    return (torch.full((1, 1), -7, dtype=torch.int64), torch.full((R,), -1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64), torch.randint(0, 10**6, (3,), generator=g),
            torch.randint(1, 10**6, (B,), generator=g, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, B", [(7, 1), (BLOCK + 1, 3), (2 * BLOCK + 3, 17)])
def test_step_matches_its_reference(n, B, dtype):
    """Four steps in a row (count 0..3): the kernel's state equals the PyTorch ops' after each."""
    got = [t.to(DEVICE) for t in step_state(B)]
    want = [t.clone() for t in got]
    start = [t.clone() for t in got]
    g = torch.Generator().manual_seed(n)
    picked = []
    for s in range(4):
        x = torch.randn(n, generator=g).to(DEVICE, dtype)
        if s == 2 and n > 3:
            x[n // 3] = float("nan")  # the first NaN wins, as in torch.argmax
        argmax_step(x, *got)
        argmax_step_ref(x, *want)
        picked.append(argmax_ref(x).item())
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)
    token, out, count, steps, lengths = got
    assert token.tolist() == [[picked[-1]]] and out[:4].tolist() == picked and out[4:].tolist() == [-1, -1]
    assert count.tolist() == [4] and torch.equal(steps, start[3] + 4) and torch.equal(lengths, start[4] + 4)


def test_step_past_the_record_writes_only_the_counters():
    x = torch.randn(BLOCK + 5, device=DEVICE)
    token, out, count, steps, lengths = (t.to(DEVICE) for t in step_state(2, R=3))
    count.fill_(2)  # the end of a 2-entry record: the kernel skips out[], never writes past it (into out[2] here)
    argmax_step(x, token, out[:2], count, steps, lengths)
    assert out.tolist() == [-1, -1, -1] and count.tolist() == [3] and token.tolist() == [argmax_ref(x).tolist()]


@pytest.mark.parametrize("bad", ["lengths64", "steps32", "token2", "count2", "strided", "device"])
def test_step_bad_state_is_named(bad):
    x = torch.randn(10, device=DEVICE)
    state = [s.to(DEVICE) for s in step_state(2)]
    long = dict(dtype=torch.long, device=DEVICE)
    i, t = {"lengths64": (4, state[4].long()), "steps32": (3, state[3].int()), "token2": (0, torch.zeros(2, **long)),
            "count2": (2, torch.zeros(2, **long)), "strided": (1, torch.zeros(12, **long)[::2]),  # made where it runs
            "device": (1, torch.zeros(6, dtype=torch.long, device="meta"))}[bad]
    state[i] = t
    with pytest.raises(ValueError, match="argmax_step"):
        argmax_step(x, *state)


@pytest.mark.gpu  # CUDA graphs
def test_step_vocabulary_and_graph():
    """Graph-replayed at the Llama-3 vocabulary, the logits changed between replays: the state after each
    replay equals the reference's."""
    x = torch.randn(128256, device=DEVICE)
    got = [t.to(DEVICE) for t in step_state(1, R=64)]
    want = [t.clone() for t in got]
    argmax_step(x, *got)  # warm-up (compiles, allocates the partials)
    argmax_step_ref(x, *want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_step(x, *got)
    for s in range(5):
        x.copy_(torch.randn(128256, device=DEVICE))
        x[1000 * s + 7] = 100.0
        graph.replay()
        argmax_step_ref(x, *want)
        torch.cuda.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert got[1][1:6].tolist() == [1000 * s + 7 for s in range(5)]
