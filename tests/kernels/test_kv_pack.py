"""csrc_triton.kv_pack against its reference: gathers of kept slots per KV head, odd lengths, dtypes,
a whole model's stacked layers and (K, V) pairs in one launch."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from csrc_triton.kv_pack import kv_pack, kv_pack_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1, 5, 3, 16), (2, 3, 217, 123, 64), (1, 2, 3000, 1001, 80)]
if DEVICE == "cuda":
    SHAPES.append((1, 8, 32768, 8192, 128))


def sorted_slots(lead: tuple, S: int, L: int, g: torch.Generator) -> torch.Tensor:
    """(*lead, L) int32: each head keeps its own sorted subset of slots (equal count per head)."""
    n = int(torch.tensor(lead).prod())
    idx = torch.stack([torch.randperm(S, generator=g)[:L].sort().values for _ in range(n)])
    return idx.view(*lead, L).to(DEVICE, torch.int32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,Hkv,S,L,D", SHAPES)
def test_gather_matches_reference(dtype, B, Hkv, S, L, D):
    g = torch.Generator().manual_seed(S)
    src = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE, dtype)
    idx = sorted_slots((B, Hkv), S, L, g)
    dst = torch.full((B, Hkv, L + 7, D), float("nan"), device=DEVICE, dtype=dtype)
    want = kv_pack_ref(src, idx, dst.clone())
    got = kv_pack(src, idx, dst)
    assert torch.equal(got[:, :, :L], want[:, :, :L])  # a copy: bit-exact
    assert got[:, :, L:].isnan().all()  # rows past L untouched


STACKED = [(3, 2, 2, 300, 77, 32), (5, 1, 3, 129, 64, 16)]
if DEVICE == "cuda":
    STACKED.append((32, 1, 8, 8256, 883, 128))  # Llama-3-8B, 8K context, keep 0.1


@pytest.mark.parametrize("n_layers,B,Hkv,S,L,D", STACKED)
def test_stacked_layers_and_kv_pair_in_one_launch(n_layers, B, Hkv, S, L, D):
    """(n_layers, B, Hkv, S, D) K and V with per-layer, per-head selections: every layer's rows of
    both tensors land where the per-layer reference puts them."""
    g = torch.Generator().manual_seed(L)
    k, v = (torch.randn(n_layers, B, Hkv, S, D, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    idx = sorted_slots((n_layers, B, Hkv), S, L, g)
    dk, dv = (torch.full((n_layers, B, Hkv, L + 5, D), float("nan"), device=DEVICE, dtype=torch.float16)
              for _ in range(2))
    kv_pack((k, v), idx, (dk, dv))
    for layer in range(n_layers):
        for src, dst in ((k, dk), (v, dv)):
            want = kv_pack_ref(src[layer], idx[layer], torch.empty(B, Hkv, L, D, device=DEVICE, dtype=src.dtype))
            assert torch.equal(dst[layer, :, :, :L], want)
    assert dk[..., L:, :].isnan().all() and dv[..., L:, :].isnan().all()
    ref = kv_pack_ref((k, v), idx, (dk.clone(), dv.clone()))
    assert torch.equal(ref[0][..., :L, :], dk[..., :L, :]) and torch.equal(ref[1][..., :L, :], dv[..., :L, :])


def test_bad_index_shape_is_a_clear_error():
    src = torch.randn(1, 2, 10, 16)
    with pytest.raises(ValueError, match="idx"):
        kv_pack(src, torch.zeros(1, 3, 4, dtype=torch.int32), torch.empty(1, 2, 4, 16))


def test_mismatched_pair_is_a_clear_error():
    k, v = torch.randn(1, 2, 10, 16), torch.randn(1, 2, 12, 16)
    with pytest.raises(ValueError, match="pair"):
        kv_pack((k, v), torch.zeros(1, 2, 4, dtype=torch.int32), (torch.empty(1, 2, 4, 16),) * 2)
