"""Compile, offline for sm_90a, every mma-kernel variant the production launcher launches, and save its SASS.

    PYTHONPATH=. python scripts/w4_gemv_sass.py OUTDIR   (no GPU needed; compare two OUTDIRs with diff -r)

The launcher (`_gemv`, through w4a16_gemv / w4a16_gemv_norm / w4a16_gemv_silu / w4a16_gemv_rope with
gemv_config's config; the RoPE epilogue has its own kernel entry, _w4a16_gemv_rope_kernel)
runs on CPU tensors with the kernel object swapped for a recorder; the recorded call is then bound with
Triton's own JIT binder (the same specialisation: 16-divisible ints/pointers, constexprs) for a CUDA sm_90
backend, with the GPU-only constexprs the launcher would pass on the H200 (UNPACK 1, FENCE, UPCAST_DOT
off, PDL on), and compiled with triton.compile. Writes OUTDIR/<key>.sass (raw nvdisasm), OUTDIR/<key>.norm
(addresses, encodings and label numbers stripped) and OUTDIR/index.json (case -> key, regs, smem, count).
"""
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature
from triton import knobs

from csrc_triton import w4a16_gemv as g

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ROPE = dict(H=32, Hkv=8, D=128, S=1024)  # Llama-3-8B attention: the qkv GEMV's RoPE epilogue
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
GPU_CONSTS = dict(UNPACK=1, FENCE=True, UPCAST_DOT=False, PDL=True, launch_pdl=True)


class Recorder:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
        return launch


def record(mode: str, M: int, N: int, K: int, dtype, bias: bool):
    """Runs the launcher for one production call; returns (config, kernel, the recorded (grid, args, kwargs))."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(dtype)
    qw = torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32, generator=gen)
    s = torch.rand(N, K // 128, generator=gen).to(dtype)
    z = torch.rand(N, K // 128, generator=gen)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    cfg = g.gemv_config(M, N, K, 128)
    # the producer of the partial sums: a 64-row-block GEMV over 4096 columns (o / down)
    pn = (torch.rand(64, 8, generator=gen), 1e-5) if "prenorm" in mode else None
    name = "_w4a16_gemv_rope_kernel" if mode.startswith("rope") else "_w4a16_gemv_mma_kernel"
    rec = Recorder(getattr(g, name))
    setattr(g, name, rec)
    try:
        if mode.startswith("rope"):
            H, Hkv, D, S = ROPE["H"], ROPE["Hkv"], ROPE["D"], ROPE["S"]
            cos, sin = torch.randn(1, D).to(dtype), torch.randn(1, D).to(dtype)
            kv = [torch.empty(M, Hkv, S, D, dtype=dtype) for _ in range(4)]
            slots = torch.zeros(1, dtype=torch.long)
            second = (kv[2], kv[3], slots) if "second" in mode else None
            g.w4a16_gemv_rope(x, qw, s, z, b, cos, sin, kv[0], kv[1], slots, H, Hkv, second=second, config=cfg,
                              unpack=0, prenorm=pn)
        elif mode.startswith("norm"):
            res, gam = torch.randn(M, N).to(dtype), torch.randn(N).to(dtype)
            g.w4a16_gemv_norm(x, qw, s, z, b, res, gam, config=cfg, unpack=0, prenorm=pn)
        elif mode.startswith("silu"):
            g.w4a16_gemv_silu(x, qw, s, z, config=cfg, unpack=0, prenorm=pn)
        else:
            g.w4a16_gemv(x, qw, s, z, b, config=cfg, unpack=0, prenorm=pn)
    finally:
        setattr(g, name, rec.fn)
    (call,) = rec.calls
    return cfg, rec.fn, call


def compile_call(fn, args, kwargs):
    kwargs = {**kwargs, **{k: v for k, v in GPU_CONSTS.items()}}
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    ident = json.dumps([sorted(signature.items()), sorted((str(k), str(v)) for k, v in constexprs.items()),
                        sorted((str(k), str(v)) for k, v in attrs.items()),
                        sorted((k, str(v)) for k, v in options.__dict__.items())])
    return ident, (signature, constexprs, attrs, options)


def sass_of(src_tuple, fn):
    signature, constexprs, attrs, options = src_tuple
    k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", res).group(1)), k.metadata.shared


def normalise(sass: str) -> list[str]:
    """Instructions only: opcode + operands; addresses (/*0a70*/), encodings and label numbers dropped, branch
    targets renamed by order of first appearance (they only move with code layout)."""
    out, labels = [], {}
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if m:
            out.append(re.sub(r"\s+", " ", m.group(1)))
        elif re.match(r"\s*\.L_x_\d+:", line):
            out.append(line.strip())
    text = "\n".join(out)
    for lab in re.findall(r"\.L_x_\d+", text):
        labels.setdefault(lab, f".L{len(labels)}")
    text = re.sub(r"\.L_x_\d+", lambda m: labels[m.group(0)], text)
    text = re.sub(r"`\(\.L\d+\)", lambda m: m.group(0), text)
    return text.splitlines()


def cases():
    for name, (N, K) in SHAPES.items():
        for M in (1, 2, 4, 8):
            for dtype in (torch.float16, torch.bfloat16):
                dn = str(dtype).split(".")[1]
                yield f"{name} M{M} {dn} plain", "plain", M, N, K, dtype, False
                if name == "qkv":
                    yield f"{name} M{M} {dn} prenorm", "prenorm", M, N, K, dtype, False
                    yield f"{name} M{M} {dn} prenorm+bias", "prenorm", M, N, K, dtype, True
                    if ROPE_CASES:
                        yield f"{name} M{M} {dn} rope+prenorm", "rope prenorm", M, N, K, dtype, False
                        yield f"{name} M{M} {dn} rope+prenorm+second", "rope prenorm second", M, N, K, dtype, False
                        yield f"{name} M{M} {dn} rope+prenorm+bias", "rope prenorm", M, N, K, dtype, True
                if name in ("o", "down"):
                    yield f"{name} M{M} {dn} norm", "norm", M, N, K, dtype, False
                    yield f"{name} M{M} {dn} norm+prenorm", "norm prenorm", M, N, K, dtype, False
                if name == "gate_up":
                    yield f"{name} M{M} {dn} silu+prenorm", "silu prenorm", M, N, K, dtype, False
                    yield f"{name} M{M} {dn} silu", "silu", M, N, K, dtype, False


# TINYVILA_SASS_ROPE=0 leaves out the RoPE epilogue's cases (a before/after diff against an older OUTDIR).
ROPE_CASES = os.environ.get("TINYVILA_SASS_ROPE", "1") == "1"


def main(outdir: str):
    os.makedirs(outdir, exist_ok=True)
    index, compiled = {}, {}
    for label, mode, M, N, K, dtype, bias in cases():
        cfg, fn, (grid, args, kwargs) = record(mode, M, N, K, dtype, bias)
        ident, src = compile_call(fn, args, kwargs)
        key = hashlib.sha1(ident.encode()).hexdigest()[:12]
        if key not in compiled:
            sass, regs, smem = sass_of(src, fn)
            norm = normalise(sass)
            with open(f"{outdir}/{key}.sass", "w") as f:
                f.write(sass)
            with open(f"{outdir}/{key}.norm", "w") as f:
                f.write("\n".join(norm) + "\n")
            compiled[key] = dict(regs=regs, smem=smem, n=sum(not t.startswith(".L") for t in norm),
                                 sha=hashlib.sha1("\n".join(norm).encode()).hexdigest()[:16])
            print(f"compiled {key}: {compiled[key]}", flush=True)
        consts = {k: v for k, v in kwargs.items() if k not in GPU_CONSTS and not hasattr(v, "data_ptr")}
        index[label] = dict(key=key, grid=list(grid), config=cfg, consts={k: str(v) for k, v in consts.items()},
                            **compiled[key])
        print(f"{label:<32} {key} n={compiled[key]['n']} regs={compiled[key]['regs']}", flush=True)
    with open(f"{outdir}/index.json", "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
