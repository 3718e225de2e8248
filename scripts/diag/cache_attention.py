"""Causal attention of new rows over a KV cache, the LLM prefill's attention (issues 6, 7; Llama-3-8B: 32 query
heads, 8 KV heads, head dim 128, fp16): the runtime's path against the forms it replaced or passed over.

Forms, each timed graph-replayed on views of one large cache (as kv_cache passes them):
  runtime   tinyvila.ops.attention_lse: one call of PyTorch's flash kernel, causal mask aligned bottom-right,
            GQA in the kernel (session 9)
  two_call  the session-8 form: flash over the cached prefix (query heads folded into rows) plus flash over the
            new keys expanded per head (square causal), merged by their LSEs with ~8 small ops
  cudnn     PyTorch's cuDNN attention (GQA as is, causal aligned top-left): the prefix without a mask plus the new
            keys square causal, merged by LSE; its first call at a new prefix length builds a cuDNN plan, timed
  sdpa      (square first turns only) F.scaled_dot_product_attention with K/V expanded, where PyTorch picks cuDNN
Each form's max abs error against the fp32 reference (ops._attention_lse_ref) where that fits in memory, and the
eager time of one call with the host's launch work included (what a follow-up question's eager prefill pays).

    PYTHONPATH=. python scripts/diag/cache_attention.py     (one GPU, ~1 min; a table, then one JSON line)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benches import common  # noqa: E402
from tinyvila import ops  # noqa: E402

H, HKV, D = 32, 8, 128
# (new rows T, cached rows before them): questions, prefill chunks, square first turns
CASES = [(1, 700), (17, 1000), (46, 515), (64, 4032), (64, 32704), (128, 4000), (256, 4096), (512, 4096),
         (1024, 12000), (2048, 2048), (2048, 10240), (4096, 8192), (669, 12288), (450, 0), (1024, 0), (2048, 0),
         (4096, 0)]
REF_MAX = 2048 * 12288  # T * S up to which the fp32 reference is computed


def _merge(o1, lse1, o2, lse2, dtype):
    lse = torch.logaddexp(lse1, lse2)
    return (o1 * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None]).to(dtype), lse


def two_call(q, k, v, q_start):
    B, Hq, T, Dh = q.shape
    n_rep = Hq // k.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    o2, lse2 = flash(q, k[:, :, q_start:].repeat_interleave(n_rep, 1), v[:, :, q_start:].repeat_interleave(n_rep, 1),
                     0.0, True)[:2]
    if q_start == 0:
        return o2, lse2
    o1, lse1 = flash(q.reshape(B, k.shape[1], n_rep * T, Dh), k[:, :, :q_start], v[:, :, :q_start], 0.0, False)[:2]
    return _merge(o1.view(B, Hq, T, Dh), lse1.view(B, Hq, T), o2, lse2, q.dtype)


def cudnn(q, k, v, q_start):
    fn = torch.ops.aten._scaled_dot_product_cudnn_attention
    o2, lse2 = fn(q, k[:, :, q_start:], v[:, :, q_start:], None, True, 0.0, True, False)[:2]
    lse2 = lse2.reshape(q.shape[:3])
    if q_start == 0:
        return o2, lse2
    o1, lse1 = fn(q, k[:, :, :q_start], v[:, :, :q_start], None, True, 0.0, False, False)[:2]
    return _merge(o1, lse1.reshape(q.shape[:3]), o2, lse2, q.dtype)


def sdpa(q, k, v, q_start):
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1),
                                          is_causal=True), None


FORMS = {"runtime": lambda q, k, v, s: ops.attention_lse(q, k, v, s), "two_call": two_call, "cudnn": cudnn,
         "sdpa": sdpa}


def eager_us(fn, args, n: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(*args)
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / n


def main() -> int:
    torch.manual_seed(0)
    cap = max(t + s for t, s in CASES)
    kc = torch.randn(1, HKV, cap, D, device="cuda", dtype=torch.float16)
    vc = torch.randn(1, HKV, cap, D, device="cuda", dtype=torch.float16)
    rows = []
    for T, q0 in CASES:
        q = 2 * torch.randn(1, H, T, D, device="cuda", dtype=torch.float16)
        k, v = kc[:, :, :q0 + T], vc[:, :, :q0 + T]
        ref = ops._attention_lse_ref(q.float(), k.float(), v.float(), q0) if T * (q0 + T) <= REF_MAX else None
        row = {"T": T, "q_start": q0}
        for name, fn in FORMS.items():
            if name == "sdpa" and q0 > 0:
                continue
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = fn(q, k, v, q0)[0]
            torch.cuda.synchronize()
            if name == "cudnn":
                row["cudnn_first_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
            if ref is not None:
                row[f"{name}_err"] = float((o.float() - ref[0]).abs().max())
            row[f"{name}_us"] = round(1e3 * common.graph_ms(lambda *a, f=fn: f(*a), [(q, k, v, q0)]), 1)
        row["runtime_eager_us"] = round(eager_us(FORMS["runtime"], (q, k, v, q0)), 1)
        row["two_call_eager_us"] = round(eager_us(two_call, (q, k, v, q0)), 1)
        row["x_two_call"] = round(row["two_call_us"] / row["runtime_us"], 2)
        rows.append(row)
        print({k2: (f"{v2:.2e}" if k2.endswith("_err") else v2) for k2, v2 in row.items()}, flush=True)
    common.print_table(rows)
    print(json.dumps({"bench": "cache_attention", "rows": rows, **common.environment()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
