"""Per-shape choice of method and chunking (see ARCHITECTURE.md).

The cache is a JSON file (``PYFUSED_TUNE_CACHE``, default ``~/.cache/pyfused/tune.json``) mapping
``device|world|op|a-shape|b-shape|dtype`` to the method (and chunk count) measured fastest.
``method="auto"`` looks its shape up here; every rank uses rank 0's entry (the choice travels in the
validation exchange).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch


@dataclass(frozen=True)
class Entry:
    method: str
    chunks: int = 0


_cache: Optional[Dict[str, dict]] = None


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


def _load() -> Dict[str, dict]:
    global _cache
    if _cache is None:
        try:
            _cache = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _cache = {}
    return _cache


def lookup(op: str, world: int, a_shape, b_shape, dtype, device) -> Optional[Entry]:
    entry = _load().get(key(op, world, a_shape, b_shape, dtype, device))
    return Entry(entry["method"], int(entry.get("chunks", 0))) if entry else None


def reload() -> None:
    """Forget the in-memory copy (after the file changed)."""
    global _cache
    _cache = None
