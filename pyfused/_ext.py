"""The optional CUDA extension ``pyfused._C``: lazy loading, and how a build finds its CUDA toolkit.

``pyfused._C`` (csrc/) is built by setup.py only where a CUDA toolkit and a CUDA build of torch are
present and ``PYFUSED_SKIP_CUDA_BUILD`` is unset (docs/BUILD.md). Everything else in pyfused works
without it; code that needs it calls ``load()`` and, on None, reports ``load_error()`` to the user.

This file imports nothing but the standard library at module level: setup.py loads it by path (it
cannot import the package, which imports torch) so that the build and the tests share one answer to
"where is the toolkit" and "should ``_C`` exist here" (``build_skip_reason``).
"""
from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable, List, Optional

_module = None
_error: Optional[str] = None
_tried = False

SKIP_ENV = "PYFUSED_SKIP_CUDA_BUILD"
REBUILD_HINT = "pip install --no-build-isolation -e ."


def load():
    """The ``pyfused._C`` module, or None if it was not built or cannot be imported.

    Importing it registers its ops (``torch.ops.pyfused.signal_flag`` ...). torch is imported first:
    ``_C`` links against torch's libraries and finds them only once torch has loaded them.
    """
    global _module, _error, _tried
    if not _tried:
        _tried = True
        import torch  # noqa: F401  (see docstring)

        from ._logging import logger

        try:
            _module = importlib.import_module("pyfused._C")
        except ModuleNotFoundError as e:
            if e.name != "pyfused._C":
                raise
            reason = build_skip_reason(torch.version.cuda, find_cuda_toolkit())
            _error = ("pyfused._C is not built: " + (reason or
                      f"setup.py found a CUDA toolkit but this install has no _C (an isolated "
                      f"build without torch?); rebuild with `{REBUILD_HINT}`"))
            logger.debug(_error)
        except ImportError as e:  # built, but against another torch/CUDA (undefined symbol, ABI)
            _error = (f"pyfused._C is built but failed to import: {e}. It was probably built "
                      f"against another torch or CUDA; rebuild with `{REBUILD_HINT}`")
            logger.warning(_error)
        else:
            _mark_side_effects()
    return _module


def load_error() -> Optional[str]:
    load()
    return _error


def available() -> bool:
    return load() is not None


def _mark_side_effects() -> None:
    # wait_flag returns nothing and mutates nothing: without this, an FX graph (torch.compile)
    # would drop it as dead code although it orders the stream.
    import torch
    import torch.fx.node

    torch.fx.node.has_side_effect(torch.ops.pyfused.wait_flag.default)


# ---------------------------------------------------------------------------------------------
# Finding the CUDA toolkit (used by setup.py before torch.utils.cpp_extension guesses one).


@dataclass(frozen=True)
class Toolkit:
    home: str        # the toolkit root: bin/nvcc, include/, lib64/
    nvcc: str        # home/bin/nvcc, the real compiler binary
    version: Optional[str]  # "13.0", from include/cuda.h
    found_by: str    # which rule found it, for the build log

    @property
    def include(self) -> str:
        return os.path.join(self.home, "include")


def _is_binary(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return False
    return magic == b"\x7fELF" or magic[:2] == b"MZ"


def _toolkit_at(home: str, found_by: str) -> tuple[Optional[Toolkit], str]:
    """(Toolkit, "") if ``home`` is a real toolkit, else (None, why not)."""
    home = os.path.realpath(home)
    nvcc = os.path.join(home, "bin", "nvcc")
    if not os.path.isfile(nvcc):
        return None, f"{home}: no bin/nvcc"
    if not os.access(nvcc, os.X_OK):
        return None, f"{nvcc} is not executable"
    if not _is_binary(nvcc):
        return None, f"{nvcc} is a script, not the compiler"
    if not os.path.isdir(os.path.join(home, "include")):
        return None, f"{home}: no include/"
    return Toolkit(home, nvcc, _cuda_h_version(home), found_by), ""


def _cuda_h_version(home: str) -> Optional[str]:
    try:
        with open(os.path.join(home, "include", "cuda.h")) as f:
            m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", f.read())
    except OSError:
        return None
    if not m:
        return None
    v = int(m.group(1))
    return f"{v // 1000}.{(v % 1000) // 10}"


def _homes_of_nvcc(path: str, depth: int = 0) -> List[str]:
    """Toolkit roots that the ``nvcc`` at ``path`` leads to: through symlinks, and through wrapper
    scripts (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``) by the absolute .../bin/nvcc they name."""
    real = os.path.realpath(path)
    homes = [os.path.dirname(os.path.dirname(real))]
    if depth < 4 and os.path.isfile(real) and not _is_binary(real):
        try:
            with open(real, errors="replace") as f:
                text = f.read(65536)
        except OSError:
            text = ""
        for target in re.findall(r"(/[^\s\"'`;|&()]*/bin/nvcc)\b", text):
            if os.path.realpath(target) != real:
                homes += _homes_of_nvcc(target, depth + 1)
    return homes


def _version_key(path: str):
    nums = re.findall(r"\d+", os.path.basename(path))
    return tuple(int(n) for n in nums)


def find_cuda_toolkit(report: Optional[Callable[[str], None]] = None) -> Optional[Toolkit]:
    """The first real CUDA toolkit among, in order: $CUDA_HOME, $CUDA_PATH, the ``nvcc`` on PATH
    resolved through symlinks and wrapper scripts, /usr/local/cuda, /usr/local/cuda-* (newest
    first). Real means: bin/nvcc is an executable binary and include/ exists. ``report`` gets one
    line per candidate that was rejected, and why."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append((os.environ[var], f"${var}"))
    on_path = shutil.which("nvcc")
    if on_path:
        for home in _homes_of_nvcc(on_path):
            candidates.append((home, f"nvcc on PATH ({on_path})"))
    candidates.append(("/usr/local/cuda", "/usr/local/cuda"))
    for home in sorted(glob.glob("/usr/local/cuda-*"), key=_version_key, reverse=True):
        candidates.append((home, "/usr/local/cuda-*"))
    seen = set()
    for home, found_by in candidates:
        if not os.path.isdir(home) or os.path.realpath(home) in seen:
            continue
        seen.add(os.path.realpath(home))
        toolkit, why = _toolkit_at(home, found_by)
        if toolkit is not None:
            return toolkit
        if report is not None:
            report(f"not a CUDA toolkit ({found_by}): {why}")
    return None


def nvidia_include_dirs() -> List[str]:
    """Header folders of the ``nvidia-*`` pip wheels that a CUDA build of torch brings
    (site-packages/nvidia/cu13/include, nvidia/nccl/include, ...). torch's CUDA headers include
    cuBLAS, cuSPARSE, cuSOLVER and NCCL headers that a minimal toolkit lacks. Found with importlib,
    so they are found in virtual environments too.

    CUDA 13 wheels put the toolkit's libraries in one folder per major version (``cu13``): then
    those folders and NCCL's are taken. Older wheels have one folder per library
    (``cuda_runtime``, ``cublas``, ...): then every ``nvidia/*/include``."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for root in spec.submodule_search_locations:
        found += sorted(d for d in glob.glob(os.path.join(root, "*", "include")) if os.path.isdir(d))
    per_major = [d for d in found if re.fullmatch(r"cu\d+", os.path.basename(os.path.dirname(d)))]
    if not per_major:
        return found
    return per_major + [d for d in found if os.path.basename(os.path.dirname(d)) == "nccl"]


def build_skip_reason(torch_cuda: Optional[str], toolkit: Optional[Toolkit]) -> Optional[str]:
    """Why setup.py does (or did) not build ``_C`` in this environment, or None if it builds it.

    ``torch_cuda`` is ``torch.version.cuda`` (None for a CPU build of torch). A toolkit whose major
    version differs from torch's CUDA cannot build against it (torch refuses), so it counts as none.
    """
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return f"{SKIP_ENV}={os.environ[SKIP_ENV]} is set"
    if not torch_cuda:
        return "the installed torch is a CPU build (torch.version.cuda is None)"
    if toolkit is None:
        return ("no CUDA toolkit found ($CUDA_HOME, $CUDA_PATH, nvcc on PATH, /usr/local/cuda*); "
                "set CUDA_HOME to a toolkit root with bin/nvcc and include/")
    if toolkit.version and toolkit.version.split(".")[0] != torch_cuda.split(".")[0]:
        return (f"the CUDA toolkit at {toolkit.home} is {toolkit.version} but torch was built with "
                f"CUDA {torch_cuda}: point CUDA_HOME at a {torch_cuda.split('.')[0]}.x toolkit")
    return None
