"""The cross-rank checks ``parallelize`` runs before it builds a layer: every rank must hold the same
model, weights, mesh, plan and options.

``agree`` runs one fixed-size exchange (``comm.exchange``) per mesh dim, over that dim's group, in
the mesh's dim order: after the exchange along dim k a rank folds in what its dim-k peers reported,
so after the last dim every rank knows the verdict of the whole mesh (a product of its dims)
without a group spanning it. Every verdict is computed from the exchanged rows alone, so all
members of a group reach the same one. What is compared (``Claims``):

  * fingerprints that must be equal on every rank: the model's structure (parameter and buffer
    names, shapes and dtypes, module types), the mesh (dim names in order and sizes), the plan and
    the options;
  * per mesh dim, the global ranks of each rank's group along it, in group order: the members of
    the dim-k group must name the same ranks for it. A mesh whose dim names differ between ranks
    (("dp", "tp") on some, ("tp", "dp") on others) has the same sizes but other groups behind each
    name: its ranks would later wait in different collectives;
  * each rank's own problem (a message), raised on every rank;
  * one checksum of the parameter and buffer values.

The value checksum is exact on the tensor's bits (its bytes read as integers, summed plainly and
weighted by position): it runs on the tensor's own device with integer arithmetic, so the reduction
order of a parallel sum cannot change it, and it moves only two integers per tensor to the host.
Tensors on the meta device have no values and count as 0. Only when the ranks' checksums disagree
does a second step (``first_differing``) all-gather the per-tensor checksums to name the first
tensor that differs.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .._logging import logger

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
        rows = comm.agree_on(pg, "parallelize", [first, *checks], width=n + 1,
                             detail="finding the first differing tensor")
        first = min(row[0] for row in rows)
        differing = [i for i in range(n) if any(row[1 + i] != rows[0][1 + i] for row in rows)]
        if differing:
            first = min(first, differing[0])
    return first if first < n else -1


# ---- the agreement ------------------------------------------------------------------------------
class ParallelizeError(comm.InputError):
    """Raised by ``parallelize`` with the same message on every rank."""


# "dp_replicate" x "dp_shard" (torchtitan's names) take the place of "dp" for dp="hsdp"
MESH_DIMS = ("dp", "cp", "pp", "tp", "ep", "dp_replicate", "dp_shard")
# what every rank of the mesh must hold alike, and how the error names it
ALIKE = {
    "model": "the model (parameter and buffer names, shapes and dtypes, module types)",
    "mesh": "the mesh (its dim names in order, their sizes, and the global ranks in each named group)",
    "plan": "the plan (module patterns and styles, in order)",
    "options": "the options (sequence_parallel, overlap, dp, check_weights, pipeline options)",
}
# a status row: the ALIKE fingerprints, this rank's group along each of MESH_DIMS, then: its
# problem's crc (0: none, 1: ranks have different ones), whether all ranks have a problem, a bit
# per ALIKE entry that differs, the values' checksum, whether the values differ
_GROUP = len(ALIKE)
_ERR = _GROUP + len(MESH_DIMS)
_ALL_ERR, _DIFFERS, _VALUES, _VALUES_DIFFER = range(_ERR + 1, _ERR + 5)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x3FFFFFFF


def _canonical(value) -> str:
    """A text that is equal for equal plain values: dicts and sequences in their order, tensors by
    shape, dtype and an exact checksum of their values."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{_canonical(k)}:{_canonical(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}{value.dtype}{_sums(value).tolist()}"
    return repr(value)


def fingerprint(value) -> int:
    """30-bit fingerprint of a plain value (a plan, the options)."""
    return _crc(_canonical(value))


def model_fingerprint(model: nn.Module) -> int:
    """The model's structure: its class, every module's type, every state tensor's shape and dtype."""
    modules = ";".join(f"{n}:{type(m).__name__}" for n, m in model.named_modules())
    state = model.state_dict(keep_vars=True)
    tensors = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in state.items())
    return _crc(f"{type(model).__name__};{modules};{tensors}")


def mesh_groups(mesh) -> Dict[str, List[int]]:
    """{dim name: the global ranks of this rank's group along it, in group order}."""
    return {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in mesh.mesh_dim_names}


@dataclass
class Claims:
    """What one rank brings to the agreement. ``mesh``: a valid named DeviceMesh, or None (then the
    exchange runs over the default group, and ``problem`` says what is wrong with the mesh)."""

    mesh: object
    alike: Dict[str, int]  # ALIKE key -> fingerprint
    problem: Optional[str] = None
    model: Optional[nn.Module] = None  # its values are checksummed when given
    groups: Dict[str, List[int]] = field(default_factory=dict)

    def __post_init__(self):
        if self.mesh is not None:
            self.groups = mesh_groups(self.mesh)

    def group_code(self, name: str) -> int:
        # a dim the mesh lacks is this rank alone, as a dim of size 1 is
        return _crc(repr(self.groups.get(name, [dist.get_rank()])))


def agree(claims: Claims) -> Optional[str]:
    """Exchange ``claims`` over the mesh (module docstring); the message every rank must raise, or
    None when every rank holds the same model, weights, mesh, plan and options and none has a
    problem. Every rank of the mesh must call it (it is the first collective of parallelize)."""
    problem = claims.problem
    names, checks = [], []
    if claims.model is not None:
        try:  # a rank that cannot checksum still takes part in the exchange (no hang)
            names, checks = tensor_checksums(claims.model)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            problem = problem or f"check_weights: could not checksum the model's tensors ({e!r})"
    err = _crc(problem) if problem else 0
    status = [*(claims.alike[k] for k in ALIKE), *(claims.group_code(d) for d in MESH_DIMS),
              err, int(err != 0), 0, combined(checks) if checks else 0, 0]
    mesh = claims.mesh
    dims = tuple(mesh.mesh_dim_names) if mesh is not None else ()
    # the mesh's dims in its own order: the same groups on every rank even where names differ
    groups = [mesh.get_group(i) for i in range(len(dims))] if dims else [comm.resolve_group(None)]
    for i, pg in enumerate(groups):
        sigs = comm.exchange(pg, comm.Signature(comm.op_code("parallelize"), tuple(status), ()))
        status = _fold(status, [list(s.ints) for s in sigs], dims[i] if dims else None)
    if status[_DIFFERS]:
        what = [k for j, k in enumerate(ALIKE) if status[_DIFFERS] >> j & 1]
        if "mesh" in what:
            logger.error("pyfused.parallelize on this rank: mesh dims %s, their groups' global ranks %s",
                         dims, claims.groups)
        what = [ALIKE[k] for k in what]
        return (f"these differ between ranks: {'; '.join(what)}. Build the same model and call "
                f"parallelize() with the same mesh, plan and options on every rank")
    if status[_ERR] and status[_ALL_ERR] and status[_ERR] == err:
        return problem
    if status[_ERR]:
        if problem:
            logger.error("pyfused.parallelize on this rank: %s", problem)
        return "some ranks cannot parallelize the model (their problem is logged there)"
    if status[_VALUES_DIFFER]:
        first = first_differing(groups, checks)
        return (f"the model's weights differ between ranks (first differing tensor: "
                f"{names[first] if first >= 0 else '?'}): every rank must start from the same full "
                f"model (the same seed, or the checkpoint loaded on every rank); pass "
                f"check_weights=False only if the ranks differ on purpose")
    return None


def _fold(status: List[int], rows: List[List[int]], dim: Optional[str]) -> List[int]:
    """This rank's status after an exchange with its peers along mesh dim ``dim``: a function of
    the rows alone (the same on every peer)."""
    status = list(status)
    differs = 0
    for row in rows:
        differs |= row[_DIFFERS]
    for j in range(len(ALIKE)):
        if any(r[j] != rows[0][j] for r in rows):
            differs |= 1 << j
    mesh_bit = 1 << list(ALIKE).index("mesh")
    if dim is not None and not differs & mesh_bit:
        # the peers call this group by the same name: they must find the same ranks in it
        col = _GROUP + MESH_DIMS.index(dim)
        if any(r[col] != rows[0][col] for r in rows):
            differs |= mesh_bit
    crcs = {r[_ERR] for r in rows if r[_ERR]}
    status[_ERR] = 0 if not crcs else crcs.pop() if len(crcs) == 1 else 1
    status[_ALL_ERR] = int(all(r[_ALL_ERR] for r in rows))
    status[_DIFFERS] = differs
    status[_VALUES_DIFFER] = int(any(r[_VALUES] != rows[0][_VALUES] or r[_VALUES_DIFFER] for r in rows))
    return status
