"""Runtime options: how the engine runs, never what it computes (beyond a few ulps where a fused form rounds
differently, which each field says).

One frozen `Options` is built at the edge (the CLI's flags, `tinyvila.load(options=...)`, a bench's flags, or
`Options.from_env()` for the two debugging switches below) and passed down: the models keep it
(`VLM.set_options`), and hand it to `ops` calls, which pass the kernel forms on to the launchers as
arguments. Tests pass an `Options` instead of patching module globals.

Environment variables read by `from_env` (and only there):
  TINYVILA_CUDA_GRAPH=0   run the LLM eagerly (no CUDA graphs), for debugging
  TINYVILA_PDL=0          launch the decode step's kernels without programmatic dependent launch
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

_NORM_MODES = ("auto", "on", "off")
_GEMV_KERNELS = ("auto", "mma", "fma")


@dataclass(frozen=True)
class Options:
    """Frozen runtime switches. Defaults are the measured-fastest forms; the others exist for A/B
    measurements and as references in tests.

    cuda_graph       replay the decode step, the first-turn prefill and the vision encoder from CUDA graphs
                     (CUDA fp16/bf16 only; elsewhere the same code runs eagerly)
    pdl              programmatic dependent launch between the decode step's Triton kernels (sm_90+)
    direct_launch    eager Triton launches call the compiled kernel's launcher directly after the first
                     dispatch (same kernel, same arguments, so the same bits; False: Triton's dispatch)
    fused_norm_gemv  the decode step's RMSNorms inside the W4 GEMVs: "auto" (CUDA fp16/bf16 at decode row
                     counts), "on" (also the PyTorch form elsewhere: CPU tests of the wiring), "off"
                     (separate norms; the fused chain rounds the normalised input once instead of twice)
    fused_rope_gemv  RoPE and the KV-cache write in the qkv GEMV's epilogue (bit-identical to the two launches)
    fused_silu       SwiGLU in the gate/up GEMV's epilogue (bit-identical)
    dense_gemv       the lm_head as the Triton GEMV at decode row counts (False: cuBLAS)
    w4_gemv_kernel   the W4 GEMV's inner form: "auto" (tuned table), "mma" or "fma" where the shape allows
    w8a8_persistent  the persistent int8 GEMM at the shapes it was tuned for (False: the plain kernel)
    w8a8_wgmma       the Gluon wgmma int8 GEMM where the persistent kernel would run (Hopper, Triton 3.6)
    w4_cpu_cache     off CUDA, each W4 linear keeps its dequantized weights after the first call (the dense model's
                     memory, 4x the packed size) and runs as the dense linear of them, instead of dequantizing all
                     of them for every token (a few ulps from the fp32 reference path)
    w4_cpu_int4      off CUDA, W4 linears of up to ops.CPU_INT4_MAX_M rows run as PyTorch's packed-int4 CPU matmul
                     where it fits (ops.w4_int4_fits; packed on first use), in bf16: x, scales, zeros and the product
                     rounded to bf16 (3 mantissa bits fewer than fp16), fp32 sums (False: the fp32 reference)
    w4_gemm_pairs    the fused W4 prefill GEMM dequantizes in 16-bit pairs (csrc_triton/w4a16_gemm.py; the same
                     bits for integer and fp16 zero points) instead of fp32 FMAs (False)
    w4_gemm_wgmma    short W4 prefills built into a CUDA graph (a follow-up question) run the Gluon GEMM at the
                     shapes of its table (csrc_triton/w4a16_gemm_wgmma.py: Hopper, Triton 3.6); eager ones keep the
                     Triton GEMM, whose launch costs less host time. False: the Triton GEMM everywhere
    split_rows_attention  later turns replayed from a graph attend with csrc_triton.rows_attention, split over
                     the keys (False: FlashAttention-2's varlen call, unsplit; such turns past
                     generate.FOLLOWUP_GRAPH_MAX_KEYS keys then run eagerly)
    """

    cuda_graph: bool = True
    pdl: bool = True
    direct_launch: bool = True
    fused_norm_gemv: str = "auto"
    fused_rope_gemv: bool = True
    fused_silu: bool = True
    dense_gemv: bool = True
    w4_gemv_kernel: str = "auto"
    w8a8_persistent: bool = True
    w8a8_wgmma: bool = True
    w4_cpu_cache: bool = False
    w4_cpu_int4: bool = True
    w4_gemm_pairs: bool = True
    w4_gemm_wgmma: bool = True
    split_rows_attention: bool = True

    def __post_init__(self):
        if self.fused_norm_gemv not in _NORM_MODES:
            raise ValueError(f"fused_norm_gemv must be one of {_NORM_MODES}, got {self.fused_norm_gemv!r}")
        if self.w4_gemv_kernel not in _GEMV_KERNELS:
            raise ValueError(f"w4_gemv_kernel must be one of {_GEMV_KERNELS}, got {self.w4_gemv_kernel!r}")
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"option {f.name} must be a bool, got {getattr(self, f.name)!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> Options:
        """Defaults, with the debugging switches TINYVILA_CUDA_GRAPH / TINYVILA_PDL (`=0` turns one off)
        applied, then `overrides`. Call this at the edge only (a CLI, a bench), never inside the engine."""
        env = os.environ if environ is None else environ
        base = {"cuda_graph": env.get("TINYVILA_CUDA_GRAPH", "1") != "0", "pdl": env.get("TINYVILA_PDL", "1") != "0"}
        return cls(**{**base, **overrides})

    def with_(self, **changes) -> Options:
        """A copy with `changes` (dataclasses.replace, validated)."""
        return replace(self, **changes)

    @classmethod
    def parse(cls, spec: str, base: Options | None = None) -> Options:
        """Options from "name=value,name=value" (bench and CLI flags), on top of `base`: booleans as
        1/0/true/false/on/off, the mode fields as their strings."""
        base = cls() if base is None else base
        kinds = {f.name: f.type for f in fields(cls)}
        changes = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in kinds:
                raise ValueError(f"bad option {item!r}: expected name=value with name one of {', '.join(kinds)}")
            if kinds[name] == "bool":
                if value.lower() not in ("1", "0", "true", "false", "on", "off"):
                    raise ValueError(f"option {name} takes 1/0/true/false/on/off, got {value!r}")
                changes[name] = value.lower() in ("1", "true", "on")
            else:
                changes[name] = value
        return replace(base, **changes)


DEFAULT = Options()


def set_options(module, options: Options) -> None:
    """Give `options` to every submodule of `module` (an nn.Module) that reads them: the classes that declare
    an `options` attribute (the models, their attention, norms, MLPs and quantized linears)."""
    if not isinstance(options, Options):
        raise TypeError(f"options must be a tinyvila.Options, got {type(options).__name__}")
    for m in module.modules():
        if isinstance(getattr(type(m), "options", None), Options):  # a class default: the module reads them
            m.options = options
