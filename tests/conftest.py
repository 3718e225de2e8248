"""GPU tests: the `gpu` and `cpu_only` markers (registered in pytest.ini), honoured here for the whole suite.

`@pytest.mark.gpu` is the one spelling of "needs a CUDA GPU". Without CUDA every such test is skipped with
one reason and the run ends with `GPU tests not run: N`; on a GPU machine `pytest -m gpu` (what
scripts/gpu_run.sh runs) selects them and the run ends with their counts. `gpu(capability=(9, 0))` also
needs that compute capability exactly (sm_90a instructions such as wgmma run on Hopper only).
`@pytest.mark.cpu_only` is the reverse: a test that stubs what a GPU machine has for real (the CUDA
driver), skipped where CUDA is present. tests/kernels/conftest.py adds `gpu` to every kernel test on a
CUDA machine, since there they all run the compiled kernels.
"""

import pytest
import torch

CUDA = torch.cuda.is_available()
GPU_REASON = "needs a CUDA GPU (run scripts/gpu_run.sh on a GPU machine)"
CPU_ONLY_REASON = "CPU only: stubs what a CUDA machine runs for real (its GPU tests cover that)"


def pytest_report_header(config):
    if not CUDA:
        return "CUDA: none; tests marked gpu are skipped"
    major, minor = torch.cuda.get_device_capability()
    return f"CUDA: {torch.cuda.get_device_name()} (sm_{major}{minor}); tests marked cpu_only are skipped"


def _capability_skip(item) -> str | None:
    """The reason a gpu(capability=...) test cannot run on this GPU, or None when it can."""
    for mark in item.iter_markers(name="gpu"):
        want = mark.kwargs.get("capability")
        have = torch.cuda.get_device_capability()
        if want is not None and tuple(want) != have:
            return f"needs a GPU of compute capability {want[0]}.{want[1]}; this one is {have[0]}.{have[1]}"
    return None


@pytest.hookimpl(trylast=True)  # after tests/kernels/conftest.py marks kernel tests and -m/-k deselect
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not CUDA and item.get_closest_marker("gpu"):
            reason = GPU_REASON
        elif CUDA and item.get_closest_marker("cpu_only"):
            reason = CPU_ONLY_REASON
        elif CUDA and item.get_closest_marker("gpu"):
            reason = _capability_skip(item)
        else:
            reason = None
        if reason:
            # A skipif on the item itself is evaluated before any other skip mark: one reason per test.
            item.add_marker(pytest.mark.skipif(True, reason=reason), append=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Counted from the test reports (their keywords hold the markers), so it also works under xdist."""
    counts = {category: sum(1 for r in terminalreporter.stats.get(category, []) if "gpu" in getattr(r, "keywords", {}))
              for category in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
    if not CUDA:
        if counts["skipped"]:
            terminalreporter.write_line(f"GPU tests not run: {counts['skipped']} (no CUDA device)")
    elif any(counts.values()):
        summary = ", ".join(f"{n} {category}" for category, n in counts.items() if n)
        terminalreporter.write_line(f"GPU tests on {torch.cuda.get_device_name()}: {summary}")
