"""``fully_shard``'s cross-rank agreement: every rank must shard the same parameters.

Every rank of the data-parallel group must pass the same unit (parameter names, shapes, dtypes,
``requires_grad``) with the same options, or the gathers and reduce-scatters would pair buffers of
different sizes and hang or corrupt. One fixed-size signature exchange carries each rank's local
problem, options and a digest of its parameter list; only when the digests differ, the per-entry
digests are all-gathered to find the first differing parameter and one more exchange describes it
on every rank. Every rank then raises the same ``InputError``, before any other collective.

An HSDP mesh (replicate, shard) has no group spanning it, so its exchanges are two all-gathers, over
the shard group and then, of the rows gathered, over the replicate group: every rank ends with
every rank's row, in mesh order, and decides from the same list. Ranks are named by global rank.
"""
from __future__ import annotations

import zlib
from typing import List, Optional, Sequence, Tuple

import torch

from .. import comm
from ..comm import InputError, Signature, TensorMeta
from ..comm.validate import differing_ops

OP = "fully_shard"
NAME_CHARS = 60

# Local problems, by code: a pure table, so the message is the same on every rank.
ERRORS = {
    1: "its parameters are on several devices (a unit must live on one device)",
    2: "a parameter is a 0-dim tensor (parameters are sharded along dim 0)",
    3: "a parameter is sparse or not a dense tensor, which is not supported",
    4: "a parameter is already a DTensor (tensor-parallel DTensors are not supported; pyfused's "
       "parallelize shards TP with plain tensors)",
    5: "its parameters have several dtypes (give mp_policy=MixedPrecisionPolicy(param_dtype=...) "
       "or shard them in separate units)",
    6: "reshard_after_forward must be True, False or None, and mp_policy's param_dtype and "
       "reduce_dtype None or a float32 / bfloat16 / float16 / float64 dtype",
}


def _digest(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x3FFFFFFF


def _describe(name: str, t: torch.Tensor) -> str:
    return f"{name}|{tuple(t.shape)}|{t.dtype}|{t.device.type}|{int(t.requires_grad)}"


def local_error(params: Sequence[torch.Tensor], mixed_dtypes_ok: bool, options_ok: bool) -> int:
    from torch.distributed.tensor import DTensor

    if not options_ok:
        return 6

    if len({p.device for p in params}) > 1:
        return 1
    if any(p.dim() == 0 for p in params):
        return 2
    if any(p.layout != torch.strided for p in params):
        return 3
    if any(isinstance(p, DTensor) for p in params):
        return 4
    if not mixed_dtypes_ok and len({p.dtype for p in params}) > 1:
        return 5
    return 0


def _gather(groups, mine: List[int], what: str) -> List[List[int]]:
    """Every mesh rank's ``mine``, one row each in mesh order: one fixed-size ``comm.agree_on``
    over each of ``groups`` in turn (the shard group, then the replicate group, of the rows so
    far)."""
    rows = [list(mine)]
    for pg in groups:
        flat = [x for row in rows for x in row]
        every = comm.agree_on(pg, what, flat, width=len(flat), detail="cross-rank input check")
        rows = [row[i:i + len(mine)] for row in every for i in range(0, len(flat), len(mine))]
    return rows


def _exchange(sm, sig: Signature) -> List[Signature]:
    """``comm.exchange`` over the whole mesh ``sm`` (a ``mesh.ShardMesh``)."""
    if len(sm.groups) == 1:
        return comm.exchange(sm.shard_pg, sig)
    if comm.validation_mode() == "off":
        return [sig]
    return [Signature.decode(r) for r in _gather(sm.groups, sig.encode(), sig.name)]


def _agree(sm, sig: Signature, check) -> List[Signature]:
    """``comm.agree`` over the whole mesh ``sm``."""
    sigs = _exchange(sm, sig)
    if len(sm.groups) == 1:
        msg = differing_ops(sm.shard_pg, sigs, "the op called")
    else:
        msg = comm.differs(sigs, "the op called", lambda s: s.op, lambda s: s.name)
    if msg is None:
        msg = check(sigs)
    if msg is not None:
        raise InputError(f"pyfused.{sig.name}: {msg}")
    return sigs


def agree_unit(sm, entries: List[Tuple[str, torch.Tensor]], options: Tuple[int, ...],
               mixed_dtypes_ok: bool = False, options_ok: bool = True) -> None:
    """Raise the same ``InputError`` on every rank of the mesh ``sm`` (a ``mesh.ShardMesh``) unless
    all ranks shard identical parameters (``entries``: (name, parameter)) with identical
    ``options`` (small ints)."""
    params = [t for _, t in entries]
    err = local_error(params, mixed_dtypes_ok, options_ok)
    descs = [_describe(n, t) for n, t in entries]
    digest = _digest("\n".join(descs))
    sig = Signature(comm.op_code(OP), (err, len(entries), digest, *options),
                    (TensorMeta.of(params[0] if params else None),))

    ranks = _rank_names(sm)

    def check(sigs: List[Signature]) -> Optional[str]:
        for r, s in enumerate(sigs):
            if s.ints[0]:
                where = f" on rank {ranks[r]}" if len(sigs) > 1 else ""
                return f"cannot shard the module{where}: {ERRORS[s.ints[0]]}"
        for r, s in enumerate(sigs):
            if s.ints[3:] != sigs[0].ints[3:]:
                return (f"the options (reshard_after_forward, mp_policy dtypes) differs between "
                        f"ranks: rank {ranks[0]} has {sigs[0].ints[3:]}, rank {ranks[r]} has "
                        f"{s.ints[3:]}")
        return None

    sigs = _agree(sm, sig, check)
    if all(s.ints[1:3] == sigs[0].ints[1:3] for s in sigs):
        return
    _raise_first_difference(sm, sigs, entries, descs)


def _rank_names(sm) -> List[int]:
    """The rank each exchanged row is named by: the group rank for a 1-D mesh (the global rank
    with the default group), the global rank for HSDP (its rows are in mesh order)."""
    return list(range(sm.shards)) if len(sm.groups) == 1 else sm.ranks


def _first_difference(sm, sigs: List[Signature], descs: List[str]) -> int:
    """Index of the first entry whose description differs between the mesh's ranks (collective);
    the shortest rank's entry count when every entry they all have agrees. ``sigs[r].ints[1]``:
    rank r's entry count."""
    common = min(s.ints[1] for s in sigs)
    table = _gather(sm.groups, [_digest(d) for d in descs[:common]] or [0], OP)
    for idx in range(common):
        if any(row[idx] != table[0][idx] for row in table):
            return idx
    return common


def _raise_first_difference(sm, sigs: List[Signature], entries, descs: List[str]) -> None:
    idx = _first_difference(sm, sigs, descs)
    name, t = entries[idx] if idx < len(entries) else ("", None)
    chars = [ord(c) & 0x10FFFF for c in name[:NAME_CHARS]]
    detail = Signature(comm.op_code(OP + ".entry"),
                       (idx, int(t is not None), int(t.requires_grad) if t is not None else 0,
                        len(chars), *chars), (TensorMeta.of(t),))
    rows = _exchange(sm, detail)
    ranks = _rank_names(sm)

    def show(s: Signature) -> str:
        if not s.ints[1]:
            return "no such parameter"
        nm = "".join(chr(c) for c in s.ints[4:4 + s.ints[3]])
        grad = ", requires_grad" if s.ints[2] else ""
        return f"'{nm}' {s.tensors[0].describe()}{grad}"

    counts = ", ".join(f"rank {ranks[r]}: {s.ints[1]}" for r, s in enumerate(sigs))
    shown = "; ".join(f"rank {ranks[r]} has {show(s)}" for r, s in enumerate(rows)
                      if r == 0 or s != rows[0])
    raise InputError(f"pyfused.{OP}: the module's parameters differ between ranks at parameter "
                     f"#{idx}: {shown}. Every rank must shard an identical module (parameter "
                     f"counts {counts}).")
