"""Symmetric buffers: a buffer and a signal pad on every rank, every peer's mapped into every rank.

``SymmetricBuffer.get(group, nbytes, device)`` returns this rank's buffer of at least ``nbytes`` (its
size class: the next power of two, at least ``MIN_SIZE_CLASS``) for ``group``, allocated and
exchanged once per (group, device, backend, size class) and reused by every later call. It is a
collective: every rank of the group calls it with the same ``nbytes`` (the fused ops derive it from
shapes that ``comm.agree`` has already checked). It gives
  * ``peer(q, shape, dtype)`` / ``local_view(shape, dtype)``: tensors on this rank's device that view
    rank q's (this rank's) data area -- writes through a peer view land in the peer's memory;
  * ``pad(q)`` / ``flags(q)``: int32 views of rank q's signal pad / its chunk-flag words;
  * ``buffer_ptrs`` / ``pad_ptrs`` (lists of addresses valid in this process) and
    ``buffer_ptrs_dev`` / ``pad_ptrs_dev`` (the same as int64 tensors on the device, what the
    kernels take);
  * ``next_epoch()``: the value this call signals and waits for (see csrc/allreduce.h);
  * ``free()``: collective, explicit release; afterwards every accessor raises.

Layout of one allocation: ``[data: size class bytes][pad: PAD_BYTES]``; the pad is zero at
allocation. Its words are laid out in csrc/allreduce.h (barrier slots, then chunk flags);
``check_layout`` compares the constants below with the compiled ones. The pad lives inside the
symmetric allocation (not in torch's own signal pad, whose size and use by torch's ops we do not
control), so every backend has the same layout.

Backends (``backend=`` or ``PYFUSED_SYMM_BACKEND``; docs/TESTBED.md compares them):
  * ``"torch"`` (default): torch's symmetric memory (``torch.distributed._symmetric_memory``):
    cuMem allocations exchanged by ``rendezvous`` over the group's store. Several ranks on one GPU
    need ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``.
  * ``"ipc"``: pyfused._C's ``ipc_alloc`` / ``ipc_handle`` / ``ipc_open`` (cudaMalloc +
    cudaIpcGetMemHandle / cudaIpcOpenMemHandle), handles exchanged with ``comm.agree_on``.
  * ``"host-shm"``: POSIX shared memory between CPU processes of one host, names exchanged the same
    way. It maps nothing on a GPU; it exists so that the exchange, the bookkeeping and the CPU
    models of the fused kernels (the CPU kernels of ``pyfused::all_reduce_rows`` / ``symm_barrier``,
    the Triton interpreter) run across real processes in tests. No op chooses it.
  * world size 1 needs no exchange: a plain zeroed tensor on the device ("local").
  * ranks of one process (a ``BufferProvider`` passed as the group, such as the test bed's virtual
    ranks): the provider hands each rank its ``SymmetricBuffer``; nothing is exchanged.

The backends' classes are in ``symmetric_backends.py``.

On CPU, ``symmetric_status`` reports the buffers unavailable with the reason, and
``SymmetricBuffer.get`` raises ``SymmetricUnavailable`` with it (unless ``backend="host-shm"``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._logging import logger
from .agreement import LocalWorkError, agree_on
from .group import (
    BufferProvider,
    group_name as _group_name,
    rank as _rank,
    resolve_group,
    world_size as _world_size,
)
from .symmetric_backends import (  # noqa: F401  (re-exported: the public names live here)
    BACKENDS,
    Backend,
    CudaIpcBackend,
    HostSharedMemoryBackend,
    LocalBackend,
    Mapping,
    SymmetricUnavailable,
    TorchSymmetricMemoryBackend,
)
from .topology import local_host

# Mirrors of csrc/allreduce.h (checked by check_layout).
MAX_WORLD = 8
MAX_BLOCKS = 64
CHANNELS = 5
PAD_INTS = 8192
FLAG_OFFSET = 4096
MAX_FLAGS = 4096
CHAN_START, CHAN_MID, CHAN_END, CHAN_ENTRY, CHAN_SYNC = range(5)
PAD_BYTES = PAD_INTS * 4

MIN_SIZE_CLASS = 1 << 16
# Epochs are int32 on the device; a buffer resets its pads (collectively) before reaching this.
EPOCH_LIMIT = 2**31 - 2
BACKEND_ENV = "PYFUSED_SYMM_BACKEND"
DEFAULT_BACKEND = "torch"
OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def size_class(nbytes: int) -> int:
    """The buffer size that serves a request of ``nbytes``: a power of two >= MIN_SIZE_CLASS."""
    if not isinstance(nbytes, int) or nbytes < 1:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    return max(MIN_SIZE_CLASS, 1 << (nbytes - 1).bit_length())


def check_layout() -> None:
    """Raise if the constants above differ from the compiled ones (pyfused._C's symm_layout)."""
    compiled = list(torch.ops.pyfused.symm_layout())
    mine = [MAX_WORLD, MAX_BLOCKS, CHANNELS, PAD_INTS, FLAG_OFFSET, MAX_FLAGS,
            CHAN_START, CHAN_MID, CHAN_END, CHAN_ENTRY, CHAN_SYNC]
    if compiled != mine:
        raise RuntimeError(f"pyfused._C's signal-pad layout {compiled} differs from "
                           f"pyfused/comm/symmetric.py's {mine}: rebuild the extension")


def default_backend() -> str:
    return os.environ.get(BACKEND_ENV, DEFAULT_BACKEND).strip() or DEFAULT_BACKEND


def symmetric_status(device, backend: Optional[str] = None) -> Tuple[bool, str]:
    """Whether this process can set up symmetric buffers on ``device`` (no collective), and why not."""
    device = torch.device(device)
    name = backend or default_backend()
    if name not in BACKENDS:
        return False, f"unknown symmetric-memory backend {name!r} (known: {sorted(BACKENDS)})"
    if device.type != "cuda" and name != "host-shm":
        return False, (f"symmetric buffers need CUDA tensors (got {device.type}): peers map each "
                       f"other's GPU memory, and on {device.type} there is none to map")
    if device.type == "cuda" and not torch.cuda.is_available():
        return False, "no CUDA device is visible to torch"
    why = BACKENDS[name].status(device)
    return (why is None), (why or "")


# ---------------------------------------------------------------------------------------------
# The exchange: every rank's record, checked identically everywhere before anything is mapped.


@dataclass(frozen=True)
class Record:
    nbytes: int
    backend: str
    device_type: str
    device_index: int
    host: str
    handle: Any = None
    error: Optional[str] = None


def gather_records(pg, mine: Record, gather: Optional[Callable] = None) -> List[Record]:
    """Every rank's record in group-rank order (``agree_on``; ``gather(out_list, obj, group=pg)``
    replaces its all-gather in tests)."""
    if _world_size(pg) == 1:
        return [mine]
    if gather is None:
        return agree_on(pg, "SymmetricBuffer", mine, detail="exchanging the ranks' records")
    out: List[Any] = [None] * _world_size(pg)
    gather(out, mine, group=pg)
    return out


def check_records(records: Sequence[Record]) -> Optional[str]:
    """Why these ranks cannot map each other's buffers, or None: a function of ``records``, and,
    for torch's backend with ranks sharing a device, of its settings (the same on every rank)."""
    failed = [(q, r.error) for q, r in enumerate(records) if r.error]
    if failed:
        return "; ".join(f"rank {q} could not allocate its buffer: {e}" for q, e in failed)
    r0 = records[0]
    for what in ("nbytes", "backend", "device_type"):
        for q, r in enumerate(records[1:], start=1):
            if getattr(r, what) != getattr(r0, what):
                return (f"{what} differs between ranks: rank 0 has {getattr(r0, what)!r}, rank {q} "
                        f"has {getattr(r, what)!r} (every rank must ask for the same buffer)")
    hosts = sorted({r.host for r in records})
    if r0.backend != "local" and len(hosts) > 1:
        return f"the ranks are on {len(hosts)} hosts {hosts}: symmetric memory maps memory within one host"
    if len(records) > MAX_WORLD:
        return f"the group has {len(records)} ranks; the kernels serve at most {MAX_WORLD}"
    if r0.backend == "torch" and r0.device_type == "cuda":
        seen: Dict[int, int] = {}
        for q, r in enumerate(records):
            if r.device_index in seen and os.environ.get(OVERLAP_ENV, "0") != "1":
                return (f"ranks {seen[r.device_index]} and {q} share cuda:{r.device_index}; torch "
                        f"symmetric memory maps one device per rank unless {OVERLAP_ENV}=1 is set "
                        f"(docs/TESTBED.md)")
            if r.device_index in seen and _torch_symm_backend(r.device_index) == "NVSHMEM":
                return (f"ranks {seen[r.device_index]} and {q} share cuda:{r.device_index}, and torch "
                        f"symmetric memory uses NVSHMEM, which cannot host several ranks on one GPU: "
                        f"set TORCH_SYMMMEM=CUDA (docs/TESTBED.md)")
            seen.setdefault(r.device_index, q)
    return None


def _torch_symm_backend(device_index: int) -> Optional[str]:
    """torch symmetric memory's allocation backend on cuda:``device_index`` ("CUDA", "NVSHMEM",
    "NCCL"), or None where this torch cannot say."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        return symm_mem.get_backend(torch.device("cuda", device_index))
    except Exception:  # an older torch, or no backend chosen yet
        return None


def _check_peer_access(device: torch.device, records: Sequence[Record]) -> None:
    """Raise if this rank's GPU cannot address a peer's (other) GPU directly (no NVLink/PCIe P2P)."""
    if device.type != "cuda":
        return
    for q, r in enumerate(records):
        if (r.device_index != device.index
                and not torch.cuda.can_device_access_peer(device.index, r.device_index)):
            raise SymmetricUnavailable(f"cuda:{device.index} has no peer access to cuda:{r.device_index} "
                                       f"(rank {q}'s GPU)")


# ---------------------------------------------------------------------------------------------


class SymmetricBuffer:
    """One rank's view of a symmetric allocation (see the module docstring)."""

    _cache: Dict[Tuple[str, str, str, int], "SymmetricBuffer"] = {}

    def __init__(self, pg, data_bytes: int, device: torch.device, backend: str, mapping: Mapping,
                 key: Tuple[str, str, str, int]):
        self.pg = pg
        self.group_name = _group_name(pg)
        self.rank = _rank(pg)
        self.world = _world_size(pg)
        self.data_bytes = data_bytes
        self.total_bytes = data_bytes + PAD_BYTES
        self.device = device
        self.backend = backend
        self.key = key
        self._mapping: Optional[Mapping] = mapping
        self._epoch = 0
        # The device copies of the pointer tables are made here, once. Made at a call's first
        # kernel instead, they would be a host-synchronizing copy in the middle of a call; virtual
        # ranks share one context, and a rank blocked there while its peers' kernels spin waiting
        # for it never launches its own.
        self._ptr_tables: Optional[Tuple[torch.Tensor, torch.Tensor]] = self._copy_tables()
        self.extras: Dict[Any, Any] = {}  # per-buffer caches of the fused ops (pointer tables ...)

    # -- creation and release -----------------------------------------------------------------

    @classmethod
    def get(cls, group=None, nbytes: int = MIN_SIZE_CLASS, device=None, backend: Optional[str] = None,
            gather: Optional[Callable] = None) -> "SymmetricBuffer":
        """This rank's cached buffer of >= ``nbytes`` for ``group`` on ``device``; collective on a
        cache miss. ``gather`` replaces the records' all-gather (tests)."""
        pg = resolve_group(group) if not isinstance(group, dist.ProcessGroup) else group
        if isinstance(pg, BufferProvider):  # ranks of one process: the provider owns the memory
            return pg.symmetric_buffer(size_class(nbytes), torch.device(device))
        device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        name = backend or default_backend()
        data_bytes = size_class(nbytes)
        key = (_group_name(pg), str(device), name, data_bytes)
        buf = cls._cache.get(key)
        if buf is None:  # a cached buffer passed the status check when it was made
            ok, why = symmetric_status(device, name)
            if not ok:
                raise SymmetricUnavailable(why)
            buf = cls._create(pg, data_bytes, device, name, key, gather)
            cls._cache[key] = buf
        return buf

    @classmethod
    def _create(cls, pg, data_bytes, device, name, key, gather) -> "SymmetricBuffer":
        world, rank = _world_size(pg), _rank(pg)
        backend = BACKENDS["local" if world == 1 else name]
        total = data_bytes + PAD_BYTES
        local = handle = state = None
        error = None
        try:
            local, handle, state = backend.allocate(total, device)
        except Exception as e:  # every rank learns of it through the records below
            error = f"{type(e).__name__}: {e}"
        mine = Record(total, backend.name, device.type, device.index or 0, local_host(),
                      handle, error)
        records = gather_records(pg, mine, gather)
        msg = check_records(records)
        mapping = None
        if msg is None:
            try:
                _check_peer_access(device, records)
                mapping = backend.open([r.handle for r in records], rank, local, state, total, device, pg)
            except Exception as e:  # agreed on below: every rank raises the same error
                error = f"{type(e).__name__}: {e}"
            try:
                agree_on(pg, "SymmetricBuffer", error=error, detail="mapping the peers' buffers")
            except LocalWorkError as e:
                failed = e.failed if world > 1 else [(None, error)]
                msg = "mapping the peers' buffers failed: " + "; ".join(
                    f"rank {q}: {why}" if q is not None else why for q, why in failed)
        if msg is not None:
            if mapping is not None:
                mapping.release()
            elif state is not None and hasattr(state, "close"):  # host-shm: drop our view first
                local = None
                state.close()
                state.unlink()
            raise SymmetricUnavailable(f"symmetric buffer for group {_group_name(pg) or '<local>'}: "
                                       f"{msg}")
        logger.debug("pyfused: symmetric buffer %d B (%s) for group %r, rank %d/%d", data_bytes,
                     backend.name, _group_name(pg), rank, world)
        return cls(pg, data_bytes, device, backend.name, mapping, key)

    def free(self) -> None:
        """Release this buffer on every rank (collective; the peers must call it too). Work queued on
        the device is finished first, and no rank unmaps before every rank got here."""
        if self._mapping is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.world > 1 and not isinstance(self.pg, BufferProvider):  # in-process: synchronized
            dist.barrier(group=self.pg)
        SymmetricBuffer._cache.pop(self.key, None)
        mapping, self._mapping, self._ptr_tables = self._mapping, None, None
        self.extras.clear()
        mapping.peers.clear()
        release = mapping.release
        del mapping
        release()

    @property
    def freed(self) -> bool:
        return self._mapping is None

    def _live(self) -> Mapping:
        if self._mapping is None:
            raise RuntimeError(f"symmetric buffer {self.key} was freed")
        return self._mapping

    # -- views and addresses --------------------------------------------------------------------

    def _view(self, q: int, offset: int, shape, dtype: torch.dtype, limit: int) -> torch.Tensor:
        m = self._live()
        if not 0 <= q < self.world:
            raise IndexError(f"rank {q} is not in [0, {self.world})")
        esize = torch.empty((), dtype=dtype).element_size()
        shape = (limit - offset) // esize if shape is None else shape
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = 1
        for d in shape:
            n *= int(d)
        if offset < 0 or offset % esize or offset + n * esize > limit:
            raise ValueError(f"a {list(shape)} {dtype} view at byte {offset} does not fit in "
                             f"{limit} bytes (or is misaligned)")
        return m.peers[q][offset:offset + n * esize].view(dtype).view(shape)

    def peer(self, q: int, shape=None, dtype: torch.dtype = torch.uint8, offset: int = 0) -> torch.Tensor:
        """Rank q's data area (bytes [offset, ...)) as a ``shape`` ``dtype`` tensor on this device."""
        return self._view(q, offset, shape, dtype, self.data_bytes)

    def local_view(self, shape=None, dtype: torch.dtype = torch.uint8, offset: int = 0) -> torch.Tensor:
        return self.peer(self.rank, shape, dtype, offset)

    def pad(self, q: Optional[int] = None) -> torch.Tensor:
        """Rank q's signal pad (this rank's when None): int32 [PAD_INTS]."""
        q = self.rank if q is None else q
        m = self._live()
        return m.peers[q][self.data_bytes:self.total_bytes].view(torch.int32)

    def flags(self, q: Optional[int] = None, count: int = MAX_FLAGS) -> torch.Tensor:
        """Rank q's chunk flags (pad words FLAG_OFFSET ...): int32 [count]."""
        if not 0 < count <= MAX_FLAGS:
            raise ValueError(f"count must be in [1, {MAX_FLAGS}], got {count}")
        return self.pad(q)[FLAG_OFFSET:FLAG_OFFSET + count]

    @property
    def buffer_ptrs(self) -> List[int]:
        return list(self._live().ptrs)

    @property
    def pad_ptrs(self) -> List[int]:
        return [p + self.data_bytes for p in self._live().ptrs]

    def _copy_tables(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(self.buffer_ptrs, dtype=torch.int64).to(self.device),
                torch.tensor(self.pad_ptrs, dtype=torch.int64).to(self.device))

    def _tables(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._ptr_tables is None:  # freed: _live() names the error
            self._live()
        return self._ptr_tables

    @property
    def buffer_ptrs_dev(self) -> torch.Tensor:
        return self._tables()[0]

    @property
    def pad_ptrs_dev(self) -> torch.Tensor:
        return self._tables()[1]

    # -- epochs ----------------------------------------------------------------------------------

    def next_epoch(self) -> int:
        """The epoch of the next call on this buffer (1, 2, ...; the same sequence on every rank,
        since every call is collective). Before the int32 pad words could overflow, the pads are
        zeroed on every rank (collective, host-synchronous) and the count restarts."""
        self._live()
        if self._epoch >= EPOCH_LIMIT:
            self._reset_pads()
        self._epoch += 1
        return self._epoch

    @property
    def epoch(self) -> int:
        return self._epoch

    def _reset_pads(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.world > 1:
            dist.barrier(group=self.pg)
        self.pad().zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.world > 1:
            dist.barrier(group=self.pg)
        self._epoch = 0

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"epoch {self._epoch}"
        return (f"SymmetricBuffer({self.data_bytes} B, group {self.group_name or '<local>'!r}, rank "
                f"{self.rank}/{self.world}, {self.backend} on {self.device}, {state})")


def live_buffers(group=None) -> List[SymmetricBuffer]:
    """This process's live buffers (of ``group`` only, if given), smallest first."""
    name = None if group is None else _group_name(resolve_group(group))
    bufs = [b for k, b in SymmetricBuffer._cache.items() if name is None or k[0] == name]
    return sorted(bufs, key=lambda b: (b.key[0], b.key[1], b.key[2], b.data_bytes))


def free_all(group=None) -> int:
    """Free every live buffer (of ``group``); collective over each buffer's group, in a fixed
    order. Returns how many were freed."""
    bufs = live_buffers(group)
    for b in bufs:
        b.free()
    return len(bufs)
