"""Triton's kernel dispatch without a GPU: a stand-in for its CUDA driver, and compiled kernels whose C
launch is a Python callable.

With both in place a JITFunction call on CPU tensors runs all of Triton's Python side (binding,
specialisation, cache key, launch metadata) and ends in the callable instead of cuLaunchKernelEx. Used by
the launch tests (test_launch.py, test_prefill_salience_launch.py: `record_launches`), which import it
from this folder (pytest puts a test's folder on the path).
"""

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel
from triton.runtime import JITFunction, driver


class HostOnlyDriver:
    """Triton's driver interface as dispatch uses it: device 0, stream `stream`, an sm_90a target.
    Install with triton.runtime.driver.set_active (or by setting driver._active)."""

    def __init__(self, stream: int = 0):
        self.stream = stream

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return self.stream

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def stub_compile(fn, run) -> None:
    """Make Triton's dispatch of JITFunction `fn` find, for each new specialisation, a CompiledKernel that
    was never compiled and whose launch calls `run` with the C launcher's arguments: grid x, y, z, stream,
    function, packed metadata, launch metadata, enter hook, exit hook, then the kernel's arguments. Each
    one's function handle is "<name>#<i>", i its place in fn's cache, so launches tell compiled kernels
    apart. Undone by `del fn._do_compile; fn.device_caches.clear()`."""

    def do_compile(key, signature, device, constexprs, options, attrs, warmup):
        cache = fn.device_caches[device][0]
        k = CompiledKernel.__new__(CompiledKernel)
        k.module, k.src, k.name, k.packed_metadata = object(), None, fn.__name__, (4, 1, 0)
        k.function = f"{fn.__name__}#{len(cache)}"
        k._run = run
        cache[key] = k
        return k

    fn._do_compile = do_compile


def record_launches(monkeypatch, kernels: dict) -> list[tuple]:
    """Swap every kernel named in `kernels` ({module: kernel attribute names}) for a JITFunction whose
    'compiled' kernels record each launch instead of running: (kernel, via, grid, stream, function, packed
    metadata, kernel arguments), via "direct" when launched with no launch metadata and no hooks (the
    direct launch of csrc_triton/launch.py), else "triton". The driver becomes a HostOnlyDriver on a stream
    other than 0, so a direct launch that invented its own stream would show. For pytest's monkeypatch."""
    launches = []
    monkeypatch.setattr(driver, "_active", HostOnlyDriver(stream=1234))
    for mod, names in kernels.items():
        for name in names:
            fn = JITFunction(getattr(mod, name).fn)
            stub_compile(fn, lambda gx, gy, gz, stream, function, packed, meta, enter, leave, *args, name=name:
                         launches.append((name, "direct" if meta is None and enter is None and leave is None
                                          else "triton", (gx, gy, gz), stream, function, packed, args)))
            monkeypatch.setattr(mod, name, fn)
    return launches


def comparable(launch: tuple) -> tuple:
    """A recorded launch with each tensor argument replaced by what the kernel sees of it besides its data."""
    name, _, grid, stream, function, packed, args = launch
    args = tuple((a.shape, a.stride(), a.dtype, a.data_ptr() % 16 == 0) if torch.is_tensor(a) else a for a in args)
    return name, grid, stream, function, packed, args


def check_direct_launch(launches: list, call, name: str) -> int:
    """`call(direct=False)` once (every launch through Triton's dispatch), then `call(direct=True)` twice,
    recording into `launches` (record_launches): asserts that the first of the two goes through dispatch and
    the second launches directly with the same grid, stream, kernel and arguments as Triton's. Returns the
    number of launches one call makes."""
    del launches[:]
    call(direct=False)
    via_triton = list(launches)
    del launches[:]
    call(direct=True)
    call(direct=True)
    n = len(via_triton)
    assert [v for _, v, *_ in via_triton] == ["triton"] * n, name
    assert [v for _, v, *_ in launches] == ["triton"] * n + ["direct"] * n, name
    for theirs, ours in zip(via_triton, launches[n:]):
        assert comparable(ours) == comparable(theirs), name
    return n
