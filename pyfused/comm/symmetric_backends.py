"""The memory behind ``SymmetricBuffer`` (pyfused/comm/symmetric.py): one class per backend.

A backend allocates this rank's zeroed allocation (data + signal pad), describes it for the peers
(a picklable record the buffer's exchange gathers), and maps the peers' allocations into this
process. ``symmetric.py``'s module docstring and docs/TESTBED.md say when each is used.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch


class SymmetricUnavailable(RuntimeError):
    """Symmetric buffers cannot be set up here (or for this group); the message says why, and is
    the same on every rank when raised by a collective step."""


@dataclass
class Mapping:
    """This rank's allocation and every rank's, as uint8 tensors of ``total`` bytes on this rank's
    device (``peers[rank]`` is ``local``); ``release`` undoes what the backend set up."""

    local: torch.Tensor
    peers: List[torch.Tensor]
    ptrs: List[int]
    release: Callable[[], None] = field(default=lambda: None, repr=False)


class Backend:
    name = "?"

    def status(self, device: torch.device) -> Optional[str]:
        """None if this backend can serve ``device`` in this process, else why not."""
        raise NotImplementedError

    def allocate(self, total: int, device: torch.device) -> Tuple[torch.Tensor, Any, Any]:
        """(local zeroed uint8 tensor, picklable record for peers, private state)."""
        raise NotImplementedError

    def open(self, records: Sequence[Any], rank: int, local: torch.Tensor, state: Any, total: int,
             device: torch.device, pg) -> Mapping:
        raise NotImplementedError


class LocalBackend(Backend):
    """World size 1: nothing to exchange."""

    name = "local"

    def status(self, device):
        return None

    def allocate(self, total, device):
        return torch.zeros(total, dtype=torch.uint8, device=device), None, None

    def open(self, records, rank, local, state, total, device, pg):
        return Mapping(local, [local], [local.data_ptr()])


class TorchSymmetricMemoryBackend(Backend):
    name = "torch"

    def status(self, device):
        if device.type != "cuda":
            return f"torch symmetric memory serves CUDA devices, not {device.type}"
        try:
            from torch._C._distributed_c10d import _SymmetricMemory
        except ImportError as e:
            return f"this torch has no symmetric memory ({e})"
        if not hasattr(_SymmetricMemory, "empty_strided_p2p") or not hasattr(_SymmetricMemory, "rendezvous"):
            return "this torch's _SymmetricMemory lacks empty_strided_p2p/rendezvous"
        return None

    def allocate(self, total, device):
        from torch._C._distributed_c10d import _SymmetricMemory

        # empty_strided_p2p directly (not symm_mem.empty, which in torch >= 2.14 may carve the tensor
        # out of a shared pool segment): the tensor is then the start of its own allocation, so the
        # handle's buffer_ptrs are exactly our buffers.
        local = _SymmetricMemory.empty_strided_p2p((total,), (1,), torch.uint8, device)
        local.zero_()
        torch.cuda.synchronize(device)
        return local, None, None

    def open(self, records, rank, local, state, total, device, pg):
        import warnings

        from torch.distributed import _symmetric_memory as symm_mem

        # Older torch needs the group's store registered first (enable_symm_mem_for_group); newer
        # torch (2.14 here) finds it itself and marks that call deprecated (PEP 702
        # ``__deprecated__``), so it is made only where it is not deprecated.
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if (enable is not None and not getattr(enable, "__deprecated__", None)
                and not symm_mem.is_symm_mem_enabled_for_group(pg.group_name)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(pg.group_name)
        handle = symm_mem.rendezvous(local, pg.group_name)
        ptrs = list(handle.buffer_ptrs)
        if ptrs[rank] != local.data_ptr():
            raise SymmetricUnavailable(
                f"torch symmetric memory mapped this rank's buffer at {ptrs[rank]:#x}, but the tensor "
                f"starts at {local.data_ptr():#x} (an allocation offset this code does not handle)")
        peers = [local if q == rank else handle.get_buffer(q, (total,), torch.uint8, 0)
                 for q in range(len(ptrs))]
        return Mapping(local, peers, ptrs, release=lambda: None)


class CudaIpcBackend(Backend):
    name = "ipc"

    def status(self, device):
        if device.type != "cuda":
            return f"CUDA IPC serves CUDA devices, not {device.type}"
        from .. import _ext

        if _ext.load() is None:
            return f"CUDA IPC needs pyfused._C ({_ext.load_error()})"
        if not hasattr(torch.ops.pyfused, "ipc_open"):
            return "pyfused._C was built without csrc/allreduce.cpp (no ipc_alloc/ipc_open): rebuild it"
        return None

    def allocate(self, total, device):
        local = torch.ops.pyfused.ipc_alloc(total, device.index)
        return local, bytes(torch.ops.pyfused.ipc_handle(local).tolist()), None

    def open(self, records, rank, local, state, total, device, pg):
        peers = []
        for q, rec in enumerate(records):
            if q == rank:
                peers.append(local)
            else:
                handle = torch.tensor(list(rec), dtype=torch.uint8)
                peers.append(torch.ops.pyfused.ipc_open(handle, total, device.index))
        # Dropping the tensors runs the C++ deleters: cudaIpcCloseMemHandle for peers, cudaFree for ours.
        return Mapping(local, peers, [p.data_ptr() for p in peers])


class HostSharedMemoryBackend(Backend):
    """CPU processes of one host, through POSIX shared memory (tests and CPU models only)."""

    name = "host-shm"

    def status(self, device):
        if device.type != "cpu":
            return f"host shared memory serves CPU tensors, not {device.type}"
        return None

    def allocate(self, total, device):
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(create=True, size=total)
        local = torch.frombuffer(shm.buf, dtype=torch.uint8, count=total)
        local.zero_()
        return local, shm.name, shm

    def open(self, records, rank, local, state, total, device, pg):
        import _posixshmem  # CPython's own shm_open, what multiprocessing.shared_memory uses
        import mmap

        maps = {rank: state}
        peers = []
        for q, name in enumerate(records):
            if q == rank:
                peers.append(local)
                continue
            # Mapped directly, not through SharedMemory: that would register the peer's segment
            # with this process's resource tracker, which unlinks it (or, when the tracker is
            # shared with the creator, forgets the creator's registration) behind the creator's back.
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            try:
                maps[q] = mmap.mmap(fd, total)
            finally:
                os.close(fd)
            peers.append(torch.frombuffer(maps[q], dtype=torch.uint8, count=total))

        def release():
            import gc

            for q, m in sorted(maps.items()):
                try:
                    m.close()
                except BufferError:  # a view may only be waiting for the cycle collector
                    gc.collect()
                try:
                    m.close()
                except BufferError:
                    raise RuntimeError(
                        f"host-shm buffer of rank {q}: a tensor viewing it is still referenced; drop "
                        f"every view before free()") from None
                if q == rank:
                    m.unlink()

        return Mapping(local, peers, [p.data_ptr() for p in peers], release=release)


BACKENDS: Dict[str, Backend] = {b.name: b for b in (
    LocalBackend(), TorchSymmetricMemoryBackend(), CudaIpcBackend(), HostSharedMemoryBackend())}
