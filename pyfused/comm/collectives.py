"""Version-portable names for the single-tensor collectives.

torch 2.14 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and deprecates the old names; the GPU machines run torch 2.11, which only
has the old ones. Everything in pyfused calls these two wrappers.
"""
from __future__ import annotations

import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(output, input, group=None, async_op: bool = False):
    """``output`` (dim 0 = world * input's dim 0) <- every rank's ``input``, in rank order."""
    return _all_gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, group=None, async_op: bool = False):
    """``output`` <- this rank's dim-0 chunk of the sum over ranks of ``input``."""
    return _reduce_scatter(output, input, group=group, async_op=async_op)
