"""Lazy loading of the optional CUDA extension ``pyfused._C``.

The extension is built by setup.py only where a CUDA toolkit and a CUDA build of torch are present
(and ``PYFUSED_SKIP_CUDA_BUILD`` is unset). Everything else in pyfused works without it; code that
needs it calls ``load()`` and, on None, reports ``load_error()`` to the user.
"""
from __future__ import annotations

import importlib
from typing import Optional

_module = None
_error: Optional[str] = None
_tried = False


def load():
    """The ``pyfused._C`` module, or None if it was not built or cannot be imported."""
    global _module, _error, _tried
    if not _tried:
        _tried = True
        try:
            _module = importlib.import_module("pyfused._C")
        except ImportError as e:  # not built (PYFUSED_SKIP_CUDA_BUILD, no toolkit) or ABI mismatch
            _error = (f"import failed: {e}. Rebuild with a CUDA toolkit present: "
                      f"pip install -e . --no-build-isolation")
    return _module


def load_error() -> Optional[str]:
    load()
    return _error


def available() -> bool:
    return load() is not None
