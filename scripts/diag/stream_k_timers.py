# ruff: noqa: E501  (the source fragments it patches are matched verbatim)
"""Diag (session 16, issue 4): per-program %globaltimer stamps in the stream-K form of the Gluon W8A8 GEMM (the
row-halves kernel of csrc_triton/w8a8_gemm_wgmma.py at the commit that adds this script), built from the module's
source with the stamps inserted: kernel start, end of the data-parallel phase, around a program's hand-over of its
partial (give) and around the owner's wait-and-add (take), kernel end. Variants: "wave+rem" (the last whole wave
and the partial one split; the kernel as committed), the same without the per-thread GPU fences, "rem" (only the
partial wave split), "nosk". Shapes: fc2 and wo at 8 images, fc2 at 64. Prints each variant's kernel span (first
start to last end, min / median of 9 calls) and the stamps' spread over the programs.

    PYTHONPATH=. python scripts/diag/stream_k_timers.py          (H200, ~1 min; writes tmp_gpu/_sk_*.py)
"""

import importlib.util
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, ".")
import csrc_triton.w8a8_gemm_wgmma as gw  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

SRC = Path("csrc_triton/w8a8_gemm_wgmma.py").read_text()


def build(name, nofence=False, rem_only=False):
    s = SRC
    if rem_only:
        s = s.replace(
            "n_dp = (n_tiles // NUM_PROGRAMS - 1) * NUM_PROGRAMS", "n_dp = (n_tiles // NUM_PROGRAMS) * NUM_PROGRAMS"
        ).replace(
            "dp_steps = (n_tiles // NUM_PROGRAMS - 1) * K_TILES", "dp_steps = (n_tiles // NUM_PROGRAMS) * K_TILES"
        )
        assert "n_dp = (n_tiles // NUM_PROGRAMS) * NUM_PROGRAMS" in s
    s = s.replace(
        "def _w8a8_wgmma_kernel(a_desc, b_desc, a_scale_ptr, b_scale_ptr, bias_ptr, res_desc, c_desc, ws_ptr, flag_ptr, M, N,",
        "def _w8a8_wgmma_kernel(a_desc, b_desc, a_scale_ptr, b_scale_ptr, bias_ptr, res_desc, c_desc, ws_ptr, flag_ptr, dbg_ptr, M, N,",
    )
    s = s.replace(
        "@gluon.jit\ndef _starts(",
        """@gluon.jit
def _now(x):
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _stamp(dbg_ptr, pid, i):
    gl.store(dbg_ptr + pid * 8 + i, _now(pid))


@gluon.jit
def _starts(""",
    )
    s = s.replace(
        "    pid = gl.program_id(0)\n    n_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)\n    K_TILES: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K\n    if STREAM_K:",
        "    pid = gl.program_id(0)\n    _stamp(dbg_ptr, pid, 0)\n    n_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)\n    K_TILES: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K\n    if STREAM_K:",
    )
    s = s.replace(
        "                    _sk_give(acc0, acc1, ws_ptr, flag_ptr, pid, SUB_M, SUB_N, layout)\n",
        "                    _stamp(dbg_ptr, pid, 2)\n                    _sk_give(acc0, acc1, ws_ptr, flag_ptr, pid, SUB_M, SUB_N, layout)\n                    _stamp(dbg_ptr, pid, 3)\n",
    )
    s = s.replace(
        "                    if step >= dp_steps:\n                        acc0, acc1 = _sk_take(",
        "                    if step >= dp_steps:\n                        _stamp(dbg_ptr, pid, 4)\n                        acc0, acc1 = _sk_take(",
    )
    s = s.replace(
        "                    _epilogue_tile(acc0, acc1, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_desc,\n",
        "                    _stamp(dbg_ptr, pid, 5)\n                    _epilogue_tile(acc0, acc1, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_desc,\n",
    )
    s = s.replace(
        "    tma.store_wait(pendings=0)\n    for i in gl.static_range(STAGES):\n        mbarrier.invalidate(ready.index(i))\n    mbarrier.invalidate(r_bar)\n",
        "    tma.store_wait(pendings=0)\n    _stamp(dbg_ptr, pid, 7)\n    for i in gl.static_range(STAGES):\n        mbarrier.invalidate(ready.index(i))\n    mbarrier.invalidate(r_bar)\n",
    )
    # end of DP phase: after the epilogue of step dp_steps-1
    s = s.replace(
        "            else:\n                _epilogue_tile(acc0, acc1, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_desc, c_desc,\n                               c_smem, r_smem, r_bar, HAS_BIAS, HAS_RES, SUB_M, SUB_N, SECOND_M, SECOND_N, layout,\n                               C_BUFS)\n",
        "            else:\n                _epilogue_tile(acc0, acc1, off_m, off_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, res_desc, c_desc,\n                               c_smem, r_smem, r_bar, HAS_BIAS, HAS_RES, SUB_M, SUB_N, SECOND_M, SECOND_N, layout,\n                               C_BUFS)\n            if step == dp_steps - 1:\n                _stamp(dbg_ptr, pid, 1)\n",
    )
    if nofence:
        s = s.replace("token = _fence_gpu(pid)", "token = pid").replace("jj = _fence_gpu(j)", "jj = j")
    assert s.count("_stamp(dbg_ptr") >= 7, s.count("_stamp(dbg_ptr")
    Path("tmp_gpu").mkdir(exist_ok=True)
    p = Path(f"tmp_gpu/_sk_{name}.py")
    p.write_text(s)
    spec = importlib.util.spec_from_file_location(f"_sk_{name}", p)
    m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m
    spec.loader.exec_module(m)
    return m


def run(m, a, b, sa, sb, bias, res, tile=(256, 128, 128, 8, 3), sk=True):
    M, K = a.shape
    N = b.shape[0]
    bm, bn, bk, warps, stages = tile
    c = torch.empty(M, N, dtype=torch.float16, device="cuda")
    half = [bm // 2, bn]
    cl = gl.NVMMASharedLayout.get_default_for(half, gl.float16)
    ad = TensorDescriptor.from_tensor(a, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.int8))
    bd = TensorDescriptor.from_tensor(b, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gl.int8))
    cd = TensorDescriptor.from_tensor(c, half, cl)
    rd = TensorDescriptor.from_tensor(res, half, cl) if res is not None else cd
    P = min(triton.cdiv(M, bm) * triton.cdiv(N, bn), torch.cuda.get_device_properties(0).multi_processor_count)
    ws, flags = gw._stream_k_workspace(a.device, P, bm * bn)
    dbg = torch.full((P, 8), -1, dtype=torch.int64, device="cuda")
    m._w8a8_wgmma_kernel[(P,)](
        ad,
        bd,
        sa,
        sb,
        bias,
        rd,
        cd,
        ws,
        flags,
        dbg,
        M,
        N,
        K=K,
        HAS_BIAS=True,
        HAS_RES=res is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=4,
        STAGES=stages,
        IN_FLIGHT=1,
        NUM_PROGRAMS=P,
        STREAM_K=sk,
        num_warps=warps,
    )
    return c, dbg


def summarize(tag, dbg):
    d = dbg.cpu()
    t0 = int(d[:, 0].min())
    rel = lambda i: [(x - t0) / 1000 if x >= 0 else None for x in d[:, i].tolist()]
    cols = {i: [v for v in rel(i) if v is not None] for i in range(8)}
    names = {0: "start", 1: "dp_end", 2: "give_begin", 3: "give_end", 4: "take_begin", 5: "take_end/epi", 7: "end"}
    line = f"{tag}: " + "  ".join(
        f"{names[i]} n{len(v)} min {min(v):.1f} med {sorted(v)[len(v) // 2]:.1f} max {max(v):.1f}"
        for i, v in cols.items()
        if v and i in names
    )
    print(line)
    gv = [e - b for b, e in zip(rel(2), rel(3)) if b is not None and e is not None]
    tk = [e - b for b, e in zip(rel(4), rel(5)) if b is not None and e is not None]
    if gv:
        print(
            f"   give us: med {sorted(gv)[len(gv) // 2]:.2f} max {max(gv):.2f};  take (wait+add) us: med {sorted(tk)[len(tk) // 2]:.2f} max {max(tk):.2f}"
        )
    # per program: slowest 5 by end
    ends = rel(7)
    order = sorted(range(len(ends)), key=lambda i: -ends[i])[:4]
    for i in order:
        print("   pid", i, [None if x is None else round(x, 1) for x in [rel(j)[i] for j in range(8)]])


def main():
    torch.manual_seed(0)
    for n_img, N, K in ((8, 1152, 4304), (8, 1152, 1152), (64, 1152, 4304)):
        M = n_img * 729
        a = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
        b = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
        sa = torch.rand(M, device="cuda") * 0.02
        sb = torch.rand(N, device="cuda") * 1e-3
        bias = torch.randn(N, device="cuda", dtype=torch.float16)
        res = torch.randn(M, N, device="cuda", dtype=torch.float16)
        want = gw.w8a8_gemm_wgmma(a, b, sa, sb, bias, residual=res, tile=(256, 128, 128, 8, 3), group_m=4)
        for name, nofence, sk, rem_only in (
            ("wave+rem", False, True, False),
            ("wave+rem_nofence", True, True, False),
            ("rem", False, True, True),
            ("nosk", False, False, False),
        ):
            m = build(name.replace("+", "_"), nofence, rem_only)
            spans = []
            for _ in range(9):
                c, dbg = run(m, a, b, sa, sb, bias, res, sk=sk)
                d = dbg.cpu()
                spans.append((int(d[:, 7].max()) - int(d[:, 0].min())) / 1000)
            print(
                f"   {name}: kernel span us (start of first program to end of last), 9 calls: "
                f"min {min(spans):.1f} med {sorted(spans)[4]:.1f}"
            )
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            for _ in range(20):
                run(m, a, b, sa, sb, bias, res, sk=sk)
            ev[1].record()
            torch.cuda.synchronize()
            print(
                f"== {n_img} img N{N} K{K} {name}: same {torch.equal(c, want)}  eager avg {ev[0].elapsed_time(ev[1]) / 20 * 1000:.1f} us (incl launch)"
            )
            summarize(name, dbg)


main()
