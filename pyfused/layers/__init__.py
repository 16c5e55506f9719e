"""Drop-in parallel modules: tensor-parallel linears and data parallel."""
from .linear import ColumnParallelLinear, RowParallelLinear


def __getattr__(name):
    if name == "DistributedDataParallel":
        from .ddp import DistributedDataParallel

        return DistributedDataParallel
    raise AttributeError(f"module 'pyfused.layers' has no attribute {name!r}")


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "DistributedDataParallel"]
