"""The cross-rank check of the model's values: every rank must start from the same weights.

``parallelize`` takes the full model on every rank and keeps each rank's shard of it; a model whose
values differ between ranks (a checkpoint loaded on rank 0 only, a forgotten seed) would give a
model that mixes the ranks' weights and runs without error. So each rank computes one checksum per
parameter and buffer (``tensor_checksums``), folds them into one value that rides in the
fingerprint exchange (api.py ``_agree``), and only when the ranks disagree does a second step
(``first_differing``) all-gather the per-tensor checksums to name the first tensor that differs.

The checksum is exact on the tensor's bits (its bytes read as integers, summed plainly and weighted
by position): it runs on the tensor's own device with integer arithmetic, so the reduction order of
a parallel sum cannot change it, and it moves only two integers per tensor to the host. Tensors on
the meta device have no values and count as 0.
"""
from __future__ import annotations

import struct
import zlib
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from .. import comm

_CHUNK = 1 << 22  # elements per integer reduction (bounds the int64 temporaries)
_MODULUS = 65521  # position weights 1..65521: a swap of two values changes the weighted sum


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    nbytes = flat.numel() * flat.element_size()
    int_of = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if flat.element_size() in int_of and not flat.is_complex():
        return flat.view(int_of[flat.element_size()])
    return flat.view(torch.uint8)[:nbytes]


def _sums(t: torch.Tensor) -> torch.Tensor:
    """[plain sum, position-weighted sum] of the tensor's bits, int64 on its device."""
    bits = _bits(t)
    out = torch.zeros(2, dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start:start + _CHUNK].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), device=part.device) % _MODULUS + 1
        out[0] += part.sum()
        out[1] += (part * weight).sum()
    return out


def named_tensors(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """Parameters (each shared one once) and buffers, in the model's registration order."""
    return list(model.named_parameters()) + list(model.named_buffers())


def tensor_checksums(model: nn.Module) -> Tuple[List[str], List[int]]:
    """(names, one 30-bit checksum per tensor) of the model's parameter and buffer values."""
    named = named_tensors(model)
    on_device: Dict[torch.device, List[int]] = {}  # device -> indices of its tensors
    for i, (_, t) in enumerate(named):
        if t.device.type != "meta" and t.numel():
            on_device.setdefault(t.device, []).append(i)
    checks = [0] * len(named)
    for indices in on_device.values():  # one transfer to the host per device
        sums = torch.stack([_sums(named[i][1]) for i in indices]).cpu().tolist()
        for i, (plain, weighted) in zip(indices, sums):
            checks[i] = zlib.crc32(struct.pack("<qq", plain, weighted)) & 0x3FFFFFFF
    return [n for n, _ in named], checks


def combined(checks: Sequence[int]) -> int:
    return zlib.crc32(struct.pack(f"<{len(checks)}q", *checks)) & 0x3FFFFFFF


def first_differing(groups, checks: Sequence[int]) -> int:
    """Index of the first tensor whose checksum is not the same on every rank of the mesh (-1: none).

    Every rank must call it with the same number of checksums (the structure fingerprint agreed). One
    all-gather per mesh dim, folded as the fingerprint exchange folds its verdicts: after the dim-k
    gather a rank knows the first index that differs among its dim-k peers or that any of them
    reported, so after the last dim every rank holds the index for the whole mesh."""
    n = len(checks)
    first = n
    for pg in groups:
        world = comm.world_size(pg)
        if world == 1:
            continue
        dev = comm.comm_device(pg)
        mine = torch.tensor([first, *checks], dtype=torch.int64, device=dev)
        every = torch.empty(world * (n + 1), dtype=torch.int64, device=dev)
        comm.all_gather_single(every, mine, group=pg)
        rows = every.view(world, n + 1).cpu()
        first = int(rows[:, 0].min())
        differs = (rows[:, 1:] != rows[:1, 1:]).any(0).nonzero()
        if differs.numel():
            first = min(first, int(differs[0]))
    return first if first < n else -1
