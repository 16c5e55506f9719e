import os
import sys

# Eager CUDA module loading, set before anything starts CUDA (the driver reads it once): with lazy
# loading, CUDA's default, the first launch of a kernel waits until the context's running kernels
# finish, so a kernel spinning on a flag that a later launch of the same process sets (virtual ranks,
# a test's producer stream) holds that launch until the spin times out. Children inherit it.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
# A hardware work queue per stream for virtual ranks (pyfused/testing/virtual_ranks.py,
# push_streams_per_rank): with CUDA's default 8, streams of different ranks share queues and a
# rank's kernel can wait behind a peer's spinning one.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run in the interpreter on CPU-only machines; the variable must be set before any
# kernel module is imported (triton reads it when a kernel is decorated).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.dist_pool import Pools  # noqa: E402


def _interpreter_problem():
    """Why CPU-tensor Triton tests cannot run here, or None. With a GPU, TRITON_INTERPRET is unset
    (the GPU tests compile the kernels); triton 3.6's interpreter fails with numpy >= 2.4 (the
    device's versions). CI runs these tests."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "needs the Triton interpreter (TRITON_INTERPRET=1, set on machines without CUDA); CI runs it"
    from pyfused.kernels.reduce_launch import interpreter_problem

    why = interpreter_problem()
    return f"{why}; CI runs it" if why else None


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if has_cuda else 0
    no_interpreter = None
    if any("interpreter" in item.keywords and "gpu" not in item.keywords for item in items):
        no_interpreter = _interpreter_problem()
    for item in items:
        if no_interpreter and "interpreter" in item.keywords and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason=no_interpreter))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("gpus")
        if marker is not None and count < marker.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {marker.args[0]} GPUs, found {count}"))


def pytest_runtest_logreport(report):
    """A failed GPU test's report, written at once: a kernel that traps loses the CUDA context, and
    the process may then abort before pytest prints its summary."""
    if report.failed and "gpu" in report.keywords:
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext}\n")
        sys.stderr.flush()


@pytest.fixture(scope="session")
def ranks():
    """``ranks.run(world_size, fn, *args, timeout=s)`` -> [fn(rank, world_size, *args) per rank].

    ``fn`` must be a module-level function (it is pickled by name into spawned ranks). Pools of ranks
    are reused across the whole session; see tests/dist_pool.py.
    """
    pools = _session_pools.setdefault("pools", Pools())
    yield pools
    pools.close()
    _session_pools.clear()


_session_pools: dict = {}


@pytest.fixture(autouse=True)
def _recycle_crowded_pools():
    """After each test: replace the rank pools crowded with the gloo groups earlier tests made
    (tests/dist_pool.py)."""
    yield
    pools = _session_pools.get("pools")
    if pools is not None:
        pools.recycle_crowded()
