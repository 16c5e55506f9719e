"""pyfused: fused collective-compute ops for PyTorch (see README.md and docs/ARCHITECTURE.md)."""
import importlib

from . import comm, ops
from ._logging import logger

__version__ = "0.1.0"

# Heavier or optional parts load on first use.
_LAZY = {
    "layers": ("pyfused.layers", None),
    "pipeline": ("pyfused.pipeline", None),
    "tune": ("pyfused.tune", None),
    "clip_grad_norm_": ("pyfused.clip_grad", "clip_grad_norm_"),
    "parallelize": ("pyfused.parallelize", "parallelize"),
    "fully_shard": ("pyfused.fsdp", "fully_shard"),
}


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'pyfused' has no attribute {name!r}")


__all__ = ["comm", "ops", "logger", "__version__", *_LAZY]
