"""pyfused: fused collective-compute ops for PyTorch (see README.md and ARCHITECTURE.md)."""
from . import comm, ops
from ._logging import logger

__version__ = "0.1.0"

__all__ = ["comm", "ops", "logger", "__version__"]
