"""Per-shape choice of method and chunking for ``method="auto"`` (see docs/ARCHITECTURE.md).

``tune`` (pyfused/tune/tuner.py; CLI ``python -m pyfused.tune``) measures every method of an op on
every rank, lets rank 0 decide and writes the same entry on every rank into the cache that ``auto``
reads (``pyfused.ops.tuned``, re-exported here: ``lookup``, ``store``, ``reload``, ...).
"""
from ..ops.tuned import CacheError, Entry, cache_path, device_name, key, lookup, reload, store  # noqa: F401  (the public names of the cache)


def __getattr__(name):
    if name in ("tune", "decide", "TuneResult"):
        from . import tuner

        return getattr(tuner, name)
    raise AttributeError(f"module 'pyfused.tune' has no attribute {name!r}")


__all__ = ["Entry", "CacheError", "cache_path", "device_name", "key", "lookup", "reload", "store",
           "tune", "decide", "TuneResult"]
