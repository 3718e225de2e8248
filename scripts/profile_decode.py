"""Decode-step profile of the LLM alone: tok/s eager vs CUDA-graph replay, and where a step's GPU
time goes (per kernel, from torch.profiler over eager steps).

    PYTHONPATH=. python scripts/profile_decode.py --preset vila-8b --quant w4a16 --context 1024

Synthetic weights at the preset's shapes (speed does not depend on the values); greedy; stop
tokens ignored. Prints a table then one JSON line. The end-to-end numbers live in scripts/bench.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from csrc_triton import pdl  # noqa: E402
from tinyvila.api import from_config  # noqa: E402
from tinyvila.config import QuantConfig, preset  # noqa: E402
from tinyvila.generate import Decoder, SamplingParams, generate  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="vila-8b")
    p.add_argument("--quant", default="w4a16", choices=["w4a16", "none"])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens before decoding")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=15, help="kernels listed in the profile")
    p.add_argument("--variants", default="",
                   help="also time the graph step under settings, e.g. 'pdl=0,pdl=1' (programmatic dependent "
                        "launch, csrc_triton/pdl.py) or 'lmhead=cublas,lmhead=triton' (ops.DENSE_GEMV) or "
                        "'norm=plain,norm=fused' / 'silu=...' (ops.FUSED_NORM_GEMV, ops.FUSED_SILU: RMSNorms / SwiGLU "
                        "in separate launches, or fused into the W4 GEMVs) or 'rope=kernel,rope=gemv' "
                        "(ops.FUSED_ROPE_GEMV: RoPE + KV write in the rope_qkv launch, or in the qkv GEMV's epilogue), "
                        "'gemv=real,gemv=sol,gemv=soltiles,gemv=skip' (every W4 GEMV launch as it is / replaced by a "
                        "read-only kernel of its packed weights, best tiles or the GEMV's own / left out: see "
                        "_gemv_patch; tokens are meaningless then)")
    return p.parse_args(argv)


def text_model(args):
    cfg = dataclasses.replace(preset(args.preset), vision=None, projector=None,
                              quant=QuantConfig(llm=args.quant, vision="none", group_size=args.group_size))
    return from_config(cfg, device=args.device).model.text


def tok_per_s(text, args, graph: bool) -> float:
    dec = Decoder(text, max_seq_len=args.context + args.new_tokens + 64, cuda_graph=graph)
    ids = torch.randint(0, min(1000, text.cfg.vocab_size), (1, args.context), device=args.device)
    logits = dec.prefill(text.embed(ids))
    params = SamplingParams(max_new_tokens=args.new_tokens + 1)
    for _ in range(2):  # warm-up: compiles, captures, then the measured run
        dec.truncate(args.context)
        if args.device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = sum(1 for _ in generate(dec, logits, params)) - 1  # the first token came from the prefill
        if args.device != "cpu":
            torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def kernel_profile(text, args) -> list[tuple[str, float, int]]:
    """(kernel name, GPU us per decode step, calls per step) over 10 eager steps, largest first."""
    dec = Decoder(text, max_seq_len=args.context + 64, cuda_graph=False)
    logits = dec.prefill(text.embed(torch.randint(0, min(1000, text.cfg.vocab_size), (1, args.context), device=args.device)))
    token = int(logits.argmax())
    dec.step(token)
    steps = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.step(token)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / steps, e.count // steps) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def _spin_asm(cycles: int) -> str:
    """PTX: spin until %clock64 has advanced `cycles` SM clocks (one statement per program: unique label)."""
    return ("{\n.reg .u64 t0, t1;\n.reg .pred p;\nmov.u64 t0, %clock64;\nSPIN_LOOP:\nmov.u64 t1, %clock64;\n"
            f"sub.u64 t1, t1, t0;\nsetp.lt.u64 p, t1, {cycles};\n@p bra SPIN_LOOP;\nmov.u32 $0, 0;\n}}")


# gemv=soldelayN: each read-only program spins N SM clocks after its wait (~0.5 / 1 / 2 us at 1.8 GHz).
SPIN_CYCLES = (900, 1800, 3600)
_SPIN_900 = tl.constexpr(_spin_asm(900))
_SPIN_1800 = tl.constexpr(_spin_asm(1800))
_SPIN_3600 = tl.constexpr(_spin_asm(3600))


@triton.jit
def _spin(CYCLES: tl.constexpr):
    """Spin CYCLES SM clocks (one of SPIN_CYCLES; any other value: nothing)."""
    if CYCLES == 900:
        tl.inline_asm_elementwise(_SPIN_900, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    elif CYCLES == 1800:
        tl.inline_asm_elementwise(_SPIN_1800, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    elif CYCLES == 3600:
        tl.inline_asm_elementwise(_SPIN_3600, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _read_weights(w_ptr, out_ptr, K8, STEPS, BN: tl.constexpr, W: tl.constexpr, STAGES: tl.constexpr,
                  PDL: tl.constexpr, TRIGGER: tl.constexpr = 0, DELAY: tl.constexpr = 0):
    """Read BN rows x STEPS x W words of packed weights (split program_id(1) of the K8 words), W words a row per
    step, and store one word per program (so the loads are not dead code): a W4 GEMV's weight traffic with none
    of its arithmetic. TRIGGER as the GEMV's: the next PDL kernel may start at once (0) or after the loop (1).
    DELAY (one of SPIN_CYCLES, else none): each program first spins that many SM clocks after the wait (is the
    step sensitive to a fixed per-program latency?)."""
    pdl.wait(PDL)
    if TRIGGER == 0:
        pdl.launch_dependents(PDL)
    _spin(DELAY)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    base = w_ptr + tl.program_id(1) * STEPS * W
    acc = tl.zeros((BN, W), dtype=tl.int32)
    for s in tl.range(0, STEPS, num_stages=STAGES):
        acc ^= tl.load(base + rows[:, None] * K8 + s * W + tl.arange(0, W)[None, :])
    if TRIGGER == 1:
        pdl.launch_dependents(PDL)
    tl.store(out_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), tl.xor_sum(tl.xor_sum(acc, 1), 0))


# The read-only kernel's tiles: the best of a pure-read sweep at Llama-3-8B shapes (H200 run S9-H, graph-replayed
# per call, fraction of copy bandwidth): 28672 x 512 words 0.76 at 128 rows x 64 words (3 stages), 4096 x 1792
# 0.77, 6144 x 512 0.56 and 4096 x 512 0.64 at 16 rows x 128 words (4 stages); 4 warps.
_SOL_TILES = {True: (128, 64, 3), False: (16, 128, 4)}  # keyed by N >= 16384


def _gemv_patch(mode: str):
    """'gemv=sol': every W4 GEMV launch (plain, norm, SwiGLU, RoPE forms) becomes _read_weights over the same
    packed weights (the step's speed of light for what the GEMVs read, scales and zeros aside), 'gemv=soltiles':
    the same with each GEMV's own tile config (gemv_config), 'gemv=soltrig': as 'sol' but the SwiGLU (gate/up)
    calls let the next kernel start when the GEMV's SwiGLU form does (SILU_TRIGGER), 'gemv=skip': no launch at
    all (what the rest of the step costs), 'gemv=soldelayN' (N in SPIN_CYCLES): 'soltiles' with each program spinning
    N SM clocks after its PDL wait. Outputs are allocated as the GEMV would return them and left
    unwritten: only the timing means anything."""
    from csrc_triton import w4a16_gemv

    def fake(x, qweight, scales, zeros, bias, out, config, unpack, prenorm, residual, gamma, silu=False, rope=None):
        M, K8, N = x.shape[0], qweight.shape[1], qweight.shape[0]
        if out is None:
            out = torch.empty(M, N, dtype=x.dtype, device=x.device)
        outputs = (out,)
        if residual is not None:
            blocks = triton.cdiv(N, (config or w4a16_gemv.gemv_config(M, N, 8 * K8, 128))["BLOCK_N"])
            outputs = (out, torch.empty(M, N, dtype=x.dtype, device=x.device),
                       torch.zeros(blocks, 8, dtype=torch.float32, device=x.device))
        if mode != "skip":
            if mode in ("sol", "soltrig"):
                (bn, w, stages), split, warps = _SOL_TILES[N >= 16384], 1, 4
            else:  # "soltiles" (and soldelayN): the GEMV's own tiles (rows a program, words a step, stages, split, warps)
                cfg = config or w4a16_gemv.gemv_config(M, N, 8 * K8, 128)
                bn, w, stages, split, warps = (cfg["BLOCK_N"], 16 * cfg["GPS"], cfg["STAGES"], cfg["SPLIT_K"],
                                               cfg["num_warps"])
            sink = torch.empty(N // bn * split, dtype=torch.int32, device=x.device)
            trigger = int(silu and mode == "soltrig") * w4a16_gemv.SILU_TRIGGER
            delay = int(mode[len("soldelay"):]) if mode.startswith("soldelay") else 0
            _read_weights[(N // bn, split)](qweight, sink, K8, K8 // w // split, BN=bn, W=w, STAGES=stages,
                                            TRIGGER=trigger, DELAY=delay, num_warps=warps, **pdl.options(x.device))
        return outputs

    return mock.patch.object(w4a16_gemv, "_gemv", fake)


@triton.jit
def _no_zero_terms(pairs, z_ptr, idx, s8, dtype, U: tl.constexpr, M_ODD: tl.constexpr, BLOCK_M: tl.constexpr,
                   GPS: tl.constexpr):
    return tl.zeros((idx.shape[0], 8), dtype=tl.float32)


@triton.jit
def _unit_scales(s_ptr, idx, dtype, S_PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, GPS: tl.constexpr):
    return tl.full((idx.shape[0], 8), 1.0, tl.float32)


@triton.jit
def _no_prenorm(parts, norm_d, eps):
    return tl.full((parts.shape[1],), 1.0, tl.float32)  # parts unused: its load is dead code


@triton.jit
def _finish_plain(out, offs_m, offs_n, pid_n, pid_k, M, N, y_ptr, stride_ym, bias_ptr, ws_ptr, lock_ptr, SPLIT_K,
                  res_ptr, g_ptr, xg_ptr, pout_ptr, r, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                  FENCE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPI: tl.constexpr,
                  PRENORM: tl.constexpr, rope=None, ROPE_D: tl.constexpr = 0, SECOND: tl.constexpr = False):
    """The GEMV's tail without its epilogue: the tile stored plainly into y's first columns (no split-K merge, no
    residual / norm sums, no SwiGLU, no RoPE or cache write)."""
    if EPI == 2:
        limit = N // 2
    elif EPI == 3:
        limit = ROPE_D  # q's first head: in bounds whatever the head count
    else:
        limit = N
    mask = (offs_m < M)[:, None] & (offs_n < limit)[None, :]
    if PRENORM:
        out = out * r[:, None]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


# The raw words as the 16-bit pairs (no lop3 / shift): what the mma consumes without the unpack (fp16 and bf16).
_RAW_PAIRS = tl.constexpr("mov.b32 {$0, $4}, $8;\nmov.b32 {$1, $5}, $8;\nmov.b32 {$2, $6}, $8;\nmov.b32 {$3, $7}, $8;")


@triton.jit
def _raw_planes(words, dtype, UNPACK: tl.constexpr):
    """_magic_planes without the unpack: each word's two 16-bit halves, four times (garbage values, same shapes)."""
    if dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(_RAW_PAIRS, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(_RAW_PAIRS, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 8,
                                     is_pure=True, pack=1)


ABLATIONS = {"nozero": ("_step_zero_terms", _no_zero_terms), "noscale": ("_step_scales", _unit_scales),
             "noepi": ("_finish", _finish_plain), "noprenorm": ("_prenorm_finish", _no_prenorm),
             "nounpack": ("_magic_planes", _raw_planes)}


def ablate(names: str) -> None:
    """TINYVILA_GEMV_ABLATE=nozero[+noscale][+noepi][+noprenorm][+nounpack]: the W4 GEMV (mma and RoPE forms)
    compiled without its per-step zero-point terms (no zeros loaded, no x sums), with unit scales (no scales loaded),
    without its epilogue (_finish_plain), without the RMSNorm prologue (r = 1) and/or without the nibble unpack
    (the raw words fed to the mma: _raw_planes): wrong outputs, for timing which part of the GEMV's work the step
    pays for. (Session 10's 'pairs', a candidate unpack with the same outputs, is the kernel's own since session 11.)
    Applied at import, before any kernel compiles (Triton binds a kernel's helpers when it first compiles it), so one setting
    per process."""
    from csrc_triton import w4a16_gemv

    for name in names.split("+"):
        attr, fn = ABLATIONS[name]
        setattr(w4a16_gemv, attr, fn)


if os.environ.get("TINYVILA_GEMV_ABLATE"):
    ablate(os.environ["TINYVILA_GEMV_ABLATE"])


def _mma(bn: int, warps: int, split: int, gps: int) -> dict:
    return {"kernel": "mma", "BLOCK_N": bn, "num_warps": warps, "STAGES": 3, "SPLIT_K": split, "GPS": gps}


# 'gemvtable=...': M = 1 GEMV configs with more, lighter programs than GEMV_TABLE's (which has 64-128 rows a program:
# qkv 96, o 64, gate_up 224, down 64 x 2 programs), to see whether the step depends on how many programs each GEMV
# has when PDL places them (docs/perf_notes.md, session 9). "half": half the rows a program; "quarter": a quarter
# (one 16-row tile a warp, as rope_ok requires of qkv).
SMALL_TILES = {
    "half": {(1, 6144, 4096): _mma(32, 2, 1, 8), (1, 4096, 4096): _mma(32, 2, 1, 8),
             (1, 28672, 4096): _mma(64, 4, 1, 4), (1, 4096, 14336): _mma(32, 2, 2, 8)},
    "quarter": {(1, 6144, 4096): _mma(16, 1, 1, 8), (1, 4096, 4096): _mma(16, 1, 1, 8),
                (1, 28672, 4096): _mma(32, 2, 1, 4), (1, 4096, 14336): _mma(16, 1, 2, 8)},
}


# 'gemvcfg=SHAPE:FIELDS': one M = 1 GEMV_TABLE entry changed for a variant, SHAPE in GEMV_SHAPES or 'all', FIELDS
# letters each followed by a number: w num_warps, n BLOCK_N rows, g GPS groups per K step, s STAGES, k SPLIT_K
# (fields not named keep the table's value), e.g. 'gemvcfg=all:s4' or 'gemvcfg=o:g4s5+gemvcfg=qkv:g4s5'. The
# session-10 question: the table's STAGES 3 leaves one K step in flight while a step computes (offline SASS,
# docs/perf_notes.md); the sweeps before it never timed more stages.
GEMV_SHAPES = {"qkv": (1, 6144, 4096), "o": (1, 4096, 4096), "gate_up": (1, 28672, 4096), "down": (1, 4096, 14336)}
GEMV_FIELDS = {"w": "num_warps", "n": "BLOCK_N", "g": "GPS", "s": "STAGES", "k": "SPLIT_K"}


def letter_fields(text: str, letters) -> list[tuple[str, int]] | None:
    """'n64s2' -> [('n', 64), ('s', 2)]: letters of `letters`, each with a number, nothing else; None if not."""
    pairs = re.findall(r"([a-z])(\d+)", text)
    if not pairs or "".join(a + b for a, b in pairs) != text or any(a not in letters for a, _ in pairs):
        return None
    return [(a, int(b)) for a, b in pairs]


def gemv_cfg_entries(value: str) -> dict:
    """GEMV_TABLE entries for one 'gemvcfg' value (see GEMV_SHAPES)."""
    from csrc_triton import w4a16_gemv

    shape, _, text = value.partition(":")
    fields = letter_fields(text, GEMV_FIELDS)
    if shape not in (*GEMV_SHAPES, "all") or fields is None:
        raise SystemExit(f"--variants: bad gemvcfg {value!r} (SHAPE:FIELDS, SHAPE in {list(GEMV_SHAPES)} or all, "
                         f"FIELDS letters of {GEMV_FIELDS} each with a number, e.g. o:g4s5)")
    keys = list(GEMV_SHAPES.values()) if shape == "all" else [GEMV_SHAPES[shape]]
    return {key: {**w4a16_gemv.GEMV_TABLE[key], **{GEMV_FIELDS[a]: b for a, b in fields}} for key in keys}

# 'attncfg=FIELDS': the decoding attention's launch config (csrc_triton/decode_attention.py, default_config) for every
# buffer length, FIELDS letters each followed by a number: n block_n keys a tile, w num_warps, s num_stages,
# c programs per SM (sets the split count), p K/V tiles prefetched into L2 before the PDL wait; fields not named keep
# the first CONFIG_BY_LENGTH row's value, e.g. 'attncfg=n64s2'. The sweeps timed single calls; in the step a
# program's shared memory (s x 2 tiles) also decides whether it can start beside the qkv GEMV's programs (PDL).
ATTN_FIELDS = "nwscp"


def attn_cfg(value: str):
    """default_config's stand-in for one 'attncfg' value."""
    from csrc_triton import decode_attention

    fields = letter_fields(value, ATTN_FIELDS)
    if fields is None:
        raise SystemExit(f"--variants: bad attncfg {value!r} (letters of {ATTN_FIELDS!r} each with a number, e.g. n64s2)")
    cfg = list(decode_attention.CONFIG_BY_LENGTH[0][1:])
    for a, b in fields:
        cfg[ATTN_FIELDS.index(a)] = b
    return lambda max_len: tuple(cfg)


def _patch(setting: str):
    """The mock patch of one 'key=value' setting of --variants."""
    from csrc_triton import decode_attention, w4a16_gemv
    from tinyvila import ops

    key, value = setting.split("=")
    if key == "gemvcfg":
        return mock.patch.dict(w4a16_gemv.GEMV_TABLE, gemv_cfg_entries(value))
    if key == "gemvtable" and value in SMALL_TILES:
        return mock.patch.dict(w4a16_gemv.GEMV_TABLE, SMALL_TILES[value])
    if key == "gemv" and value in ("real", "sol", "soltrig", "soltiles", "skip", *(f"soldelay{c}" for c in SPIN_CYCLES)):
        return contextlib.nullcontext() if value == "real" else _gemv_patch(value)
    if key == "pdl":
        return mock.patch.dict(os.environ, {"TINYVILA_PDL": value})
    if key == "lmhead" and value in ("cublas", "triton"):
        return mock.patch.object(ops, "DENSE_GEMV", value == "triton")
    if key == "attn" and value == "skip":  # no decoding-attention launch: its output is the query (timing only)
        return mock.patch.object(ops, "decode_attention", lambda q, k, v, lengths: q)
    if key == "attncfg":
        return mock.patch.object(decode_attention, "default_config", attn_cfg(value))
    if key == "silu" and value in ("plain", "fused"):
        return mock.patch.object(ops, "FUSED_SILU", value == "fused")
    if key == "rope" and value in ("kernel", "gemv"):
        return mock.patch.object(ops, "FUSED_ROPE_GEMV", value == "gemv")
    if key == "norm" and value in ("plain", "fused"):
        return mock.patch.object(ops, "FUSED_NORM_GEMV", "off" if value == "plain" else "auto")
    if key in ("trigger", "silutrigger") and value in ("0", "1", "2"):
        return mock.patch.object(w4a16_gemv, "TRIGGER" if key == "trigger" else "SILU_TRIGGER", int(value))
    raise SystemExit(f"--variants: unknown setting {setting!r} (pdl=0|1, lmhead=cublas|triton, attn=skip, "
                     "attncfg=FIELDS, norm|silu=plain|fused, rope=kernel|gemv, trigger|silutrigger=0|1|2, "
                     "gemv=real|sol|soltrig|soltiles|skip, gemvtable=half|quarter, gemvcfg=SHAPE:FIELDS)")


def variants(text, args) -> dict[str, float]:
    """Graph tok/s per variant: settings 'pdl=P', 'lmhead=cublas|triton', 'norm=plain|fused', 'silu=plain|fused',
    'rope=kernel|gemv', 'trigger=T' / 'silutrigger=T' (when a W4 GEMV lets the next PDL kernel start: csrc_triton/w4a16_gemv.py),
    several joined by '+' (a fresh Decoder, so fresh graphs, for each); restores the settings afterwards."""
    out = {}
    for spec in args.variants.split(","):
        with contextlib.ExitStack() as stack:
            for setting in spec.split("+"):
                stack.enter_context(_patch(setting))
            out[spec] = tok_per_s(text, args, True)
        print(f"  variant {spec}: graph {out[spec]:.1f} tok/s ({1000 / out[spec]:.3f} ms/token)", flush=True)
    return out


def main(argv=None):
    args = parse_args(argv)
    text = text_model(args)
    eager, graph = tok_per_s(text, args, False), tok_per_s(text, args, args.device != "cpu")
    print(f"{args.preset} {args.quant} context {args.context}: eager {eager:.1f} tok/s | "
          f"graph {graph:.1f} tok/s ({1000 / graph:.2f} ms/token)")
    result = dict(preset=args.preset, quant=args.quant, context=args.context, eager_tok_s=eager, graph_tok_s=graph)
    if args.variants and args.device != "cpu":
        result["variants"] = variants(text, args)
    if args.device != "cpu":
        rows = kernel_profile(text, args)
        total = sum(r[1] for r in rows)
        print(f"\nGPU time per eager step: {total:.0f} us (graph step: {1e6 / graph:.0f} us)")
        print(f"{'kernel':<80} {'us/step':>8} {'calls':>6} {'share':>6}")
        for name, us, calls in rows[:args.top]:
            print(f"{name[:80]:<80} {us:8.1f} {calls:6d} {us / total:6.1%}")
        result.update(gpu=torch.cuda.get_device_name(), step_gpu_us=total,
                      kernels=[dict(name=n[:120], us=round(u, 2), calls=c) for n, u, c in rows[:args.top]])
    result.update(torch=torch.__version__)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
