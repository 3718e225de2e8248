"""VisionEncoder.use_cuda_graphs (tinyvila/cuda_graph.py): replays equal eager forwards.

On CPU only the fall-through (eager path, unchanged outputs) and the clear errors run; the replay
tests need CUDA (fp16 and W8A8 tiny encoders, two batch sizes, weights moved between calls), and so
do VLM.encode_images' graphs: encoder + projector, and SparseVILA's prune (indices equal and tokens
bit-identical to the eager prune), at tiny shapes and at vila-8b's real vision shapes.
"""

import dataclasses

import numpy as np
import pytest
import torch

from tinyvila import sparsity as sparse
from tinyvila.config import ProjectorConfig, QuantConfig, SparsityConfig, preset
from tinyvila.cuda_graph import GraphCache, building, capture
from tinyvila.image import preprocess, resize_uint8
from tinyvila.convert.smoothquant import w8a8_state_dict
from tinyvila.loader import random_model
from test_w8a8 import as_w8a8, dense_encoder


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


@pytest.mark.gpu
def test_building_is_set_for_warm_ups_and_capture_only():
    """`building()` (graph builds may pick kernels that launch slower and run faster: ops.w4a16_linear) is true in
    capture's warm-ups and in the capture, on that thread only, and false again after, also when fn raises."""
    import threading

    seen, other = [], []
    x = torch.zeros(4, device="cuda")

    def fn():
        seen.append(building())
        t = threading.Thread(target=lambda: other.append(building()))
        t.start()
        t.join()
        return x + 1

    assert not building()
    capture(fn, torch.cuda.graph_pool_handle(), warmups=2)
    assert seen == [True, True, True] and other == [False, False, False] and not building()
    with pytest.raises(RuntimeError, match="boom"):
        capture(lambda: (_ for _ in ()).throw(RuntimeError("boom")), torch.cuda.graph_pool_handle())
    assert not building()


@pytest.mark.gpu
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


@pytest.mark.gpu
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


# -- VLM.encode_images: encoder + projector and SparseVILA's prune from graphs --------------------

def vlm(name: str, quant: str):
    """A random fp16 VLM on the GPU with the encoder graphs on (as tinyvila.load). "so400m": vila-8b's
    real vision encoder and projector shapes feeding a tiny LLM (the LLM plays no part here)."""
    if name == "so400m":
        tiny = preset("tiny-siglip-llama")
        cfg = dataclasses.replace(preset("vila-8b"), text=tiny.text, projector=ProjectorConfig(out_dim=tiny.text.dim),
                                  eos_ids=tiny.eos_ids)
    else:
        cfg = preset(name)
    cfg = dataclasses.replace(cfg, dtype="float16", quant=QuantConfig(vision=quant))
    model = random_model(cfg, device="cuda")
    model.vision.use_cuda_graphs()
    return model


def test_cpu_encode_images_is_eager():
    model = random_model(preset("tiny-siglip-llama"), device="cpu")
    model.vision.use_cuda_graphs()
    px = torch.randn(2, 3, model.cfg.vision.image_size, model.cfg.vision.image_size)
    out, idx = model.encode_images(px, SparsityConfig(prefill_keep=0.5), with_index=True)
    assert model._graphs is None  # nothing made, nothing captured on CPU
    want, want_idx = sparse.prune_top_k(model.vision, model.projector, px, idx.shape[1], model.cfg.vision.n_run_layers - 1)
    assert torch.equal(idx, want_idx) and torch.equal(out, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_encode_images_takes_uint8_pixels(device):
    """Resized uint8 pixels (image.resize_uint8, what Chat.add_image passes) encode to exactly what the
    preprocessed float32 pixels do, dense and pruned; on the GPU too (graphs, upload of uint8)."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (50, 70, 3), dtype=np.uint8) for _ in range(2)]
    model = random_model(preset("tiny-siglip-llama"), device=device)
    model.vision.use_cuda_graphs()
    vc = model.cfg.vision
    for sp in (None, SparsityConfig(prefill_keep=0.5)):
        with torch.inference_mode():
            want = model.encode_images(preprocess(images, vc), sp, with_index=True)
            got = model.encode_images(resize_uint8(images, vc), sp, with_index=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "w8a8"])
@pytest.mark.parametrize("name", ["tiny-siglip-llama", "tiny-clip-qwen2", "so400m"])
def test_graph_prune_equals_eager_prune(name, quant):
    model = vlm(name, quant)
    size, n_out = model.cfg.vision.image_size, model.projector.n_out
    for B, keep, layer in ((1, 0.5, -1), (2, 0.25, 0), (1, 0.5, -1)):  # the last reuses the first graph
        sp = SparsityConfig(prefill_keep=keep, salience_layer=layer)
        k = sparse.keep_count(n_out, keep)
        px = torch.randn(B, 3, size, size, device="cuda", dtype=torch.float16)
        with torch.inference_mode():
            want, want_idx = sparse.prune_top_k(model.vision, model.projector, px, k,
                                                sparse.salience_layer(model.cfg.vision, sp))
            got, idx = model.encode_images(px, sp, with_index=True)
        assert torch.isfinite(got).all() and idx.shape == (B, k)
        # The graph runs the same kernels on the same data: the same tokens, bit for bit.
        assert torch.equal(idx, want_idx)
        assert torch.equal(got, want)
    assert model._graphs.captures == 2  # one per (batch, k, layer); replays never recapture


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "w8a8"])
@pytest.mark.parametrize("name", ["tiny-siglip-llama", "so400m"])
def test_graph_encode_equals_eager(name, quant):
    model = vlm(name, quant)
    size = model.cfg.vision.image_size
    for B in (1, 3, 1):
        px = torch.randn(B, 3, size, size, device="cuda", dtype=torch.float16)
        with torch.inference_mode():
            want = model._encode(px)
            got = model.encode_images(px)
            kept = model.encode_images(px, SparsityConfig(prefill_keep=1.0))
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # as test_replay_matches_eager
        assert torch.equal(kept, got)  # keep 1.0 is exactly the dense path
    assert model._graphs.captures == 2
    model.half()  # moving/casting the weights drops the graphs (stale addresses are never replayed)
    assert not model._graphs.graphs
