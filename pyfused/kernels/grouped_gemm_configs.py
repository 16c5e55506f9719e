"""Launch configs of the grouped GEMM (grouped_gemm.py), as data.

A segment's row count lives on the device, so the config cannot depend on M: it is a pure function
of (N, K alignment, dtype, arch). Ranks need not agree on it (a peer waits for a flag, never for a
tile count), but it is deterministic anyway. The tiles are the persistent GEMM's medium and
unaligned ones (gemm_configs.py): an expert receives a few hundred to a few thousand rows per
source, so the 128-row tile fills a segment without the large tile's padding waste. None has been
timed on a GPU yet (docs/PERF_kernels.md).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .gemm_configs import ALIGN_ELEMS, GemmConfig, dtype_class

_UNALIGNED = GemmConfig(64, 64, 16, 1, 4, 3)
# arch -> dtype class -> (aligned, unaligned)
_TABLE: Dict[str, Dict[str, Tuple[GemmConfig, GemmConfig]]] = {
    "sm_90": {
        "16bit": (GemmConfig(128, 128, 64, 1, 8, 4), _UNALIGNED),
        "tf32": (GemmConfig(128, 64, 32, 1, 4, 4), _UNALIGNED),
        "ieee": (GemmConfig(64, 64, 32, 1, 4, 3), _UNALIGNED),
    },
    "sm_80": {
        "16bit": (GemmConfig(128, 128, 32, 1, 4, 4), _UNALIGNED),
        "tf32": (GemmConfig(128, 64, 32, 1, 4, 4), _UNALIGNED),
        "ieee": (GemmConfig(64, 64, 32, 1, 4, 3), _UNALIGNED),
    },
    # CPU tensors run in the Triton interpreter: big tiles mean fewer interpreted steps.
    "interpreter": {cls: (GemmConfig(64, 64, 64, 1),) * 2 for cls in ("16bit", "tf32", "ieee")},
}


def choose_grouped_config(n: int, k: int, dtype: torch.dtype, arch: str,
                          allow_tf32: bool = False) -> GemmConfig:
    """The table's config: the unaligned tile when K or N is not a multiple of ALIGN_ELEMS
    (gemm_configs.py says why those spill otherwise), else the aligned one."""
    if arch not in _TABLE:
        raise ValueError(f"no grouped GEMM config table for arch {arch!r}; known: {sorted(_TABLE)}")
    aligned, unaligned = _TABLE[arch][dtype_class(dtype, allow_tf32)]
    return unaligned if k % ALIGN_ELEMS or n % ALIGN_ELEMS else aligned


def selectable_grouped_configs(arch: str, dtype: torch.dtype,
                               allow_tf32: bool = False) -> List[GemmConfig]:
    """Every config ``choose_grouped_config`` can return (benchmarks/hopper_variants.py compiles
    each)."""
    return list(dict.fromkeys(_TABLE[arch][dtype_class(dtype, allow_tf32)]))
