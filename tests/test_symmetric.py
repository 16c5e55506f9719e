"""pyfused.comm.symmetric: size classes, the cache, free bookkeeping, the handle exchange (with a
mock and across real processes through the host-shm backend), the CPU verdict, epochs; on GPUs
(marked gpu) the torch and IPC backends, peers' writes, and that freeing returns the memory."""
import os

import pytest
import torch

from pyfused.comm import symmetric as sm

TIMEOUT = 60


def test_size_classes():
    assert sm.size_class(1) == sm.MIN_SIZE_CLASS
    assert sm.size_class(sm.MIN_SIZE_CLASS) == sm.MIN_SIZE_CLASS
    assert sm.size_class(sm.MIN_SIZE_CLASS + 1) == 2 * sm.MIN_SIZE_CLASS
    assert sm.size_class(3 << 20) == 4 << 20
    assert sm.size_class(4 << 20) == 4 << 20
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="positive int"):
            sm.size_class(bad)


def test_cpu_reports_unavailable_with_reason():
    ok, why = sm.symmetric_status("cpu")
    assert not ok and "need CUDA tensors (got cpu)" in why
    with pytest.raises(sm.SymmetricUnavailable, match="need CUDA tensors"):
        sm.SymmetricBuffer.get(None, 100, "cpu")
    assert sm.symmetric_status("cpu", "host-shm") == (True, "")
    ok, why = sm.symmetric_status("cpu", "nvshmem")
    assert not ok and "unknown symmetric-memory backend 'nvshmem'" in why
    if not torch.cuda.is_available():
        ok, why = sm.symmetric_status("cuda")
        assert not ok and "no CUDA device" in why


def test_layout_matches_the_extension():
    from pyfused import _ext

    if _ext.load() is None:
        pytest.skip(f"pyfused._C not built: {_ext.load_error()}")
    sm.check_layout()


def _record(**kw):
    base = dict(nbytes=1 << 16, backend="ipc", device_type="cuda", device_index=0, host="h", handle=b"x")
    base.update(kw)
    return sm.Record(**base)


def test_check_records_is_a_pure_verdict(monkeypatch):
    monkeypatch.delenv(sm.OVERLAP_ENV, raising=False)
    assert sm.check_records([_record(device_index=i) for i in range(4)]) is None
    msg = sm.check_records([_record(), _record(error="RuntimeError: out of memory")])
    assert msg == "rank 1 could not allocate its buffer: RuntimeError: out of memory"
    msg = sm.check_records([_record(), _record(nbytes=1 << 17)])
    assert "nbytes differs between ranks: rank 0 has 65536, rank 1 has 131072" in msg
    assert "2 hosts" in sm.check_records([_record(), _record(host="other", device_index=1)])
    assert "at most 8" in sm.check_records([_record(device_index=i) for i in range(9)])
    shared = [_record(backend="torch"), _record(backend="torch")]
    assert "ranks 0 and 1 share cuda:0" in sm.check_records(shared)
    monkeypatch.setenv(sm.OVERLAP_ENV, "1")
    monkeypatch.setattr(sm, "_torch_symm_backend", lambda index: "CUDA")
    assert sm.check_records(shared) is None
    monkeypatch.setattr(sm, "_torch_symm_backend", lambda index: "NVSHMEM")
    assert "NVSHMEM, which cannot host several ranks on one GPU: set TORCH_SYMMMEM=CUDA" in \
        sm.check_records(shared)
    assert sm.check_records([_record(backend="torch", device_index=i) for i in range(2)]) is None
    assert sm.check_records([_record(), _record()]) is None  # IPC maps a shared device as is


def test_gather_records_with_a_mock_gather():
    """The exchange logic with a fake all_gather_object: rank order is kept, one call is made."""
    calls = []

    class FakeGroup:
        pass

    def fake_gather(out, obj, group):
        calls.append(group)
        out[:] = [obj, _record(device_index=1)]

    import pyfused.comm.symmetric as mod

    orig = mod._world_size
    mod._world_size = lambda pg: 2
    try:
        got = sm.gather_records(FakeGroup(), _record(), fake_gather)
    finally:
        mod._world_size = orig
    assert len(calls) == 1 and [r.device_index for r in got] == [0, 1]
    assert sm.gather_records(None, _record()) == [_record()]  # world 1: no collective


def test_a_buffer_provider_serves_its_own_buffers():
    """comm asks a group that is a ``BufferProvider`` for its buffers and its rank and size: no
    exchange, and freeing one of its buffers waits for no peer."""
    from pyfused import comm
    from pyfused.comm.group import BufferProvider

    class TwoRanksInOneList(BufferProvider):
        def __init__(self, rank, allocs):
            self.rank, self.world, self.group_name, self.allocs = rank, 2, f"pair/r{rank}", allocs
            self.asked = []

        def symmetric_buffer(self, data_bytes, device):
            self.asked.append((data_bytes, device))
            mapping = sm.Mapping(self.allocs[self.rank], list(self.allocs),
                                 [t.data_ptr() for t in self.allocs])
            return sm.SymmetricBuffer(self, data_bytes, device, "provided", mapping,
                                      (self.group_name, str(device), "provided", data_bytes))

    allocs = [torch.zeros(sm.MIN_SIZE_CLASS + sm.PAD_BYTES, dtype=torch.uint8) for _ in range(2)]
    provider = TwoRanksInOneList(1, allocs)
    assert comm.resolve_group(provider) is provider
    assert (comm.rank(provider), comm.world_size(provider)) == (1, 2)
    assert comm.group_name(provider) == "pair/r1"
    buf = sm.SymmetricBuffer.get(provider, 100, "cpu")
    assert provider.asked == [(sm.MIN_SIZE_CLASS, torch.device("cpu"))]
    assert buf.buffer_ptrs == [t.data_ptr() for t in allocs]
    buf.free()  # a torch.distributed barrier here would raise: no process group exists
    assert buf.freed


# --- real processes, host shared memory ----------------------------------------------------------

def _check_views(buf, rank, world):
    """Every rank sees every peer's data and pad where the address lists say (views die here, so
    that free() can unmap)."""
    from pyfused.comm.symmetric import FLAG_OFFSET

    for q in range(world):
        got = buf.peer(q, (10,), torch.float32)
        assert torch.equal(got, torch.arange(10.0) + 100 * q), (q, got)
        assert buf.peer(q).data_ptr() == buf.buffer_ptrs[q]
        assert buf.pad(q).data_ptr() == buf.pad_ptrs[q] == buf.buffer_ptrs[q] + buf.data_bytes
    assert buf.flags(count=world).tolist() == [1 + q for q in range(world)]
    assert buf.pad()[FLAG_OFFSET:FLAG_OFFSET + world].tolist() == [1 + q for q in range(world)]
    assert buf.buffer_ptrs_dev.tolist() == buf.buffer_ptrs


def _exchange_and_cache(rank, world):
    import torch.distributed as dist

    from pyfused.comm.symmetric import SymmetricBuffer, live_buffers

    buf = SymmetricBuffer.get(None, 3000, "cpu", backend="host-shm")
    assert buf.data_bytes == sm.MIN_SIZE_CLASS and buf.world == world and buf.rank == rank
    assert SymmetricBuffer.get(None, 100, "cpu", backend="host-shm") is buf  # same size class
    assert bool((buf.pad() == 0).all()), "pads start at zero"
    dist.barrier()  # nobody writes into a peer's pad before every rank has looked at its own
    buf.local_view((10,), torch.float32).copy_(torch.arange(10.0) + 100 * rank)
    for q in range(world):  # write into every peer's pad: slot `rank` of its flags
        buf.flags(q, count=world)[rank] = 1 + rank
    dist.barrier()
    _check_views(buf, rank, world)
    assert [buf.next_epoch() for _ in range(3)] == [1, 2, 3]

    big = SymmetricBuffer.get(None, sm.MIN_SIZE_CLASS + 1, "cpu", backend="host-shm")
    assert big is not buf and big.data_bytes == 2 * sm.MIN_SIZE_CLASS
    sizes = [b.data_bytes for b in live_buffers()]
    assert sizes == [sm.MIN_SIZE_CLASS, 2 * sm.MIN_SIZE_CLASS], sizes
    with pytest.raises(IndexError):
        buf.peer(world)
    with pytest.raises(ValueError, match="does not fit"):
        buf.peer(0, (buf.data_bytes + 4,))

    buf.free()
    assert buf.freed and live_buffers() == [big]
    with pytest.raises(RuntimeError, match="was freed"):
        buf.local_view()
    buf.free()  # a second free is a no-op
    assert sm.free_all() == 1 and live_buffers() == []
    again = SymmetricBuffer.get(None, 100, "cpu", backend="host-shm")
    assert again is not buf and bool((again.pad() == 0).all())
    again.free()
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exchange_cache_and_free_across_processes(ranks, world):
    assert all(ranks.run(world, _exchange_and_cache, timeout=TIMEOUT))


def _segments_after_free(rank, world):
    import torch.distributed as dist

    from pyfused.comm.symmetric import SymmetricBuffer

    dist.barrier()
    before = set(os.listdir("/dev/shm"))
    for size in (100, 70000, 100):
        buf = SymmetricBuffer.get(None, size, "cpu", backend="host-shm")
        buf.local_view((4,), torch.int32).fill_(rank)
        buf.free()
    dist.barrier()  # every rank has freed (free itself ends the last use with a barrier)
    return sorted(set(os.listdir("/dev/shm")) - before)


def test_free_leaves_no_shared_memory_segment(ranks):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    leftovers = ranks.run(3, _segments_after_free, timeout=TIMEOUT)
    assert leftovers == [[], [], []], leftovers


def _mismatched_sizes(rank, world):
    from pyfused.comm.symmetric import SymmetricBuffer, SymmetricUnavailable

    try:
        SymmetricBuffer.get(None, 100 if rank == 0 else 1 << 20, "cpu", backend="host-shm")
    except SymmetricUnavailable as e:
        return str(e)
    return None


def test_mismatched_sizes_same_error_everywhere(ranks):
    errors = ranks.run(2, _mismatched_sizes, timeout=TIMEOUT)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert "nbytes differs between ranks" in errors[0]


def _epoch_reset(rank, world):
    from pyfused.comm.symmetric import EPOCH_LIMIT, SymmetricBuffer

    buf = SymmetricBuffer.get(None, 1 << 18, "cpu", backend="host-shm")
    buf.pad().fill_(EPOCH_LIMIT)
    buf._epoch = EPOCH_LIMIT
    assert buf.next_epoch() == 1
    assert bool((buf.pad() == 0).all())
    buf.free()
    return True


def test_epochs_restart_with_zeroed_pads(ranks):
    assert all(ranks.run(2, _epoch_reset, timeout=TIMEOUT))


# --- GPU -----------------------------------------------------------------------------------------

def _need_nccl_pool():
    if "nccl" not in os.environ.get("PYFUSED_TEST_BACKEND", "gloo"):
        pytest.skip("multi-rank GPU runs need PYFUSED_TEST_BACKEND=nccl "
                    "(benchmarks/gpu_check.sh step symm_w2 sets it)")


def _gpu_peers_and_free(rank, world, backend):
    import torch.distributed as dist

    from pyfused.comm.symmetric import SymmetricBuffer, live_buffers

    dev = torch.device("cuda", torch.cuda.current_device())
    buf = SymmetricBuffer.get(None, 1 << 20, dev, backend=backend)
    assert bool((buf.pad() == 0).all())
    for q in range(world):  # write into every peer's buffer through the mapping
        buf.peer(q, (world, 16), torch.float32)[rank].fill_(float(rank + 1))
    torch.cuda.synchronize()
    dist.barrier()
    mine = buf.local_view((world, 16), torch.float32)
    assert mine[:, 0].tolist() == [float(q + 1) for q in range(world)], mine[:, 0]
    assert [buf.peer(q).data_ptr() for q in range(world)] == buf.buffer_ptrs
    buf.free()
    # Leak check: allocate and free the same class many times; device memory must come back.
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(dev)[0]
    for _ in range(20):
        SymmetricBuffer.get(None, 8 << 20, dev, backend=backend).free()
    torch.cuda.synchronize()
    lost = free_before - torch.cuda.mem_get_info(dev)[0]
    assert lost < 64 << 20, f"{lost / 2**20:.1f} MiB of device memory not returned after 20 get/free"
    assert live_buffers() == []
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "ipc"])
@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"w{w}")
def test_gpu_peer_writes_and_free(ranks, world, backend):
    if world == 1:
        assert _gpu_world1(backend)
        return
    _need_nccl_pool()
    assert all(ranks.run(world, _gpu_peers_and_free, backend, timeout=300))


def _gpu_world1(backend):
    from pyfused.comm.symmetric import SymmetricBuffer

    buf = SymmetricBuffer.get(None, 1000, "cuda", backend=backend)
    assert buf.backend == "local" and buf.world == 1 and bool((buf.pad() == 0).all())
    buf.local_view((4,), torch.float32).fill_(3.0)
    assert buf.peer(0, (4,), torch.float32).tolist() == [3.0] * 4
    buf.free()
    return True
