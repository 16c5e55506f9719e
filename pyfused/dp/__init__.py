"""Data parallelism: the pieces behind ``pyfused.layers.DistributedDataParallel``.

buckets.py      bucket assignment and padding
bucket_copy.py  flatten / unflatten of a bucket (Triton kernel on CUDA, torch path on CPU)
reducer.py      hooks, in-order overlapped all-reduce / reduce-scatter, end-of-backward finalize
status.py       the per-iteration status all-reduce (missing gradients, "used" flags), one message
sharded.py      ZeRO-1/2: parameter shards, optimizer wrapping, overlapped parameter all-gather
shard_comm.py   the sharded optimizer's reduce-scatter and all-gather (all-reduce, broadcasts on gloo)
checks.py       construction-time cross-rank agreement and the initial broadcast
"""
from __future__ import annotations

import torch


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` on this rank (each storage counted once)."""
    seen = set()
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                key = (v.untyped_storage().data_ptr(), v.device)
                if key in seen:
                    continue
                seen.add(key)
                total += v.untyped_storage().nbytes()
    return total


__all__ = ["optimizer_state_bytes"]
