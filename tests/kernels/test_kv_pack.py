"""csrc_triton.kv_pack against its reference: gathers of kept slots per KV head, odd lengths, dtypes."""

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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,Hkv,S,L,D", SHAPES)
def test_gather_matches_reference(dtype, B, Hkv, S, L, D):
    g = torch.Generator().manual_seed(S)
    src = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE, dtype)
    # Each head keeps its own sorted subset of slots (equal count per head).
    idx = torch.stack([torch.stack([torch.randperm(S, generator=g)[:L].sort().values for _ in range(Hkv)])
                       for _ in range(B)]).to(DEVICE, torch.int32)
    dst = torch.full((B, Hkv, L + 7, D), float("nan"), device=DEVICE, dtype=dtype)
    want = kv_pack_ref(src, idx, dst.clone())
    got = kv_pack(src, idx, dst)
    assert torch.equal(got[:, :, :L], want[:, :, :L])  # a copy: bit-exact
    assert got[:, :, L:].isnan().all()  # rows past L untouched


def test_bad_index_shape_is_a_clear_error():
    src = torch.randn(1, 2, 10, 16)
    with pytest.raises(ValueError, match="idx"):
        kv_pack(src, torch.zeros(1, 3, 4, dtype=torch.int32), torch.empty(1, 2, 4, 16))
