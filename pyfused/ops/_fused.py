"""Registry of the fused (symmetric-memory) implementations of the ops.

An op is listed here once its fused kernels exist; until then ``status`` says so, and
``method="fused"`` raises ``MethodUnavailable`` with that reason on every rank.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

IMPLS: Dict[str, Callable] = {}


def status(op: str) -> Tuple[bool, str]:
    if op in IMPLS:
        return True, ""
    return False, (f"this build of pyfused has no fused kernel for {op} yet "
                   f"(use method='decomposed' for the overlapped NCCL schedule)")


def run(op: str, *args, **kwargs):
    if op not in IMPLS:
        from ._common import MethodUnavailable

        raise MethodUnavailable(status(op)[1])
    return IMPLS[op](*args, **kwargs)
