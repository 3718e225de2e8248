"""Triton's kernel dispatch without a GPU: a stand-in for its CUDA driver, and compiled kernels whose C
launch is a Python callable.

With both in place a JITFunction call on CPU tensors runs all of Triton's Python side (binding,
specialisation, cache key, launch metadata) and ends in the callable instead of cuLaunchKernelEx. Used by
the prefill-salience bench's --host timing (scripts/benches/prefill_salience.py) and the launch tests
(tests/kernels/test_prefill_salience_launch.py). It sits in scripts/, on the path of every bench, so the
benches run without tests/; not in scripts/benches/, whose every module bench_kernels.py runs as a bench.
"""

from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel


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
