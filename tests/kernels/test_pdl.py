"""Programmatic dependent launch (csrc_triton/pdl.py) changes when kernels start, never a result: with it
on, a decode-like chain of kernels (add+RMSNorm, W4 GEMVs, RoPE + cache write, decoding attention,
SiLU*mul), run eagerly and replayed from a CUDA graph, gives exactly the bits and cache contents of the
same chain with it off (each launcher's `pdl` argument). GPU only (sm_90+); on CPU it is checked to be off
whatever the argument, so the interpreter runs the plain kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _w4_check import make  # noqa: E402

from csrc_triton import pdl  # noqa: E402
from csrc_triton import w4a16_gemv as gemv_mod  # noqa: E402
from csrc_triton.add_rms_norm import add_rms_norm  # noqa: E402
from csrc_triton.decode_attention import decode_attention  # noqa: E402
from csrc_triton.rope_qkv import rope_qkv  # noqa: E402
from csrc_triton.silu_mul import silu_mul  # noqa: E402

ON_GPU = torch.cuda.is_available()


def test_off_on_cpu_and_in_the_interpreter(monkeypatch):
    assert not pdl.supported(torch.device("cpu"))
    assert pdl.options(torch.device("cpu")) == pdl.options_ref() == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(pdl, "INTERPRET", True)
    if ON_GPU:
        assert not pdl.supported(torch.device("cuda"))


def test_the_argument_turns_it_off():
    """options(device, False) is the plain launch on every device; on (the default) only where supported."""
    for device in [torch.device("cpu")] + ([torch.device("cuda")] if ON_GPU else []):
        assert pdl.options(device, False) == pdl.options_ref()
        on = pdl.supported(device)
        assert pdl.options(device) == pdl.options(device, True) == {"PDL": on, "launch_pdl": on}


@pytest.mark.gpu
def test_kernel_launch_matches_the_plain_launch():
    """One kernel launched with pdl.options equals the same kernel launched with pdl.options_ref."""
    from csrc_triton.silu_mul import _silu_mul_kernel

    x = torch.randn(3, 2 * 5000, device="cuda").half()
    outs = []
    for opts in (pdl.options(x.device), pdl.options_ref()):
        y = torch.full((3, 5000), float("nan"), device="cuda").half()
        _silu_mul_kernel[(3, 5)](x, y, 5000, x.stride(0), y.stride(0), BLOCK=1024, **opts)
        outs.append(y)
    assert pdl.options(x.device)["PDL"] == (torch.cuda.get_device_capability() >= (9, 0))
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


class _Chain:
    """One decode-like layer at Llama-3-8B widths (d 4096, 32 q / 8 kv heads of 128, MLP 14336), W4 g128; `pdl`
    is every launcher's argument."""

    def __init__(self, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        d, hd, h, hkv, f, L = 4096, 128, 32, 8, 14336, 700
        self.h, self.hkv, self.pdl = h, hkv, True
        self.w_norm = (1 + 0.1 * torch.randn(d, generator=g, device="cuda")).half()
        self.qkv = make(1, (h + 2 * hkv) * hd, d, 128, torch.float16, seed + 1, device="cuda")
        self.o = make(1, d, h * hd, 128, torch.float16, seed + 2, device="cuda")
        self.up = make(1, 2 * f, d, 128, torch.float16, seed + 3, device="cuda")
        self.down = make(1, d, f, 128, torch.float16, seed + 4, device="cuda")
        self.k = torch.randn(1, hkv, L + 8, hd, generator=g, device="cuda").half()
        self.v = torch.randn(1, hkv, L + 8, hd, generator=g, device="cuda").half()
        ang = torch.rand(1, hd, generator=g, device="cuda") * 6.28
        self.cos, self.sin = ang.cos().half(), ang.sin().half()
        self.slot = torch.tensor([L], device="cuda")
        self.lengths = torch.tensor([L + 1], dtype=torch.int32, device="cuda")

    def _lin(self, x, a):
        return gemv_mod.w4a16_gemv(x, a["qweight"], a["scales"], a["zeros"], pdl=self.pdl)

    def __call__(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        on = self.pdl
        hn, s = add_rms_norm(x, r, self.w_norm, 1e-5, pdl=on)
        qkv = self._lin(hn, self.qkv).view(1, 1, -1)
        q = rope_qkv(qkv, self.cos, self.sin, self.k, self.v, self.slot, self.h, self.hkv, pdl=on)  # (1, H, 1, D)
        att = decode_attention(q[:, :, 0], self.k, self.v, self.lengths, pdl=on)  # (1, H, D)
        hn, s = add_rms_norm(self._lin(att.reshape(1, -1), self.o), s, self.w_norm, 1e-5, pdl=on)
        return self._lin(silu_mul(self._lin(hn, self.up), pdl=on), self.down) + s


def _run(chain, xs, graph: bool) -> list[torch.Tensor]:
    if not graph:
        return [chain(x, r).clone() for x, r in xs]
    sx, sr = xs[0][0].clone(), xs[0][1].clone()
    chain(sx, sr)  # compiles, grows the workspaces outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(sx, sr)
    outs = []
    for x, r in xs:
        sx.copy_(x)
        sr.copy_(r)
        g.replay()
        outs.append(out.clone())
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_chain_bits_unchanged(graph):
    chain = _Chain(0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [(torch.randn(1, 4096, generator=gen, device="cuda").half(),
           torch.randn(1, 4096, generator=gen, device="cuda").half()) for _ in range(3)]
    chain.pdl = False
    k0, v0 = chain.k.clone(), chain.v.clone()
    ref = _run(chain, xs, graph=False)
    k_ref, v_ref = chain.k.clone(), chain.v.clone()
    chain.pdl = True
    assert pdl.supported(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))
    chain.k.copy_(k0)
    chain.v.copy_(v0)
    got = _run(chain, xs, graph=graph)
    for a, b in zip(got, ref):
        assert torch.equal(a, b), f"PDL (graph={graph}) changed the chain's output"
    assert torch.equal(chain.k, k_ref) and torch.equal(chain.v, v_ref)
