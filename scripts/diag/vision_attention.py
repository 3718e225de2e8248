"""Which SDPA backend runs the vision encoder's attention fastest (issue 4; SigLIP-so400m: 16 heads, 729
tokens, head dim 72, fp16, non-causal).

The encoder's attention is the part the W8A8 and fp16 encoders share (ops.attention -> F.scaled_dot_product_
attention, whichever backend PyTorch picks); at 8 images it was ~20% of a W8A8 layer (docs/perf_notes.md, W3).
For 1, 8 and 64 images this times, graph-replayed and with input sets rotated past L2, q/k/v laid out as the
encoder makes them (permuted views of the fused qkv output) -> attention -> (B, T, H*Dh) for the o-projection,
under each backend alone (flash, cuDNN, memory-efficient) and PyTorch's default pick, and reports each output's
max abs error against an fp32 math reference on the first set.

    PYTHONPATH=. python scripts/diag/vision_attention.py      (one GPU, ~1 min; a table, then one JSON line)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benches import common  # noqa: E402

H, T, DH = 16, 729, 72
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def qkv_views(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, 3 H Dh) -> q, k, v (B, H, T, Dh) views, as tinyvila.vision.Attention.qkv makes them."""
    B = qkv.shape[0]
    return qkv.view(B, T, 3, H, DH).permute(2, 0, 3, 1, 4).unbind(0)


def call(backend):
    """fn(qkv) -> (B, T, H Dh): the encoder's attention step under `backend` (None: PyTorch's choice)."""
    def fn(qkv):
        q, k, v = qkv_views(qkv)
        if backend is None:
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, k, v)
        return o.transpose(1, 2).reshape(qkv.shape[0], T, H * DH)
    return fn


@torch.no_grad()
def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("vision_attention.py needs a CUDA GPU")
    rows = []
    for n_img in (1, 8, 64):
        per_set = n_img * T * 3 * H * DH * 2
        sets = [(torch.randn(n_img, T, 3 * H * DH, device="cuda", dtype=torch.float16),)
                for _ in range(common.n_copies(per_set))]
        q, k, v = (t.float() for t in qkv_views(sets[0][0]))
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n_img, T, H * DH)
        flops = 4 * n_img * H * T * T * DH
        for name, backend in BACKENDS.items():
            fn = call(backend)
            try:
                err = (fn(*sets[0]).float() - ref).abs().max().item()
                ms = common.graph_ms(fn, sets)
            except RuntimeError as e:
                rows.append({"images": n_img, "backend": name, "note": f"{type(e).__name__}: {e}"[:120]})
                print(rows[-1], flush=True)
                continue
            rows.append({"images": n_img, "backend": name, "ms": round(ms, 4) if ms else None,
                         "TFLOP/s": round(flops / ms / 1e9, 1) if ms else None, "max_abs_err_vs_fp32": err})
            print(rows[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    print(json.dumps({"vision_attention": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
