import os

import pytest
import torch

# Triton kernels run in the interpreter on CPU-only machines; the variable must be set before any
# kernel module is imported (triton reads it when a kernel is decorated).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.dist_pool import Pools


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if has_cuda else 0
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("gpus")
        if marker is not None and count < marker.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {marker.args[0]} GPUs, found {count}"))


@pytest.fixture(scope="session")
def ranks():
    """``ranks.run(world_size, fn, *args, timeout=s)`` -> [fn(rank, world_size, *args) per rank].

    ``fn`` must be a module-level function (it is pickled by name into spawned ranks). Pools of ranks
    are reused across the whole session; see tests/dist_pool.py.
    """
    pools = Pools()
    yield pools
    pools.close()
