"""The tuning cache ``method="auto"`` reads: per-shape choice of method and chunking.

It lives beside the ops, which read it; ``pyfused.tune`` (which measures and writes entries, and
re-exports these names) sits above the ops (docs/ARCHITECTURE.md). The cache is a JSON file
(``PYFUSED_TUNE_CACHE``, default ``~/.cache/pyfused/tune.json``) mapping
``device|world|op|a-shape|b-shape|dtype`` to the method (and chunk count) measured fastest.
``method="auto"`` looks its shape up here; every rank uses rank 0's entry (the choice travels in the
validation exchange).

Entries are written by ``tune`` (pyfused/tune/tuner.py; CLI ``python -m pyfused.tune``), which
measures every method on every rank, lets rank 0 decide and writes the same entry on every rank.
Writes are atomic (a temporary file renamed over the cache, under an exclusive lock), so ranks or
jobs sharing one cache file never leave it half-written or lose each other's entries.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import torch

from .._logging import logger


@dataclass(frozen=True)
class Entry:
    method: str
    chunks: int = 0


_cache: Optional[Dict[str, dict]] = None


class CacheError(RuntimeError):
    pass


def cache_path() -> Path:
    return Path(os.environ.get("PYFUSED_TUNE_CACHE",
                               Path.home() / ".cache" / "pyfused" / "tune.json"))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def key(op: str, world: int, a_shape: Tuple[int, ...], b_shape: Tuple[int, ...],
        dtype: torch.dtype, device: torch.device) -> str:
    dt = str(dtype).replace("torch.", "")
    return f"{device_name(device)}|w{world}|{op}|{'x'.join(map(str, a_shape))}|" \
           f"{'x'.join(map(str, b_shape))}|{dt}"


def _read(path: Path) -> Dict[str, dict]:
    """The file's entries; {} if it does not exist. A file that is not a JSON object raises."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CacheError(f"tuning cache {path} is not valid JSON ({e}); delete it or point "
                         f"PYFUSED_TUNE_CACHE elsewhere") from None
    if not isinstance(data, dict):
        raise CacheError(f"tuning cache {path} is not a JSON object; delete it or point "
                         f"PYFUSED_TUNE_CACHE elsewhere")
    return data


def _load() -> Dict[str, dict]:
    global _cache
    if _cache is None:
        try:
            _cache = _read(cache_path())
        except (OSError, CacheError) as e:
            # auto must keep working on a broken cache, but not silently: it falls back to its size
            # rule, and says so once per process.
            logger.warning("pyfused.tune: ignoring the tuning cache: %s", e)
            _cache = {}
    return _cache


def lookup(op: str, world: int, a_shape, b_shape, dtype, device) -> Optional[Entry]:
    entry = _load().get(key(op, world, a_shape, b_shape, dtype, device))
    return Entry(entry["method"], int(entry.get("chunks", 0))) if entry else None


def reload() -> None:
    """Forget the in-memory copy (after the file changed), and the ops' remembered ``auto`` choices
    (pyfused.comm.forget_seen). Call it on every rank alike, as ``store``."""
    global _cache
    _cache = None
    _forget_choices()


def _forget_choices() -> None:
    from ..comm import forget_seen

    forget_seen()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store(entries: Dict[str, dict], path: Optional[Path] = None) -> Path:
    """Merge ``entries`` (key -> {"method", "chunks", ...}) into the cache file atomically; the
    in-memory copy is refreshed, so ``lookup`` sees them at once, and the ops' remembered ``auto``
    choices are forgotten (so call it on every rank alike, as ``tune`` does)."""
    global _cache
    path = Path(path) if path is not None else cache_path()
    for k, v in entries.items():
        if not isinstance(v, dict) or "method" not in v:
            raise ValueError(f"cache entry {k!r} must be a dict with a 'method'; got {v!r}")
    with _locked(path):
        data = _read(path)  # a corrupt file raises here rather than being overwritten
        data.update(entries)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    if path == cache_path():
        _cache = data
        _forget_choices()
    return path


__all__ = ["Entry", "CacheError", "cache_path", "device_name", "key", "lookup", "reload", "store"]
