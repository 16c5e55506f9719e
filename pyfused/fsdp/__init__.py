"""Fully sharded data parallelism (ZeRO-3) with torch FSDP2's interface: ``pyfused.fully_shard``.

group.py        one unit's shards (DTensors), gathered leaves, gather and reduce-scatter
fully_shard.py  the hooks that schedule them around forward and backward, ``FSDPModule``
checks.py       construction-time cross-rank agreement
compose.py      with parallelize and pyfused.pipeline (``FullyShardedStage``)
"""
from .compose import FullyShardedStage
from .fully_shard import FSDPModule, MixedPrecisionPolicy, fully_shard, no_sync

__all__ = ["fully_shard", "FSDPModule", "MixedPrecisionPolicy", "no_sync", "FullyShardedStage"]
