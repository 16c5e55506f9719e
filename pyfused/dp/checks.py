"""Construction-time agreement of the ranks of a data-parallel module, and the initial broadcast.

Every rank must wrap an identical module (same parameters and buffers: names, shapes, dtypes,
``requires_grad``) with the same options, or the bucketed collectives would pair mismatched
buffers and hang or corrupt. ``agree_module`` checks this on every rank before the first
collective of its own, and raises the identical ``InputError`` everywhere:

1. one fixed-size signature exchange (``pyfused.comm.agree``): per-rank local errors (parameters on
   several devices, a device the backend cannot serve, nothing trainable, a bad option), the
   options, the counts of parameters and buffers and a digest of their descriptions;
2. only if the digests differ: the per-entry digests of the common prefix are all-gathered (fixed
   length: the smallest count, known to every rank from step 1) to find the first entry that
   differs, and one more signature exchange describes that entry on every rank, so the message
   names it ("parameter #3 'fc.weight': rank 0 has [8, 4] float32 on cpu, rank 1 has [8, 5] ...").
"""
from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import comm
from ..comm import InputError, Signature, TensorMeta
from . import reduction

OP = "DistributedDataParallel"
COMM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64)
NAME_CHARS = 60

# Local errors, by code: a pure table, so the message is the same on every rank.
ERRORS = {
    1: "its parameters are on several devices (a data-parallel module must live on one device)",
    2: "its parameters are on a device this process group's backend cannot communicate",
    3: "it has no parameter that requires a gradient (data parallelism has nothing to do)",
    4: "comm_dtype must be None, torch.float32, torch.bfloat16, torch.float16 or torch.float64",
    5: "bucket_cap_mb must be a positive number",
    6: "a parameter is sparse or not a dense tensor, which is not supported",
    7: f"all_reduce must be one of {reduction.MODES}",
    8: ("all_reduce='hierarchical' replaces the buckets' all-reduce, and shard_optimizer=True "
        "reduce-scatters them instead; drop one of them"),
    reduction.MESH_NOT_2D: (f"host_mesh must be a 2-D DeviceMesh with dims {reduction.MESH_DIMS} "
                            f"(pyfused.comm.host_mesh() makes one)"),
    reduction.MESH_OTHER_RANKS: "host_mesh's ranks are not the ranks of process_group",
}
OPTIONS = ("bucket_cap_bytes", "find_unused_parameters", "gradient_as_bucket_view",
           "broadcast_buffers", "comm_dtype", "shard_optimizer", "all_reduce",
           "host_mesh (hosts << 16 | ranks per host)")


def _digest(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x3FFFFFFF


def describe_entry(kind: str, name: str, t: torch.Tensor) -> str:
    return f"{kind}|{name}|{tuple(t.shape)}|{t.dtype}|{t.device.type}|{int(t.requires_grad)}"


def _backend_serves(pg, device_type: str) -> bool:
    if pg is None:
        return True
    backend = str(dist.get_backend(pg)).lower()
    if device_type == "cpu":
        return "gloo" in backend or "cpu" in backend or "mpi" in backend
    if device_type == "cuda":
        return "nccl" in backend or "cuda" in backend or "gloo" in backend
    return True


def local_error(pg, params: Sequence[torch.Tensor], options: Dict[str, object]) -> int:
    devices = {p.device for p in params}
    if len(devices) > 1:
        return 1
    if devices and not _backend_serves(pg, next(iter(devices)).type):
        return 2
    if not any(p.requires_grad for p in params):
        return 3
    if options["comm_dtype"] not in COMM_DTYPES:
        return 4
    cap = options["bucket_cap_mb"]
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0:
        return 5
    if any(p.layout != torch.strided for p in params):
        return 6
    if options["all_reduce"] not in reduction.MODES:
        return 7
    if options["all_reduce"] == "hierarchical" and options["shard_optimizer"]:
        return 8
    return reduction.mesh_error(options["host_mesh"], pg)


def _show_option(name: str, code: int) -> str:
    if name == "all_reduce" and 0 <= code < len(reduction.MODES):
        return repr(reduction.MODES[code])
    return str(code)


def agree_module(pg, entries: List[Tuple[str, str, torch.Tensor]], options: Dict[str, object]) -> None:
    """Raise the same ``InputError`` on every rank unless all ranks wrap identical modules with
    identical options. ``entries``: (kind, name, tensor) for parameters then buffers."""
    params = [t for kind, _, t in entries if kind == "parameter"]
    err = local_error(pg, params, options)
    descs = [describe_entry(*e) for e in entries]
    digest = _digest("\n".join(descs))
    cap = options["bucket_cap_mb"]
    cap_bytes = int(cap * 1024 * 1024) if err != 5 else 0
    opt_values = (cap_bytes, int(bool(options["find_unused_parameters"])),
                  int(bool(options["gradient_as_bucket_view"])), int(bool(options["broadcast_buffers"])),
                  COMM_DTYPES.index(options["comm_dtype"]) if err != 4 else -1,
                  int(bool(options["shard_optimizer"])),
                  reduction.MODES.index(options["all_reduce"]) if err != 7 else -1,
                  reduction.mesh_code(options["host_mesh"]))
    first = params[0] if params else None
    sig = Signature(comm.op_code(OP), (err, len(entries), len(params), digest, *opt_values),
                    (TensorMeta.of(first),))

    def check(sigs: List[Signature]) -> Optional[str]:
        for r, s in enumerate(sigs):
            if s.ints[0]:
                where = f" on rank {r}" if len(sigs) > 1 else ""
                return f"cannot wrap the module{where}: {ERRORS[s.ints[0]]}"
        for k, name in enumerate(OPTIONS):
            msg = comm.differs(sigs, f"the option {name}", lambda s, k=k: s.ints[4 + k],
                               lambda s, k=k: _show_option(name, s.ints[4 + k]))
            if msg:
                return msg
        return comm.differs(sigs, "the device of the parameters", lambda s: s.tensors[0].device)

    sigs = comm.agree(pg, sig, check)
    if all(s.ints[3] == sigs[0].ints[3] and s.ints[1] == sigs[0].ints[1] for s in sigs):
        return
    _raise_first_difference(pg, sigs, entries, descs)


def first_difference(pg, sigs: List[Signature], descs: List[str]) -> int:
    """Index of the first entry whose description differs between ranks (a collective over ``pg``);
    the shortest rank's entry count when every entry they all have agrees. ``sigs[r].ints[1]``:
    rank r's entry count."""
    common = min(s.ints[1] for s in sigs)
    mine = [_digest(d) for d in descs[:common]] or [0]
    table = comm.agree_on(pg, OP, mine, width=len(mine), detail="finding the first differing entry")
    for idx in range(common):
        if any(row[idx] != table[0][idx] for row in table):
            return idx
    return common


def _raise_first_difference(pg, sigs: List[Signature], entries, descs: List[str]) -> None:
    idx = first_difference(pg, sigs, descs)
    entry = entries[idx] if idx < len(entries) else None
    kind, name, t = entry if entry is not None else ("", "", None)
    chars = [ord(c) & 0x10FFFF for c in name[:NAME_CHARS]]
    detail = Signature(comm.op_code(OP + ".entry"),
                       (idx, {"parameter": 1, "buffer": 2}.get(kind, 0),
                        int(t.requires_grad) if t is not None else 0, len(chars), *chars),
                       (TensorMeta.of(t),))
    rows = comm.exchange(pg, detail)

    def show(s: Signature) -> str:
        if s.ints[1] == 0:
            return "no such entry"
        kind_s = "parameter" if s.ints[1] == 1 else "buffer"
        nm = "".join(chr(c) for c in s.ints[4:4 + s.ints[3]])
        grad = ", requires_grad" if s.ints[2] else ""
        return f"{kind_s} '{nm}' {s.tensors[0].describe()}{grad}"

    counts = ", ".join(f"rank {r}: {s.ints[2]} parameters + {s.ints[1] - s.ints[2]} buffers"
                       for r, s in enumerate(sigs))
    shown = "; ".join(f"rank {r} has {show(s)}" for r, s in enumerate(rows)
                      if r == 0 or s != rows[0])
    raise InputError(f"pyfused.{OP}: the module differs between ranks at entry #{idx} of its "
                     f"parameters and buffers: {shown}. Every rank must wrap an identical module "
                     f"({counts}).")


@torch.no_grad()
def broadcast_coalesced(pg, tensors: Sequence[torch.Tensor], cap_bytes: int, src: int = 0) -> None:
    """Overwrite ``tensors`` with group rank ``src``'s values: one broadcast per dtype chunk of up
    to ``cap_bytes`` (a flat copy out and back, as torch DDP's ``_broadcast_coalesced``)."""
    if pg is None or comm.world_size(pg) == 1 or not tensors:
        return
    src_global = comm.global_rank(pg, src)
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        chunk, size = [], 0
        for t in by_dtype[dtype] + [None]:
            if t is not None:
                chunk.append(t)
                size += t.numel() * t.element_size()
            if chunk and (t is None or size >= cap_bytes):
                flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                with comm.failures_named("DistributedDataParallel broadcast of parameters and "
                                         "buffers", pg):
                    dist.broadcast(flat, src=src_global, group=pg)
                off = 0
                for c in chunk:
                    c.copy_(flat[off:off + c.numel()].view_as(c))
                    off += c.numel()
                chunk, size = [], 0
