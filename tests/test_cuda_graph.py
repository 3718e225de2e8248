"""VisionEncoder.use_cuda_graphs (tinyvila/cuda_graph.py): replays equal eager forwards.

On CPU only the fall-through (eager path, unchanged outputs) and the clear errors run; the replay
tests need CUDA (fp16 and W8A8 tiny encoders, two batch sizes, weights moved between calls).
"""

import sys
from pathlib import Path

import pytest
import torch

from tinyvila.cuda_graph import GraphCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_w8a8 import as_w8a8, dense_encoder  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from smoothquant import w8a8_state_dict  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def encoders(preset: str):
    dense = dense_encoder(preset)
    return dense, as_w8a8(dense, w8a8_state_dict(dense, torch.float16))


def test_cpu_input_runs_eager():
    enc = dense_encoder("tiny-siglip-llama")
    px = torch.randn(2, 3, enc.cfg.image_size, enc.cfg.image_size)
    want = enc(px)
    got = enc.use_cuda_graphs()(px)
    assert enc.graphs is not None and not enc.graphs.graphs  # nothing captured on CPU
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="CUDA"):
        GraphCache(enc._forward)(px)


@gpu
@pytest.mark.parametrize("quant", ["none", "w8a8"])
@pytest.mark.parametrize("preset", ["tiny-siglip-llama", "tiny-clip-qwen2"])
def test_replay_matches_eager(preset, quant):
    dense, q = encoders(preset)
    enc = dense.cuda().half() if quant == "none" else q.cuda()
    size = enc.cfg.image_size
    enc.use_cuda_graphs()
    for B in (1, 3, 1):  # a second shape, then the first again (its graph is reused)
        px = torch.randn(B, 3, size, size, device="cuda", dtype=torch.float16)
        with torch.no_grad():
            want = enc._forward(px)
        got = enc(px)
        assert torch.isfinite(got).all()
        # Same kernels on the same data; a tolerance only because cuBLAS may pick another algorithm
        # under capture. Stale weights or inputs would be off by O(1).
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert len(enc.graphs.graphs) == 2
    out1 = enc(px)
    enc(torch.randn_like(px))  # a later replay must not change an earlier result (outputs are cloned)
    assert torch.equal(out1, enc(px))


@gpu
def test_graphs_dropped_when_weights_move():
    dense, _ = encoders("tiny-siglip-llama")
    enc = dense.cuda().half().use_cuda_graphs()
    px = torch.randn(2, 3, enc.cfg.image_size, enc.cfg.image_size, device="cuda", dtype=torch.float16)
    enc(px)
    assert enc.graphs.graphs
    enc.float()
    assert not enc.graphs.graphs  # stale weight addresses are never replayed
    with torch.no_grad():
        torch.testing.assert_close(enc(px), enc._forward(px), rtol=1e-3, atol=1e-3)
